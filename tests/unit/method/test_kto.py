"""method=kto pieces: pairs -> desirable + undesirable examples, unpaired rows, mismatched (KL)
completions, collate, and the loss wiring against the closed form on hand-made log-probs."""

from __future__ import annotations

import math
import sys
import types

import datasets
import pytest
import torch

from memlab.data.assets import load_tokenizer
from memlab.data.base import DataError
from memlab.losses import sequence_logps
from memlab.method import _layout
from memlab.method.base import IGNORE, Batch
from memlab.method.kto import KTO, mismatched_partners


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_mismatched_partner_has_another_prompt():
    prompts = [[1], [1], [2], [2], [3], [3]]
    partners = mismatched_partners(prompts)
    assert partners == [2, 2, 4, 4, 0, 0]
    assert all(prompts[j] != prompts[i] for i, j in enumerate(partners))
    assert mismatched_partners([[1], [1]]) == [1, 0]  # nothing differs: the next one


def _pairs(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_list([
        {"prompt": f"question number {i} about music", "chosen": f"careful answer {i}",
         "rejected": "whatever"} for i in range(n)])


def test_pairs_become_one_desirable_and_one_undesirable_example(tok):
    out, stats = KTO().prepare(_pairs(3), tok, None)
    assert len(out) == 6 and stats.examples == 6 and stats.examples_dropped == 0
    assert out["label"] == [True, False] * 3
    assert stats.extra == {"desirable": 3, "undesirable": 3, "empty_completions": 0}
    assert out["prompt_ids"][0] == out["prompt_ids"][1]
    assert tok.decode(out["completion_ids"][0]).startswith("careful answer 0")
    assert tok.decode(out["completion_ids"][1]).startswith("whatever")
    for i in range(6):  # the KL completion belongs to an example with another prompt
        j = mismatched_partners(out["prompt_ids"])[i]
        assert out["prompt_ids"][j] != out["prompt_ids"][i]
        assert out["kl_completion_ids"][i] == out["completion_ids"][j]


def test_unpaired_rows_and_bad_labels(tok):
    rows = [{"prompt": "a", "completion": "good", "label": True},
            {"prompt": "b", "completion": "bad", "label": False}]
    out, _ = KTO().prepare(datasets.Dataset.from_list(rows), tok, None)
    assert out["label"] == [True, False]
    rows[0]["label"], rows[1]["label"] = 1, 3  # ints: 0/1 are fine, anything else is not
    with pytest.raises(DataError, match="row 1: field 'label'"):
        KTO().prepare(datasets.Dataset.from_list(rows), tok, None)
    with pytest.raises(DataError, match="method=kto needs"):
        KTO().prepare(datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}]), tok,
                      None)


def test_truncation_drops_and_fits_the_kl_sequence(tok):
    rows = [{"prompt": "music " * 40, "chosen": "x " * 30, "rejected": "y"},
            {"prompt": "short", "chosen": "z " * 30, "rejected": "w"}]
    out, stats = KTO(max_length=20, max_prompt_length=None).prepare(
        datasets.Dataset.from_list(rows), tok, None)
    assert stats.examples_dropped == 2 and len(out) == 2  # the long prompt's two examples
    for p, c, k in zip(out["prompt_ids"], out["completion_ids"], out["kl_completion_ids"]):
        assert len(p) + len(c) <= 20 and len(p) + len(k) <= 20


