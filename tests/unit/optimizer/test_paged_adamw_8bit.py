"""optimizer=paged_adamw_8bit: CUDA only (unified memory), refused on a CPU run with the option
to use instead; valid on a CUDA machine."""

from __future__ import annotations

from memlab.config import Platform
from unit.optimizer.steps import problems


def test_refused_on_cpu_valid_on_cuda():
    cpu = problems("optimizer=paged_adamw_8bit",
                   platform=Platform(assume_installed=frozenset({"bitsandbytes"})))
    assert "unified memory" in cpu and "use optimizer=adamw_8bit" in cpu
    cuda = problems("optimizer=paged_adamw_8bit", "train.device=cuda",
                    platform=Platform.cuda_machine(gpus=1))
    assert cuda == ""
