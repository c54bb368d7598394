"""GRPO's pieces without a training run: group advantages, the loss's gradient against the
policy-gradient formula it must equal on-policy, normalisations, reward functions, prompts."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memlab.data.base import DataError
from memlab.losses import token_logps
from memlab.method import _rollout
from memlab.method._rollout import RewardModel, prompt_and_reference
from memlab.method.base import Batch
from memlab.method.grpo import GRPO, advantages


def test_advantages_are_group_relative():
    r = torch.tensor([1.0, 3.0, 5.0, 5.0, 2.0, 2.0])
    a = advantages(r, 2, "none")
    torch.testing.assert_close(a, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    g = advantages(r, 2, "group")  # std of [1, 3] is sqrt(2)
    torch.testing.assert_close(g[:2], torch.tensor([-1.0, 1.0]) / (2**0.5 + 1e-4))
    assert g[2:].abs().max() == 0  # equal rewards in a group: no signal
    b = advantages(r, 3, "batch")
    torch.testing.assert_close(b.view(2, 3).sum(1), torch.zeros(2), atol=1e-6, rtol=0)


def _rollout_batch(model=None, g=3, seed=0):
    """Two prompts (one shorter: padded rows) with ``g`` completions each (one ended early),
    laid out as the online methods' training batch, random advantages; and each completion's
    token log-probs computed alone (prompt + completion, no padding): the reference."""
    from memlab.method._rollout import training_tensors

    torch.manual_seed(seed)
    prompts = [torch.randint(3, 60, (n,)).tolist() for n in (4, 2)]
    comps = [torch.randint(3, 60, (5,)).tolist() for _ in range(2 * g)]
    comps[1] = comps[1][:2]
    t, real, total = training_tensors(prompts, comps, [True] * 2 * g, g, 0, share=False,
                                      flat=False, mask=True)
    t.update(advantages=torch.randn(2 * g), seq_valid=torch.ones(2 * g, dtype=torch.bool))
    batch = Batch(t, num_items=sum(len(c) for c in comps), real_tokens=real, total_tokens=total)
    alone = None
    if model is not None:
        alone = []
        for i, c in enumerate(comps):
            p = prompts[i // g]
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1]
            alone.append(token_logps(logits, torch.tensor(c)))
    return batch, alone


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_on_policy_gradient_is_the_policy_gradient(tiny, loss_type):
    """ratio = exp(logp - logp.detach()) is 1, and its gradient is A * grad logp: the loss's
    gradient equals the REINFORCE formula with group advantages, under each normalisation."""
    method = GRPO(loss_type=loss_type, num_generations=3, max_completion_length=5)
    batch, _ = _rollout_batch()
    t = batch.tensors
    tiny.zero_grad()
    loss, _ = method.loss({"policy": tiny}, batch, None)
    loss.backward()
    ours = [p.grad.clone() for p in tiny.parameters()]

    tiny.zero_grad()
    _, alone = _rollout_batch(tiny)
    a = t["advantages"]
    per_seq = torch.stack([a[i] * lp.sum() for i, lp in enumerate(alone)])
    n_tok = torch.tensor([float(len(lp)) for lp in alone])
    if loss_type == "dapo":
        ref = -per_seq.sum()
    elif loss_type == "grpo":
        ref = -(per_seq / n_tok).sum()
    else:
        ref = -per_seq.sum() / 5
    ref.backward()
    # value: the same normalisation of -A per token (ratio is exactly 1)
    n = {"dapo": 1.0, "dr_grpo": 5.0}.get(loss_type)
    value = -(a * n_tok / n_tok).sum() if n is None else -(a * n_tok).sum() / n
    torch.testing.assert_close(loss.detach(), value)
    for g1, p in zip(ours, tiny.parameters(), strict=True):
        torch.testing.assert_close(g1, p.grad, rtol=1e-4, atol=1e-7)


def test_zero_advantages_give_no_gradient(tiny):
    method = GRPO(num_generations=3)
    batch, _ = _rollout_batch()
    batch.tensors["advantages"].zero_()
    tiny.zero_grad()
    loss, _ = method.loss({"policy": tiny}, batch, None)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in tiny.parameters())


def test_builtin_rewards():
    m = GRPO(target_length=4)
    length = _rollout.resolve("length", m)
    assert length(["a", "b"], completion_ids=[[1, 2, 3, 4], [1, 2]]) == [0.0, -0.5]
    fin = _rollout.resolve("finished", m)
    assert fin(["x", "y"], finished=[True, False]) == [1.0, 0.0]
    f1 = _rollout.resolve("reference_f1", m)
    assert f1(["the cat sat", "dog"], references=["The cat", "cat"]) == pytest.approx([0.8, 0.0])
    custom = _rollout.resolve("memlab_testing:reward_low_ids", m)
    assert custom([""], completion_ids=[[1, 4000]]) == [0.5]
    with pytest.raises(ValueError, match="built-in: length, finished, reference_f1"):
        _rollout.resolve("nope", m)
    with pytest.raises(ValueError, match="cannot import"):
        _rollout.resolve("no_such_module:fn", m)


def test_prompts_from_conversations_and_preference_rows():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}]
    prompt, ref = prompt_and_reference({"messages": msgs}, 0)
    assert prompt == msgs[:2] and ref == "a"
    prompt, ref = prompt_and_reference({"prompt": "2+2?", "chosen": "4"}, 1)
    assert (prompt, ref) == ("2+2?", "4")
    with pytest.raises(DataError, match="row 2: field 'messages' has no user turn"):
        prompt_and_reference({"messages": [{"role": "assistant", "content": "a"}]}, 2)


def test_rloo_leave_one_out_baseline():
    from memlab.method.rloo import leave_one_out

    r = torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0])
    # 1 - (2+6)/2, 2 - (1+6)/2, 6 - (1+2)/2; an all-equal group gets 0
    torch.testing.assert_close(leave_one_out(r, 3), torch.tensor([-3.0, -1.5, 4.5, 0, 0, 0]))
    # with 2 per group: r_i - r_j
    torch.testing.assert_close(leave_one_out(torch.tensor([1.0, 3.0]), 2),
                               torch.tensor([-2.0, 2.0]))


def test_rloo_gradient_is_sequence_level_reinforce(tiny):
    from memlab.method.rloo import RLOO

    method = RLOO(num_generations=3, beta=0.0)
    batch, _ = _rollout_batch(seed=1)
    t = batch.tensors
    tiny.zero_grad()
    loss, _ = method.loss({"policy": tiny}, batch, None)
    loss.backward()
    ours = [p.grad.clone() for p in tiny.parameters()]
    tiny.zero_grad()
    _, alone = _rollout_batch(tiny, seed=1)
    logps = torch.stack([lp.sum() for lp in alone])
    (-(t["advantages"] * logps).sum()).backward()
    torch.testing.assert_close(loss.detach(), -t["advantages"].sum())
    for g1, p in zip(ours, tiny.parameters(), strict=True):
        torch.testing.assert_close(g1, p.grad, rtol=1e-4, atol=1e-7)


def test_online_dpo_pairs_chosen_and_rejected(tiny):
    """Rewards pick the chosen completion of each pair (missing-EOS penalty included); the
    loss is DPO on exactly those pairs."""
    import copy

    from memlab.losses import dpo_loss
    from memlab.method.online_dpo import OnlineDPO

    m = OnlineDPO(missing_eos_penalty=1.0)
    t = {"finished": torch.tensor([True, False, True, True])}
    metrics: dict = {}
    # pair 0: 0.2 vs 0.5 - 1 (no EOS) -> first; pair 1: 0.1 vs 0.3 -> second
    sign = m.advantages_for({}, torch.tensor([0.2, 0.5, 0.1, 0.3]), t, metrics, None)
    assert sign.tolist() == [1.0, -1.0, -1.0, 1.0]

    batch, _ = _rollout_batch(g=2, seed=2)  # 4 rows = 2 pairs
    batch.tensors["advantages"] = sign
    ref = copy.deepcopy(tiny)
    with torch.no_grad():  # a reference that differs from the policy
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss, met = m.loss({"policy": tiny, "reference": ref}, batch, None)
    with torch.no_grad():
        lp = torch.stack([x.sum() for x in _rollout_batch(tiny, g=2, seed=2)[1]])
        rp = torch.stack([x.sum() for x in _rollout_batch(ref, g=2, seed=2)[1]])
    expect, _, _ = dpo_loss(lp[[0, 3]], lp[[1, 2]], rp[[0, 3]], rp[[1, 2]], beta=0.1)
    torch.testing.assert_close(loss.detach(), expect.sum())
    assert 0.0 <= met["rewards/accuracies"] <= 1.0


def test_gae_matches_the_recursion_by_hand():
    from memlab.method.ppo import gae

    # one row: 2 prompt positions (masked out), 3 completion tokens
    r = torch.tensor([[0.0, 0.0, 0.1, -0.2, 1.0]])
    v = torch.tensor([[9.0, 9.0, 0.5, 0.4, 0.3]])
    m = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0]])
    g, lam = 0.9, 0.8
    d4 = 1.0 - 0.3
    d3 = -0.2 + g * 0.3 - 0.4
    d2 = 0.1 + g * 0.4 - 0.5
    a4 = d4
    a3 = d3 + g * lam * a4
    a2 = d2 + g * lam * a3
    torch.testing.assert_close(gae(r, v, m, g, lam), torch.tensor([[0, 0, a2, a3, a4]]))


def test_reward_model_scores_are_padding_invariant_and_last_token():
    """A reward model scores each text at its last real token: scoring texts of different
    lengths in one right-padded batch gives each text's score alone, which is the head's output
    at the last position of an unpadded forward."""
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaForSequenceClassification

    import memlab

    tok = AutoTokenizer.from_pretrained(Path(memlab.__file__).parent / "assets" / "tokenizer")
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1)).eval()
    scorer = RewardModel(rm, tok)
    texts = ["a short answer", "a much longer answer with many more words in it, and more",
             "mid length text here"]
    batch = scorer.score(texts)
    assert batch.shape == (3,)
    for i, text in enumerate(texts):
        alone = scorer.score([text])
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            direct = rm.model(input_ids=ids).last_hidden_state[:, -1] @ rm.score.weight.T
        torch.testing.assert_close(batch[i], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(alone[0], direct[0, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(batch[0], batch[1])  # the texts are scored, not a constant


def test_reused_rollouts_use_the_generation_time_logps(tiny):
    """num_iterations > 1: the ratio is to the log-probs recorded at generation time. Recorded
    from the same weights they give exactly the on-policy loss and gradient; once the policy
    has moved past the clip (ratio e > 1 + epsilon on every token, positive advantages) the
    surrogate is flat: zero gradient, every token counted in clip_ratio."""
    method = GRPO(num_generations=3, num_iterations=2)
    batch, _ = _rollout_batch()
    t = batch.tensors
    with torch.no_grad():
        old = method.completion_logps(tiny, t, None)

    def grads(tensors):
        tiny.zero_grad()
        loss, metrics = method.loss({"policy": tiny}, Batch(tensors, num_items=1,
                                                           real_tokens=1, total_tokens=1), None)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in tiny.parameters()], metrics

    on_loss, on_grads, on_m = grads(dict(t))
    re_loss, re_grads, re_m = grads({**t, "old_logps": old})
    torch.testing.assert_close(re_loss, on_loss)
    for a, b in zip(re_grads, on_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert on_m["clip_ratio"] == re_m["clip_ratio"] == 0.0
    moved = {**t, "old_logps": old - 1.0, "advantages": t["advantages"].abs() + 0.1}
    _, flat, m = grads(moved)
    assert all(float(g.abs().max()) == 0.0 for g in flat)
    assert m["clip_ratio"] == 1.0


def _varlen_tiny():
    """A tiny Llama with memlab's per-document sdpa (shared-prompt rows need it)."""
    from memlab.attention._varlen import register

    register()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="memlab_sdpa_varlen")


