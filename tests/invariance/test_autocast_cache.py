"""``precision.autocast_cache`` (bf16_mixed, fp16_mixed): false, memlab's default, casts a weight
at each use instead of keeping autocast's copy of every trained weight until the forward ends.
The same loss curve bit for bit; under gradient checkpointing a lower forward peak, by about the
low-precision copies of the trained weights; without checkpointing the same peaks (each copy is
saved for the backward either way). Tiny SFT runs at bf16_mixed (explicit: no machine choice),
every step tracked: tracked memory is exact on any CPU."""

from __future__ import annotations

import pytest

from memlab_testing import run_job

TINY = ["precision=bf16_mixed", "train.steps=2", "measure.memory_steps=all",
        "model.hidden_size=128", "model.intermediate_size=256", "model.vocab_size=4096",
        "method.max_length=256", "data.n_examples=8", "data.median_tokens=3000"]
# the decoder's trained linear weights (2 layers x (q, k, v, o at 128 x 128, kv at 64 wide with
# 2 of 4 heads; gate, up, down at 128 x 256)) in bf16: what the cache keeps through a forward
LINEARS = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) * 2


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_autocast_cache_changes_memory_not_numbers(tmp_path, checkpointing):
    gc = f"train.gradient_checkpointing={str(checkpointing).lower()}"
    runs = {cache: run_job(tmp_path, [*TINY, gc, f"precision.autocast_cache={cache}"],
                           name=f"cache-{cache}")
            for cache in ("true", "false")}
    on, off = runs["true"], runs["false"]
    assert on["status"] == off["status"] == "ok"
    assert off["choices"]["precision"] == "bf16_mixed" and not off["resolved"]
    assert on["train"]["loss_curve"] == off["train"]["loss_curve"]  # bit for bit
    fwd_on, fwd_off = on["memory"]["by_phase"]["forward"], off["memory"]["by_phase"]["forward"]
    if checkpointing:
        saved = fwd_on - fwd_off
        assert saved >= LINEARS, (saved, LINEARS, on["config"]["precision"],  # (the head's
                                  on["memory"]["peak_at"], off["memory"]["peak_at"])  # copy too)
        assert on["memory"]["by_phase"]["backward"] == off["memory"]["by_phase"]["backward"]
    else:
        assert on["memory"]["by_phase"] == off["memory"]["by_phase"]
