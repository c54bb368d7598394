"""`method=grpo` end to end on the tiny model: it learns a reward (the reward curve rises),
generation is a measured phase, the KL to a reference starts at exactly 0, it runs under DDP
and FSDP2 (generation inside the wrappers), and bad settings are rejected before loading."""

from __future__ import annotations

import pytest

from memlab._guards import has

pytestmark = pytest.mark.integration

LEARN = ["method=grpo", "method.rewards=[memlab_testing:reward_low_ids]",
         "method.max_completion_length=8", "train.batch_size=4", "method.num_generations=8",
         "train.scheduler=constant"]
# Tests that check what a run learns, not what it measures, leave the memory tracker off: it
# slows each step it runs ~3x, and measure.memory_steps=auto tracks every step whose batch is
# the largest so far, which in RL (completions of varying length) is several (online DPO's 15
# steps: 6 of them). The tracker changes no number: online DPO's and RLOO's learning runs below
# gave the same loss and reward curves, to the last digit, tracked (auto) and untracked.
# summary["memory"]["models"] (the parameter counts) is recorded either way.
UNTRACKED = ["measure.memory=false"]


def test_grpo_learns_a_reward_and_measures_generation(job):
    s = job(LEARN + ["train.steps=20", "train.lr=5e-2", "measure.memory_steps=1"])
    assert s["status"] == "ok", s["error"]
    reward = s["train"]["curves"]["reward"]
    assert len(reward) == 20
    # ~0.5 at random; the policy learns to emit the rewarded half of the vocabulary. Measured
    # (fp32, train.seed 0-9, each on AVX-512 kernels and on AVX2 ones, ATEN_CPU_CAPABILITY=avx2
    # ONEDNN_MAX_CPU_ISA=AVX2): first-3 mean 0.48-0.54. At 14 steps the last-3 mean was >= 0.996
    # in 17 of the 20 runs but 0.84-0.85 in 3 still climbing (seed 0 on AVX-512 only, seed 2 on
    # both): the window sat mid-climb, where the kernels' rounding decides. At 20 steps all 20
    # runs end at exactly 1.0; the slowest was last below 1.0 at step 17 (its curve 3 steps
    # later would still average > 0.94). Untrained (lr 1e-9, seeds 0-4, both kernels): every
    # step 0.43-0.61, last-3 mean 0.47-0.53.
    assert sum(reward[:3]) / 3 < 0.7 and sum(reward[-3:]) / 3 > 0.9, reward
    lengths = s["train"]["curves"]["completions/mean_length"]
    assert all(0 < n <= 8 for n in lengths)
    by_phase = s["memory"]["by_phase"]
    assert list(by_phase)[0] == "generate" and by_phase["generate"] > 0
    # generation holds no gradients and no autograd graph: less than the training forward
    assert by_phase["generate"] < by_phase["backward"]
    assert s["data"]["tokens_trained"] > 0


def test_share_prompt_trains_the_same_with_less_memory(job):
    """method.share_prompt=true stores each prompt once for its 4 completions in the training
    forward and backward: the loss and reward curves of the unshared rows (the invariance
    tests compare the gradients), a lower measured activation peak; refused where the
    attention cannot show a completion its prompt alone."""
    o = LEARN + ["train.steps=2", "train.lr=5e-2", "measure.memory_steps=all",
                 "train.batch_size=2", "method.num_generations=4",
                 "method.max_completion_length=2", "method.max_prompt_length=128",
                 "data.median_tokens=300"]
    plain = job(o + ["method.share_prompt=false"])
    shared = job(o)  # the default where the attention can (sdpa with per-document kernels)
    assert plain["status"] == shared["status"] == "ok", shared["error"]
    for k in ("reward", "completions/mean_length"):
        assert shared["train"]["curves"][k] == plain["train"]["curves"][k], k
    assert shared["train"]["loss_curve"] == pytest.approx(plain["train"]["loss_curve"],
                                                          rel=1e-4, abs=1e-6)
    # the step peaks in its optimizer update (a tiny model): the training phases tell;
    # ~130-token prompts, 2 new tokens: 4 x fewer tokens in the forward (measured 0.61 x)
    act = {k: s["memory"]["by_phase_category"]["backward"]["activations"]
           for k, s in (("plain", plain), ("shared", shared))}
    assert act["shared"] < 0.75 * act["plain"], act
    bad = job(o + ["method.share_prompt=true", "attention.varlen=false"])
    assert bad["status"] == "invalid" and "method.share_prompt=false" in bad["error"]