def _prompts_and_samples(g: int, rewards: list[float]):
    from memlab.generation.base import samples_from

    torch.manual_seed(3)
    prompts = [torch.randint(3, 60, (n,)).tolist() for n in (6, 3, 5)]
    comp = torch.randint(3, 60, (3 * g, 5))
    comp[1, 2] = 1  # an EOS: a shorter completion
    batch = Batch({"prompt_ids": torch.zeros(3, 6, dtype=torch.long)}, num_items=0,
                  real_tokens=0, total_tokens=0, meta={"prompt_ids": prompts, "pad": 0})
    return batch, samples_from(comp, 1, 0), torch.tensor(rewards)


@pytest.mark.parametrize("share", [False, True], ids=["padded", "share_prompt"])
@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_zero_advantage_completions_are_left_out_with_the_same_loss(name, share):
    """GRPO with beta=0 and RLOO: a group whose rewards are all equal has advantages exactly 0,
    adds nothing to the loss and is left out of the training batch (its prompt too); the loss
    normaliser still counts it, so loss and gradients equal those of the whole batch (an
    estimate's placeholder samples keep every completion: the comparison). With every group
    left out one unscored row remains: zero loss, zero gradient."""
    import types

    from memlab.method.base import LOSS_INDEX
    from memlab.method.rloo import RLOO
    from memlab.registry import lookup

    model = _varlen_tiny()
    ctx = types.SimpleNamespace(attention=lookup("attention", "sdpa")())
    cls = GRPO if name == "grpo" else RLOO
    method = cls(num_generations=3, beta=0.0, share_prompt=share)
    batch, samples, rewards = _prompts_and_samples(3, [0.1, 0.5, 0.4, 0.7, 0.7, 0.7,
                                                       0.2, 0.9, 0.4])

    def loss_and_grads(real: bool, r: torch.Tensor):
        metrics: dict = {}
        out = method.training_batch({"policy": model}, batch, samples, r.clone(), metrics, ctx,
                                    real)
        model.zero_grad()
        loss, _ = method.loss({"policy": model}, out, ctx)
        (loss / out.num_items).backward()
        return out, metrics, loss.detach(), [p.grad.clone() for p in model.parameters()]

    skip, m_skip, l_skip, g_skip = loss_and_grads(True, rewards)
    full, m_full, l_full, g_full = loss_and_grads(False, rewards)
    assert skip.tensors["advantages"][3:6].eq(0).all()  # exactly 0, not a rounding
    assert m_skip["completions/skipped"] == pytest.approx(1 / 3)
    assert "completions/skipped" not in m_full  # placeholder samples: nothing decided
    assert skip.num_items == full.num_items  # the normaliser counts the left-out group
    assert skip.tensors[LOSS_INDEX].numel() == full.tensors[LOSS_INDEX].numel() - 15
    assert skip.real_tokens <= full.real_tokens - 15 - (3 if share else 9)  # and its prompt
    torch.testing.assert_close(l_skip, l_full, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_skip, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(float(g.abs().max()) > 0 for g in g_full)

    none, m_none, l_none, g_none = loss_and_grads(True, torch.full((9,), 0.5))
    assert m_none["completions/skipped"] == 1.0
    assert none.tensors["input_ids"].shape[0] == 1 and l_none == 0
    assert none.tensors["completion_mask"].sum() == 0
    assert all(float(g.abs().max()) == 0 for g in g_none)
