"""GRPO's pieces without a training run: group advantages, the loss's gradient against the
policy-gradient formula it must equal on-policy, normalisations, reward functions, prompts."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memlab.data.base import DataError
from memlab.losses import token_logps
from memlab.method import _rewards
from memlab.method._online import _prompt_and_reference
from memlab.method._rewards import RewardModel
from memlab.method.base import IGNORE, Batch
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


def _rollout_batch(model, g=3, seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(3, 60, (2 * g, 9))
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # a left-padded prompt
    labels = torch.full_like(ids, IGNORE)
    labels[:, 3:-1] = ids[:, 4:]  # completion tokens from position 4
    labels[1, 6:] = IGNORE  # a completion that ended early
    adv = torch.randn(2 * g)
    t = {"input_ids": ids, "attention_mask": attn,
         "position_ids": (attn.cumsum(1) - 1).clamp(min=0), "labels": labels,
         "advantages": adv, "seq_valid": torch.ones(2 * g, dtype=torch.bool)}
    return Batch(t, num_items=int((labels != IGNORE).sum()), real_tokens=int(attn.sum()),
                 total_tokens=ids.numel())


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
    batch = _rollout_batch(tiny)
    t = batch.tensors
    tiny.zero_grad()
    loss, _ = method.loss({"policy": tiny}, batch, None)
    loss.backward()
    ours = [p.grad.clone() for p in tiny.parameters()]

    tiny.zero_grad()
    inputs = {k: t[k] for k in ("input_ids", "attention_mask", "position_ids")}
    logits = tiny(**inputs).logits[:, :-1]
    labels = t["labels"][:, :-1]
    logps = token_logps(logits, labels, IGNORE)
    mask = (labels != IGNORE).float()
    a = t["advantages"][:, None]
    per_seq = (a * logps * mask).sum(1)
    if loss_type == "dapo":
        ref = -per_seq.sum()
    elif loss_type == "grpo":
        ref = -(per_seq / mask.sum(1)).sum()
    else:
        ref = -per_seq.sum() / 5
    ref.backward()
    # value: the same normalisation of -A per token (ratio is exactly 1)
    n = {"dapo": 1.0, "dr_grpo": 5.0}.get(loss_type)
    value = -((a * mask).sum(1) / mask.sum(1)).sum() if n is None else -(a * mask).sum() / n
    torch.testing.assert_close(loss.detach(), value)
    for g1, p in zip(ours, tiny.parameters(), strict=True):
        torch.testing.assert_close(g1, p.grad, rtol=1e-4, atol=1e-7)


def test_zero_advantages_give_no_gradient(tiny):
    method = GRPO(num_generations=3)
    batch = _rollout_batch(tiny)
    batch.tensors["advantages"].zero_()
    tiny.zero_grad()
    loss, _ = method.loss({"policy": tiny}, batch, None)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in tiny.parameters())


def test_builtin_rewards():
    m = GRPO(target_length=4)
    length = _rewards.resolve("length", m)
    assert length(["a", "b"], completion_ids=[[1, 2, 3, 4], [1, 2]]) == [0.0, -0.5]
    fin = _rewards.resolve("finished", m)
    assert fin(["x", "y"], finished=[True, False]) == [1.0, 0.0]
    f1 = _rewards.resolve("reference_f1", m)
    assert f1(["the cat sat", "dog"], references=["The cat", "cat"]) == pytest.approx([0.8, 0.0])
    custom = _rewards.resolve("memlab_testing:reward_low_ids", m)
    assert custom([""], completion_ids=[[1, 4000]]) == [0.5]
    with pytest.raises(ValueError, match="built-in: length, finished, reference_f1"):
        _rewards.resolve("nope", m)
    with pytest.raises(ValueError, match="cannot import"):
        _rewards.resolve("no_such_module:fn", m)


def test_prompts_from_conversations_and_preference_rows():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}]
    prompt, ref = _prompt_and_reference({"messages": msgs}, 0)
    assert prompt == msgs[:2] and ref == "a"
    prompt, ref = _prompt_and_reference({"prompt": "2+2?", "chosen": "4"}, 1)
    assert (prompt, ref) == ("2+2?", "4")
    with pytest.raises(DataError, match="row 2: field 'messages' has no user turn"):
        _prompt_and_reference({"messages": [{"role": "assistant", "content": "a"}]}, 2)


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
    batch = _rollout_batch(tiny, seed=1)
    t = batch.tensors
    tiny.zero_grad()
    loss, _ = method.loss({"policy": tiny}, batch, None)
    loss.backward()
    ours = [p.grad.clone() for p in tiny.parameters()]
    tiny.zero_grad()
    inputs = {k: t[k] for k in ("input_ids", "attention_mask", "position_ids")}
    logps = token_logps(tiny(**inputs).logits[:, :-1], t["labels"][:, :-1], IGNORE).sum(1)
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
    sign = m.advantages_for({}, torch.tensor([0.2, 0.5, 0.1, 0.3]), t, metrics)
    assert sign.tolist() == [1.0, -1.0, -1.0, 1.0]

    batch = _rollout_batch(tiny, g=2, seed=2)  # 4 rows = 2 pairs
    batch.tensors["advantages"] = sign
    ref = copy.deepcopy(tiny)
    with torch.no_grad():  # a reference that differs from the policy
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss, met = m.loss({"policy": tiny, "reference": ref}, batch, None)
    t = batch.tensors
    inputs = {k: t[k] for k in ("input_ids", "attention_mask", "position_ids")}
    lab = t["labels"][:, :-1]
    with torch.no_grad():
        lp = token_logps(tiny(**inputs).logits[:, :-1], lab, IGNORE).sum(1)
        rp = token_logps(ref(**inputs).logits[:, :-1], lab, IGNORE).sum(1)
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
    batch = _rollout_batch(tiny)
    t = batch.tensors
    inputs = {k: t[k] for k in ("input_ids", "attention_mask", "position_ids")}
    labels = t["labels"][:, :-1]
    with torch.no_grad():
        old = token_logps(tiny(**inputs).logits[:, :-1], labels, IGNORE)

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