def test_grpo_with_a_reward_model(job):
    """A reward *model* (a tiny random sequence classifier, model-group overrides) scores the
    completions in the generate phase: it is one more frozen model in memory, its score is
    logged per step, and GRPO raises it."""
    o = [x for x in LEARN if not x.startswith("method.rewards")]
    s = job(o + ["method.rewards=[]", "train.steps=8", "train.lr=5e-2", *UNTRACKED,
                 "method.reward_models=[{hidden_size: 32, num_layers: 1, seed: 3}]"])
    assert s["status"] == "ok", s["error"]
    models = s["memory"]["models"]
    assert models["reward_model_0"]["trainable"] == 0 and models["reward_model_0"]["bytes"] > 0
    score = s["train"]["curves"]["rewards/model_0"]
    assert score == s["train"]["curves"]["reward"]  # the only reward, weight 1
    assert sum(score[-3:]) / 3 > sum(score[:3]) / 3, score
    bad = job(o + ["method.reward_models=[{hidden_size: 32, nonsense: 1}]"])
    assert bad["status"] == "invalid" and "reward_models[0].nonsense" in bad["error"]


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_num_iterations_trains_each_rollout_several_times(job, method):
    """num_iterations=2: one generation batch per two optimizer steps (the same completions
    and rewards on both, half the prompts drawn); the generation-time log-probs make the
    first step's ratio exactly 1 (nothing clipped); the second step trains the moved policy
    against them."""
    o = [x.replace("method=grpo", f"method={method}") for x in LEARN] + [
        "train.lr=5e-2", *UNTRACKED, "train.steps=4", "method.num_iterations=2"]
    s = job(o)
    assert s["status"] == "ok", s["error"]
    c = s["train"]["curves"]
    for key in ("reward", "completions/mean_length"):
        assert c[key][0] == c[key][1] and c[key][2] == c[key][3], (key, c[key])
        assert c[key][1] != c[key][2] or c["reward"][0] != c["reward"][2]
    assert c["clip_ratio"][0] == 0.0 and c["clip_ratio"][2] == 0.0
    loss = s["train"]["loss_curve"]
    assert loss[1] != loss[0]  # the same rollouts, a moved policy
    # its first two steps are enough: a new rollout at step 1
    once = job([x.replace("method.num_iterations=2", "method.num_iterations=1")
                .replace("train.steps=4", "train.steps=2") for x in o])
    assert once["status"] == "ok", once["error"]
    assert once["train"]["curves"]["reward"][0] == c["reward"][0]  # the same first rollout
    assert once["train"]["curves"]["reward"][1] != c["reward"][1]  # a new one every step
    bad = job(o + ["train.save_every=3"])
    assert bad["status"] == "invalid" and "multiple of method.num_iterations" in bad["error"]


def test_kl_to_a_reference_copy_starts_at_zero(job):
    s = job(LEARN + ["train.steps=2", "train.lr=5e-2", "method.beta=0.1", *UNTRACKED])
    assert s["status"] == "ok", s["error"]
    kl = s["train"]["curves"]["kl"]
    assert kl[0] == 0.0  # the policy is the reference before its first update
    assert kl[-1] > 0.0
    models = s["memory"]["models"]
    assert models["reference"]["bytes"] == models["policy"]["bytes"]


def test_grpo_generates_through_ddp(job):
    """Generation inside the DDP wrapper; through FSDP2 and ZeRO-3 (both sharded):
    test_generation_gathered_once_or_per_layer_samples_the_same, whose runs assert the same."""
    s = job(LEARN + ["train.steps=2", "distributed=ddp", "distributed.nproc=2",
                     "train.batch_size=2", "measure.memory_steps=1"])
    assert s["status"] == "ok", s["error"]
    assert len(s["distributed"]["ranks"]) == 2
    assert len(s["train"]["curves"]["reward"]) == 2
    assert s["memory"]["by_phase"]["generate"] > 0


@pytest.mark.parametrize("dist", [
    ["distributed=fsdp2"],
    # (no prefetch, no reuse kept gathered: ZeRO-3's coordinator keeps a layer-by-layer
    # generate's weights gathered less often so; see the assertions at the end)
    pytest.param(["distributed=deepspeed", "distributed.zero_stage=3",
                  "distributed.stage3_prefetch_bucket_size=0",
                  "distributed.stage3_max_reuse_distance=0"],
                 marks=pytest.mark.skipif(not has("deepspeed"), reason="deepspeed extra")),
], ids=["fsdp2", "deepspeed-zero3"])
def test_generation_gathered_once_or_per_layer_samples_the_same(job, dist):
    """Sharded weights (FSDP2, ZeRO-3): gathering them once for the whole generate call (TRL's
    ds3_gather_for_generation) or layer by layer at every decoding step gives the same
    completions and so the same run; gathering once holds the whole weights while sampling.
    Both runs also generate through the sharded wrapper as the DDP one does
    (test_grpo_generates_through_ddp): two ranks, a reward per step, a measured generate phase.
    (Step 0 tracked: its generate phase is where the two differ in memory.) LEARN's reward:
    the default one (length) is the same for every 8-token completion, whose zero advantages
    would train nothing, and step 1 would sample from unmoved weights."""
    o = ["method=grpo", "method.rewards=[memlab_testing:reward_low_ids]",
         "method.num_generations=2", "method.max_completion_length=8",
         "train.batch_size=2", "train.steps=2", "measure.memory_steps=1",
         "distributed.nproc=2", *dist]
    once = job(o + ["distributed.gather_for_generation=true"])  # the default
    layered = job(o + ["distributed.gather_for_generation=false"])
    for s in (once, layered):
        assert s["status"] == "ok", s["error"]
        assert len(s["distributed"]["ranks"]) == 2
        assert len(s["train"]["curves"]["reward"]) == 2
        assert s["memory"]["by_phase"]["generate"] > 0
    assert once["train"]["loss_curve"] == pytest.approx(layered["train"]["loss_curve"],
                                                        rel=1e-5)
    assert once["train"]["curves"]["completions/mean_length"] == \
        layered["train"]["curves"]["completions/mean_length"]
    assert once["train"]["curves"]["reward"] == layered["train"]["curves"]["reward"]
    if dist[0] == "distributed=deepspeed":  # the tracker sees ZeRO-3's gathered weights
        params = {(k, phase): r["memory"]["by_phase_category"][phase]["parameters"]
                  for k, r in (("once", once), ("layered", layered))
                  for phase in ("forward", "generate")}
        # gathered once: the whole weights are held as parameters while sampling, above the
        # shards a training forward holds
        assert params["once", "generate"] > params["once", "forward"], params
        # layer by layer: never more than the whole. (Not "less": DeepSpeed's coordinator
        # keeps a layered generate's weights gathered in some runs and not others, as its trace
        # and its two ranks' timing go, even with no prefetch and no reuse distance: 6.40 MB
        # against 5.43-5.49 for the phase, one run in ~10 under load.)
        assert params["layered", "generate"] <= params["once", "generate"], params
    # (FSDP2 gathers into storage it resizes in place, which the CPU tracker does not see; the
    # toggle's effect on FSDP2 units is asserted in test_distributed.py)


