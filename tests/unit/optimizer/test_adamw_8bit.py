"""optimizer=adamw_8bit where bitsandbytes is missing (the main environment): refused before
anything loads, naming the install; the layouts it cannot take are refused too. Training,
the tracker's categories, the estimate and resuming with bitsandbytes on CPU:
tests/cpu_kernels/test_adamw_8bit.py."""

from __future__ import annotations

from memlab import _guards
from memlab.config import Platform
from unit.optimizer.steps import problems

WITH_BNB = Platform(assume_installed=frozenset({"bitsandbytes"}))


def test_without_bitsandbytes_the_error_names_the_install(monkeypatch):
    monkeypatch.setattr(_guards, "has", lambda m: m != "bitsandbytes")
    text = problems("optimizer=adamw_8bit")
    assert "'bitsandbytes' package" in text and "setup_cpu_kernels.sh" in text
    assert "optimizer=adamw" in text
    assert problems("optimizer=adamw_8bit", platform=WITH_BNB) == ""


def test_dtensors_and_split_embeddings_are_refused():
    text = problems("optimizer=adamw_8bit", "distributed=fsdp2", platform=WITH_BNB)
    assert "DTensor" in text and "sharding rule" in text
    text = problems("optimizer=adamw_8bit", "optimizer.embedding_states_32bit=true",
                    "distributed=deepspeed", platform=WITH_BNB)
    assert "embedding_states_32bit" in text and "flat partitions" in text
    assert problems("optimizer=adamw_8bit", "distributed=deepspeed", platform=WITH_BNB) == ""