def test_collate_main_and_kl_sequences():
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "kl_completion_ids": [6],
             "label": True},
            {"prompt_ids": [7], "completion_ids": [8], "kl_completion_ids": [3, 4, 5],
             "label": False}]
    b = KTO()._collate(rows, pad_id=0)
    t = b.tensors
    assert b.num_items == 2 and b.real_tokens == 7
    assert t["input_ids"].shape == (2, 5) and t["kl_input_ids"].shape == (2, 4)
    assert t["label"].tolist() == [True, False]
    assert (t["labels"] != IGNORE).sum(1).tolist() == [3, 1]
    assert (t["kl_labels"] != IGNORE).sum(1).tolist() == [1, 3]
    f = KTO(padding_free=True)._collate(rows, pad_id=0).tensors
    assert f["input_ids"].shape == (1, 7) and f["kl_input_ids"].shape == (1, 7)
    assert f["kl_segment_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1]


POLICY = [-5.0, -9.0, -7.0]
REF = [-6.0, -8.0, -7.5]
POLICY_KL = [-20.0, -18.0, -25.0]
REF_KL = [-21.0, -18.5, -25.5]
LABELS = [True, False, True]


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_loss_is_the_closed_form_sum_with_detached_kl(monkeypatch):
    seen = []

    def fake(model, t, n, prefix="", attention=None):
        seen.append((prefix, torch.is_grad_enabled()))
        vals = POLICY_KL if prefix == "kl_" else POLICY
        return torch.tensor(vals, requires_grad=torch.is_grad_enabled()), torch.ones(3)

    monkeypatch.setattr(_layout, "completion_logps", fake)
    beta, wd, wu = 0.5, 1.5, 0.75
    t = {"label": torch.tensor(LABELS), "ref_logps": torch.tensor(REF),
         "ref_kl_logps": torch.tensor(REF_KL)}
    loss, m = KTO(beta=beta, desirable_weight=wd, undesirable_weight=wu).loss(
        {"policy": object()}, Batch(t, num_items=3, real_tokens=1, total_tokens=1), None)
    kl = max(0.0, sum(p - r for p, r in zip(POLICY_KL, REF_KL)) / 3)
    assert m["kl"] == pytest.approx(kl)
    want = 0.0
    for p, r, d in zip(POLICY, REF, LABELS):
        want += wd * (1 - _sig(beta * ((p - r) - kl))) if d else wu * (1 - _sig(beta * (kl - (p - r))))
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert ("kl_", False) in seen and ("", True) in seen  # KL policy pass has no grad
    assert m["rewards/chosen"] == pytest.approx(beta * ((-5 + 6) + (-7 + 7.5)) / 2)
    assert m["rewards/rejected"] == pytest.approx(beta * (-9 + 8))
    assert m["logps/chosen"] == pytest.approx(-6.0) and m["desirable_fraction"] == pytest.approx(2 / 3)


class _FakeLigerKTO(torch.nn.Module):
    """Stand-in with Liger's KTO interface: loss = mean over examples."""

    def __init__(self, ignore_index=-100, beta=0.1, compiled=True, use_ref_model=False,
                 average_log_prob=False, chunk_size=1):
        super().__init__()
        assert use_ref_model and not average_log_prob
        self.beta = beta

    def forward(self, _input, lin_weight, target, bias=None, preference_labels=None,
                ref_input=None, ref_weight=None, ref_bias=None, kl=None):
        r = (sequence_logps(_input @ lin_weight.T, target)[0]
             - sequence_logps(ref_input @ ref_weight.T, target)[0])
        sign = torch.where(preference_labels, 1.0, -1.0)
        return (1 - torch.sigmoid(self.beta * (r - kl) * sign)).mean()


def test_liger_path_gives_the_standard_loss(monkeypatch):
    from transformers import AutoModelForCausalLM

    from memlab.model.tiny import Tiny

    tok = load_tokenizer()
    cfg = Tiny(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               num_kv_heads=1).hf_config(tok)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    chunked = types.ModuleType("liger_kernel.chunked_loss")
    chunked.LigerFusedLinearKTOLoss = _FakeLigerKTO
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", chunked)
    rows = [{"prompt_ids": [11, 12], "completion_ids": [13, 14, 15], "kl_completion_ids": [16],
             "label": True},
            {"prompt_ids": [17], "completion_ids": [18, 19], "kl_completion_ids": [13, 14, 15],
             "label": False}]
    batch = KTO()._collate(rows, pad_id=0)
    models = {"policy": policy, "reference": ref}
    std, _ = KTO(beta=0.3).loss(models, batch, None)
    lig, _ = KTO(beta=0.3, use_liger_kernel=True).loss(models, batch, None)
    assert lig.item() == pytest.approx(std.item(), rel=1e-5)