def test_bad_grpo_settings_are_rejected_together(job):
    s = job(["method=grpo", "method.num_generations=1", "packing=bfd",
             "method.rewards=[nope]", "method.beta=0.1", "method.reference=adapter_disabled"])
    assert s["status"] == "invalid"
    for needle in ("num_generations must be >= 2", "packing=bfd does not apply",
                   "unknown reward 'nope'", "reference=adapter_disabled"):
        assert needle in s["error"], (needle, s["error"])


def test_rloo_learns_with_a_kl_penalty_in_the_reward(job):
    """RLOO (leave-one-out baseline, sequence-level KL folded into the reward): the reward
    rises, the KL starts at exactly 0 and grows as the policy leaves the reference."""
    o = [x.replace("method=grpo", "method=rloo") for x in LEARN]
    s = job(o + ["train.steps=12", "train.lr=5e-2", "method.beta=0.01", *UNTRACKED])
    assert s["status"] == "ok", s["error"]
    reward, kl = s["train"]["curves"]["reward"], s["train"]["curves"]["kl"]
    # unnormalised leave-one-out advantages learn more slowly than GRPO's (0.48 -> ~0.86 here)
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.25, reward
    assert kl[0] == 0.0 and kl[-1] > 0.0
    assert "reference" in s["memory"]["models"]


def test_online_dpo_starts_at_log2_and_learns(job):
    """Online DPO: at step 0 the policy is the reference, so every pair's loss is exactly
    log 2; the reward of the sampled pairs rises."""
    import math

    o = [x.replace("method=grpo", "method=online_dpo") for x in LEARN
         if not x.startswith("method.num_generations")]
    s = job(o + ["train.steps=15", "train.lr=1e-1", "train.batch_size=8", *UNTRACKED])
    assert s["status"] == "ok", s["error"]
    assert s["train"]["loss_curve"][0] == pytest.approx(math.log(2), abs=1e-6)
    reward = s["train"]["curves"]["reward"]
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.3, reward  # ~0.5 -> ~0.95


def test_ppo_trains_policy_and_value_with_a_frozen_reference(job):
    """PPO: four roles in memory (policy, frozen reference, trainable value model; rewards from
    functions), the KL is exactly 0 at step 0, the optimizer updates the value model too (its
    gradients are counted), and the value model learns the returns (its loss falls)."""
    o = [x.replace("method=grpo", "method=ppo") for x in LEARN
         if not x.startswith("method.num_generations")]
    s = job(o + ["train.steps=12", "train.lr=3e-2", "train.batch_size=16",
                 "measure.memory_steps=1"])  # step 0: generate, both models' gradients
    assert s["status"] == "ok", s["error"]
    c = s["train"]["curves"]
    assert c["kl"][0] == 0.0
    assert sum(c["loss/value"][-3:]) / 3 < 0.5 * c["loss/value"][0], c["loss/value"]
    models = s["memory"]["models"]
    assert models["reference"]["trainable"] == 0
    assert models["value"]["trainable"] == models["value"]["total"] > 0
    grads = s["memory"]["by_phase_category"]["optimizer"]["gradients"]
    assert grads == models["policy"]["bytes"] + models["value"]["bytes"]
    assert s["memory"]["by_phase"]["generate"] > 0


def test_ppo_is_single_process_for_now(job):
    s = job(["method=ppo", "distributed=ddp", "distributed.nproc=2"])
    assert s["status"] == "invalid" and "use distributed=single" in s["error"]
