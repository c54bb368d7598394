"""`method=grpo` end to end with `generation=vllm`, colocated (an in-process engine) and through
a real `memlab vllm-serve` process: the run learns the test reward, and at every step the
engine samples from exactly the policy the trainer holds.

The second claim is what the importance-sampling metrics measure: with
``generation.importance_sampling_correction=true`` every step compares vLLM's log-probs of the
tokens it sampled with the trainer's own forward on them (the policy at generation time). The
ratio is exactly 1 (fp32, 1e-6) only if the trainer's weights reached the engine after every
optimizer step. Measured without the weight sync (one-off, the engine keeping the first
weights, lr 5e-2): the maximum ratio was 2.39 after one step and 27.9 after five, and the reward
stayed at 0.5.

A step-for-step match with `generation=hf` cannot hold here: vLLM and transformers draw their
samples from different random streams (greedy decoding, where they agree token for token, gives
GRPO groups of identical completions and nothing to learn; tests/generation/test_vllm_colocate.py
and test_vllm_server.py compare them greedily)."""

from __future__ import annotations

import pytest

from generation.vllm_helpers import (
    KV_GIB,
    SKIP_NO_VLLM,
    free_port,
    start_server,
    stop_server,
    tiny_model,
)

pytestmark = [pytest.mark.vllm, SKIP_NO_VLLM]
STEPS = 10
# tests/integration/test_grpo.py's learning settings; 2 heads: head size 32 (vLLM's CPU
# attention has no head size 16)
LEARN = ["method=grpo", "method.rewards=[memlab_testing:reward_low_ids]",
         "method.max_completion_length=8", "train.batch_size=4", "method.num_generations=8",
         "train.scheduler=constant", f"train.steps={STEPS}", "train.lr=5e-2",
         "model.num_heads=2", "model.num_kv_heads=1",
         "generation=vllm", f"generation.kv_cache_space_gib={KV_GIB}",
         "generation.importance_sampling_correction=true"]


def assert_learns_from_the_trained_policy(s: dict) -> None:
    assert s["status"] == "ok", s["error"]
    c = s["train"]["curves"]
    reward = c["reward"]
    assert len(reward) == STEPS
    # ~0.5 at random; the policy learns to emit the rewarded half of the vocabulary
    assert sum(reward[:3]) / 3 < 0.7 and sum(reward[-3:]) / 3 > 0.85, reward
    # vLLM sampled from the trainer's weights at every step (see the module docstring); a step
    # whose every completion had zero advantage (all rewarded alike, once the policy learned)
    # trains on no token and has no ratio to show (0.0)
    skipped = c["completions/skipped"]
    trained = [i for i in range(STEPS) if skipped[i] < 1]
    assert len(trained) >= STEPS // 2, skipped
    assert all(abs(c["vllm/is_ratio_max"][i] - 1) < 1e-3 for i in trained), c["vllm/is_ratio_max"]
    assert all(abs(c["vllm/is_ratio_mean"][i] - 1) < 1e-4 for i in trained), \
        c["vllm/is_ratio_mean"]
    assert all(f == 0 for f in c["vllm/is_capped_fraction"])
    sync = c["generation/weight_sync_s"]
    assert sync[0] == 0.0 and all(t > 0 for t in sync[1:]), sync  # one push per optimizer step
    assert all(0 < n <= 8 for n in c["completions/mean_length"])
    engine = s["memory"]["generation_engine"]  # what vLLM holds, outside the trainer's tensors
    assert engine["kv_cache_bytes"] == int(KV_GIB * 2**30)
    assert engine["weights_bytes"] == s["memory"]["models"]["policy"]["bytes"]
    assert s["memory"]["by_phase"]["generate"] > 0


def test_grpo_learns_with_a_colocated_vllm_engine(job, tmp_path):
    s = job(LEARN + ["generation.mode=colocate"])
    assert_learns_from_the_trained_policy(s)
    # `memlab estimate` of the same configuration counts what the engine measured holding
    import json

    from memlab.cli.estimate import main as estimate_main
    from memlab_testing import with_fast

    assert estimate_main([*with_fast(LEARN + ["generation.mode=colocate"]),
                          "--out", str(tmp_path / "est")]) == 0
    est = json.loads((tmp_path / "est" / "estimate.json").read_text())
    engine = s["memory"]["generation_engine"]
    # the engine starts before step 0 and works inside the probe's `untracked`: its KV cache
    # (256 MiB) and the weights / buffers its modules hold are not counted again as the
    # trainer's (they were: generate >= 256 MiB, parameters and other +2 MiB each)
    mem = s["memory"]
    assert mem["by_phase"]["generate"] < engine["kv_cache_bytes"]
    assert mem["by_category"]["parameters"] == mem["models"]["policy"]["bytes"]
    assert mem["by_category"]["other"] < engine["buffers_bytes"]
    assert est["generation_engine"]["weights_bytes"] == engine["weights_bytes"]
    assert est["generation_engine"]["kv_cache_bytes"] == engine["kv_cache_bytes"]


def test_grpo_learns_through_a_vllm_server_process(job, tmp_path):
    from memlab.generation._vllm_engine import save_config
    from memlab.generation.vllm import Vllm
    from memlab.generation.vllm_client import ServerEngine

    model, _ = tiny_model()  # the run's architecture (its weights are pushed by the run)
    save_config(model, str(tmp_path / "model"))
    port = free_port()
    client = ServerEngine(Vllm(mode="server", port=port, server_timeout_s=300))
    with open(tmp_path / "server.log", "w") as log:
        proc = start_server(str(tmp_path / "model"), port, log)
        try:
            client.connect()  # ready before the run: its own wait is for a running server
            s = job(LEARN + ["generation.mode=server", f"generation.port={port}",
                             "generation.server_timeout_s=30"])
            health = client._call("/health")
        finally:
            stop_server(proc, client)
    if s["status"] != "ok":
        s["error"] += "\nserver log:\n" + (tmp_path / "server.log").read_text()[-3000:]
    assert_learns_from_the_trained_policy(s)
    # the run pushed its weights once before its first generation and once per step after it
    assert health["weight_version"] == STEPS
    assert proc.returncode == 0
