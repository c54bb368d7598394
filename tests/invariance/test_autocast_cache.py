"""``precision.autocast_cache`` (bf16_mixed, fp16_mixed): false, memlab's default, casts a weight
at each use instead of keeping autocast's copy of every trained weight until the forward ends.
The same loss curve bit for bit; under gradient checkpointing a lower forward peak, by about the
low-precision copies of the trained weights; without checkpointing the same peaks (each copy is
saved for the backward either way). Tiny SFT runs at bf16_mixed (explicit: no machine choice),
every step tracked: tracked memory is exact on any CPU.

The two runs of a case run in a fresh process, as a user's run does: inside the full suite's
long-lived workers the checkpointed case twice measured no saving at all (both forward peaks
equal, the config's cache on), never alone, in its directory, beside another run or after
test_estimate; the cause was not found (the guard now also watches autocast's nesting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["precision=bf16_mixed", "train.steps=2", "measure.memory_steps=all",
        "model.hidden_size=128", "model.intermediate_size=256", "model.vocab_size=4096",
        "method.max_length=256", "data.n_examples=8", "data.median_tokens=3000"]
# the decoder's trained linear weights (2 layers x (q, k, v, o at 128 x 128, kv at 64 wide with
# 2 of 4 heads; gate, up, down at 128 x 256)) in bf16: what the cache keeps through a forward
LINEARS = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) * 2
BOTH = """
import json, sys
from pathlib import Path
from memlab_testing import run_job
out = {c: run_job(Path(sys.argv[1]), json.loads(sys.argv[2]) + [f"precision.autocast_cache={c}"],
                  name=f"cache-{c}") for c in ("true", "false")}
print(json.dumps(out, default=str))
"""


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_autocast_cache_changes_memory_not_numbers(tmp_path, checkpointing):
    gc = f"train.gradient_checkpointing={str(checkpointing).lower()}"
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", BOTH, str(tmp_path), json.dumps([*TINY, gc])],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    on, off = runs["true"], runs["false"]
    assert on["status"] == off["status"] == "ok"
    assert off["choices"]["precision"] == "bf16_mixed" and not off["resolved"]
    assert on["config"]["precision"]["autocast_cache"] is True
    assert on["train"]["loss_curve"] == off["train"]["loss_curve"]  # bit for bit
    fwd_on, fwd_off = on["memory"]["by_phase"]["forward"], off["memory"]["by_phase"]["forward"]
    if checkpointing:
        saved = fwd_on - fwd_off
        assert saved >= LINEARS, (saved, LINEARS)  # (the head's copy may add to it)
        assert on["memory"]["by_phase"]["backward"] == off["memory"]["by_phase"]["backward"]
    else:
        assert on["memory"]["by_phase"] == off["memory"]["by_phase"]
