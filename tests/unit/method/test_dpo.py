"""method=dpo pieces: truncation rules and counts, row formats, collate shapes, the loss wiring
against closed forms on hand-made log-probs, validation messages, the Liger wiring (with a
stand-in module, since Liger needs CUDA)."""

from __future__ import annotations

import math
import sys
import types

import datasets
import pytest
import torch

from memlab.context import validate
from memlab.data.assets import load_tokenizer
from memlab.data.base import DataError
from memlab.losses import sequence_logps
from memlab.method import _layout, _reference, _rows
from memlab.method.base import IGNORE, Batch
from memlab.method.dpo import DPO
from memlab.registry import ConfigErrors
from memlab_testing import FAST, compose


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _validate(overrides: list[str]):
    from omegaconf import OmegaConf, open_dict

    cfg = compose(FAST + overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.to_container(cfg, resolve=True))


def _errors(overrides: list[str]) -> str:
    with pytest.raises(ConfigErrors) as e:
        _validate(overrides)
    return str(e.value)


# ------------------------------------------------------------------------------ truncation


def test_truncate_prompt_from_left_completion_from_right_with_counts():
    prompt, c, r = list(range(10)), list(range(100, 108)), list(range(200, 204))
    p2, (c2, r2), dropped = _rows.truncate(prompt, [c, r], 6, 5, None)
    assert p2 == [4, 5, 6, 7, 8, 9]  # the prompt's end is kept
    assert c2 == [100, 101, 102, 103, 104] and r2 == r  # completions keep their start
    assert dropped == 2 * 4 + 3  # 4 prompt tokens in each of the 2 sequences, 3 of chosen


def test_truncate_max_length_cuts_the_completion_not_the_prompt():
    p2, (c2, r2), dropped = _rows.truncate(list(range(6)), [list(range(10)), [7, 8]], None, None, 9)
    assert len(p2) == 6 and c2 == [0, 1, 2] and r2 == [7, 8]
    assert dropped == 7
    # prompt_length first, then max_length on what is left
    p3, (c3,), d3 = _rows.truncate(list(range(20)), [list(range(10))], 8, None, 12)
    assert p3 == list(range(12, 20)) and c3 == [0, 1, 2, 3] and d3 == 12 + 6


def test_truncate_drops_when_the_prompt_fills_max_length():
    assert _rows.truncate(list(range(8)), [[1, 2]], None, None, 8) is None
    assert _rows.truncate(list(range(8)), [[1, 2]], None, None, 9) is not None
    # max_prompt_length can rescue it
    assert _rows.truncate(list(range(8)), [[1, 2]], 4, None, 8) is not None


def _string_rows(n_prompt_words: list[int]) -> datasets.Dataset:
    rows = [{"prompt": " ".join(["the music"] * n), "chosen": "a careful answer about music",
             "rejected": "whatever"} for n in n_prompt_words]
    return datasets.Dataset.from_list(rows)


def test_prepare_counts_dropped_examples_and_tokens(tok):
    ds = _string_rows([2, 3, 200, 4])
    full = DPO(max_length=None, max_prompt_length=None).prepare(ds, tok, None)[0]
    lens = [len(p) for p in full["prompt_ids"]]
    assert lens[2] > 100 > max(lens[0], lens[1], lens[3])
    method = DPO(max_length=64, max_prompt_length=None)
    out, stats = method.prepare(ds, tok, None)
    assert stats.examples == 3 and stats.examples_dropped == 1 and len(out) == 3
    n_full = sum(2 * len(p) + len(c) + len(r) for p, c, r in
                 zip(full["prompt_ids"], full["chosen_ids"], full["rejected_ids"]))
    n_kept = sum(2 * len(p) + len(c) + len(r) for p, c, r in
                 zip(out["prompt_ids"], out["chosen_ids"], out["rejected_ids"]))
    assert stats.tokens_in == n_full
    assert stats.tokens_dropped == n_full - n_kept
    assert stats.tokens_dropped == 2 * lens[2] + len(full["chosen_ids"][2]) + len(
        full["rejected_ids"][2])
    # with a prompt limit the long one survives, keeping the end of its prompt
    out, stats = DPO(max_length=64, max_prompt_length=16).prepare(ds, tok, None)
    assert stats.examples_dropped == 0 and len(out) == 4
    assert out["prompt_ids"][2] == full["prompt_ids"][2][-16:]
    assert stats.tokens_dropped == 2 * (lens[2] - 16)


def test_plain_string_rows_end_with_eos(tok):
    out, _ = DPO().prepare(_string_rows([2]), tok, None)
    assert out["prompt_ids"][0] == tok("the music the music", add_special_tokens=False)[
        "input_ids"]
    assert out["chosen_ids"][0][-1] == tok.eos_token_id
    assert out["rejected_ids"][0][-1] == tok.eos_token_id


def _chat_row():
    return {"prompt": [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "name a tempo"}],
            "chosen": [{"role": "assistant", "content": "the tempo is steady"}],
            "rejected": [{"role": "assistant", "content": "whatever"}]}


def test_conversational_prompt_has_generation_prompt_and_completion_is_the_suffix(tok):
    row = _chat_row()
    out, _ = DPO().prepare(datasets.Dataset.from_list([row]), tok, None)
    p = tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True,
                                return_dict=True)["input_ids"]
    full = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True,
                                   return_dict=True)["input_ids"]
    assert out["prompt_ids"][0] == list(p)
    assert tok.decode(p).endswith("<|im_start|>assistant\n")
    assert out["prompt_ids"][0] + out["chosen_ids"][0] == list(full)
    assert tok.decode(out["chosen_ids"][0]).startswith("the tempo is steady<|im_end|>")


def test_implicit_prompt_is_the_shared_message_prefix(tok):
    row = _chat_row()
    implicit = {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
    a, _ = DPO().prepare(datasets.Dataset.from_list([row]), tok, None)
    b, _ = DPO().prepare(datasets.Dataset.from_list([implicit]), tok, None)
    assert a.to_list() == b.to_list()


def test_prefix_mismatch_raises_data_error_naming_the_row(tok):
    bad = load_tokenizer()
    # a template whose generation prompt differs from how it renders an assistant turn
    bad.chat_template = (
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant:\\n' -}}{%- endif -%}"
    )
    ds = datasets.Dataset.from_list([_chat_row(), _chat_row()])
    with pytest.raises(DataError, match=r"row 0: the chat template renders 'prompt'"):
        DPO().prepare(ds, bad, None)


def test_mixed_formats_and_missing_columns_are_data_errors(tok):
    mixed = {"prompt": "hi", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "y"}
    with pytest.raises(DataError, match="row 0.*'chosen'"):
        DPO().prepare(datasets.Dataset.from_list([mixed]), tok, None)
    with pytest.raises(DataError, match="needs rows with 'prompt', 'chosen' and 'rejected'"):
        DPO().prepare(datasets.Dataset.from_list([{"text": "hi"}]), tok, None)


# ------------------------------------------------------------------------------ collate

ROWS = [
    {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10, 11, 12, 13]},
    {"prompt_ids": [20], "chosen_ids": [21, 22, 23], "rejected_ids": [24]},
]


def test_collate_padded_chosen_rows_first():
    b = DPO()._collate(ROWS, pad_id=0)
    t = b.tensors
    assert b.num_items == 2 and b.real_tokens == 5 + 7 + 4 + 2 and b.total_tokens == 4 * 7
    assert t["input_ids"].shape == (4, 7) and t["attention_mask"].sum() == b.real_tokens
    assert t["input_ids"][0, :5].tolist() == [5, 6, 7, 8, 9]
    assert t["input_ids"][2].tolist() == [5, 6, 7, 10, 11, 12, 13]
    # labels: next token, on the completion only
    assert t["labels"][0].tolist() == [IGNORE, IGNORE, 8, 9, IGNORE, IGNORE, IGNORE]
    assert (t["labels"] != IGNORE).sum(1).tolist() == [2, 3, 4, 1]
    assert "position_ids" not in t


def test_collate_padding_free_one_row_restarting_positions():
    b = DPO(padding_free=True, pad_to_multiple_of=8)._collate(ROWS, pad_id=0)
    t = b.tensors
    assert t["input_ids"].shape == (1, 24) and b.real_tokens == 18 and b.total_tokens == 24
    assert "attention_mask" not in t
    assert t["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6,
                                             0, 1, 0, 1, 2, 3, 4, 5]
    assert t["segment_ids"][0].tolist() == [0] * 5 + [1] * 4 + [2] * 7 + [3] * 2 + [-1] * 6
    padded = DPO()._collate(ROWS, pad_id=0).tensors
    flat_counts = [(t["labels"][0][t["segment_ids"][0] == i] != IGNORE).sum().item()
                   for i in range(4)]
    assert flat_counts == (padded["labels"] != IGNORE).sum(1).tolist()


# ------------------------------------------------------------------------------ loss wiring

POLICY = [-10.0, -12.0, -15.0, -11.0]  # chosen 0, chosen 1, rejected 0, rejected 1
REF = [-11.0, -12.5, -14.0, -11.5]
COUNTS = [2, 4, 5, 1]


def _batch(tensors=None) -> Batch:
    t = {"ref_logps": torch.tensor(REF)} if tensors is None else tensors
    return Batch(t, num_items=2, real_tokens=1, total_tokens=1)


def _fake_logps(monkeypatch, values=POLICY):
    def fake(model, t, n, prefix="", attention=None):
        assert n == 4
        return torch.tensor(values, requires_grad=True), torch.tensor(COUNTS)

    monkeypatch.setattr(_layout, "completion_logps", fake)


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_sigmoid_loss_is_the_closed_form_sum_with_metrics(monkeypatch, ls):
    _fake_logps(monkeypatch)
    beta = 0.5
    loss, m = DPO(beta=beta, label_smoothing=ls).loss({"policy": None}, _batch(), None)
    logits = [(POLICY[i] - POLICY[i + 2]) - (REF[i] - REF[i + 2]) for i in range(2)]
    want = sum(-(1 - ls) * _logsig(beta * x) - ls * _logsig(-beta * x) for x in logits)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    rc = [beta * (POLICY[i] - REF[i]) for i in range(2)]
    rr = [beta * (POLICY[i + 2] - REF[i + 2]) for i in range(2)]
    assert m["rewards/chosen"] == pytest.approx(sum(rc) / 2)
    assert m["rewards/rejected"] == pytest.approx(sum(rr) / 2)
    assert m["rewards/margins"] == pytest.approx((rc[0] - rr[0] + rc[1] - rr[1]) / 2)
    assert m["rewards/accuracies"] == pytest.approx(sum(c > r for c, r in zip(rc, rr)) / 2)
    assert m["logps/chosen"] == pytest.approx(-11.0) and m["logps/rejected"] == pytest.approx(-13)


def test_ipo_uses_length_averaged_logps_and_hinge(monkeypatch):
    _fake_logps(monkeypatch)
    beta = 0.25
    loss, _ = DPO(beta=beta, loss_type="ipo").loss({"policy": None}, _batch(), None)
    avg = [(p - r) / n for p, r, n in zip(POLICY, REF, COUNTS)]
    want = sum((avg[i] - avg[i + 2] - 1 / (2 * beta)) ** 2 for i in range(2))
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss, _ = DPO(beta=beta, loss_type="hinge").loss({"policy": None}, _batch(), None)
    logits = [(POLICY[i] - POLICY[i + 2]) - (REF[i] - REF[i + 2]) for i in range(2)]
    assert loss.item() == pytest.approx(sum(max(0.0, 1 - beta * x) for x in logits), rel=1e-6)


def test_on_the_fly_reference_runs_without_grad_in_eval_mode(monkeypatch):
    """copy mode: the reference model is called under no_grad and in eval mode."""
    seen = {}

    class Ref(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)

    ref = Ref()
    ref.train()

    def fake(model, t, n, prefix="", attention=None):
        if model is ref:
            seen["grad"], seen["training"] = torch.is_grad_enabled(), model.training
            return torch.tensor(REF), torch.tensor(COUNTS)
        return torch.tensor(POLICY, requires_grad=True), torch.tensor(COUNTS)

    monkeypatch.setattr(_layout, "completion_logps", fake)
    with_ref, _ = DPO().loss({"policy": object(), "reference": ref}, _batch({}), None)
    pre, _ = DPO().loss({"policy": object()}, _batch(), None)
    assert seen == {"grad": False, "training": False}
    assert ref.training  # restored
    assert with_ref.item() == pre.item()


# ------------------------------------------------------------------------------ validation


@pytest.mark.slow
def test_validation_messages_name_the_fix():
    text = _errors(["method=dpo", "method.reference=adapter_disabled", "peft=none"])
    assert "adapter_disabled" in text and "peft=lora" in text
    text = _errors(["method=dpo", "method.use_liger_kernel=true"])
    assert "needs a CUDA device and the gpu extra: pip install 'memlab[gpu]'" in text
    text = _errors(["method=dpo", "packing=wrapped"])
    assert "cuts sequences" in text and "packing=bfd" in text
    text = _errors(["method=dpo", "packing=bfd", "method.max_length=null"])
    assert "set method.max_length" in text
    text = _errors(["method=dpo", "method.share_prompt=true", "attention.varlen=false"])
    assert "method.share_prompt=false" in text and "attention.varlen=true" in text
    text = _errors(["method=dpo", "method.loss_type=ipo", "method.label_smoothing=0.1",
                    "method.beta=0"])
    assert "label_smoothing" in text and "method (dpo).beta: must be > 0" in text
    ctx = _validate(["method=dpo", "peft=lora", "method.reference=adapter_disabled",
                     "method.padding_free=true"])
    assert ctx.method.reference == "adapter_disabled"


def test_padding_free_needs_an_isolating_attention_backend():
    """The rule lives with the attention option (it owns ``isolates_packed``) and tests the
    method's capability (its rows hold several sequences), not an option name."""
    from typing import ClassVar

    from memlab.attention.base import Backend
    from memlab.config import Platform
    from memlab.packing.none import NoPacking
    from memlab.precision.fp32 import Fp32

    class Fancy(Backend):
        isolates_packed: ClassVar[bool] = False
        name: ClassVar[str] = "fancy"

    def ctx(method):
        return types.SimpleNamespace(is_cuda=False, platform=Platform(), precision=Fp32(),
                                     packing=NoPacking(), method=method)

    errors = Fancy().validate(ctx(DPO(padding_free=True)))
    assert len(errors) == 1
    assert "method.padding_free=true" in errors[0]
    assert "attention=fancy cannot keep apart" in errors[0]
    assert Fancy().validate(ctx(DPO(padding_free=False))) == []


def test_liger_missing_names_the_extra(monkeypatch):
    from memlab import _guards

    monkeypatch.setattr(_guards, "has", lambda m: False)
    from memlab.config import Platform

    ctx = types.SimpleNamespace(is_cuda=True, peft=types.SimpleNamespace(), platform=Platform(),
                                packing=types.SimpleNamespace(packs=False))
    errs = DPO(use_liger_kernel=True).liger_errors(ctx)
    assert errs and "pip install 'memlab[gpu]'" in errs[0] and "liger_kernel" in errs[0]


# ------------------------------------------------------------------------------ liger wiring


class _FakeLigerDPO(torch.nn.Module):
    """Stand-in with Liger's interface: hidden [2B, T, H] (chosen first), aligned targets, sum
    log-probs, loss = mean over pairs."""

    def __init__(self, ignore_index=-100, beta=0.1, compute_nll_loss=False, compiled=True,
                 use_ref_model=True, average_log_prob=False, loss_type="sigmoid"):
        super().__init__()
        assert use_ref_model and not compute_nll_loss and not average_log_prob
        self.beta = beta

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None,
                ref_bias=None):
        pol = sequence_logps(_input @ lin_weight.T, target)[0]
        ref = sequence_logps(ref_input @ ref_weight.T, target)[0]
        b = target.shape[0] // 2
        logits = (pol[:b] - pol[b:]) - (ref[:b] - ref[b:])
        return -torch.nn.functional.logsigmoid(self.beta * logits).mean(), (pol[:b], pol[b:])


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
    chunked.LigerFusedLinearDPOLoss = _FakeLigerDPO
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", chunked)
    batch = DPO()._collate(ROWS, pad_id=0)
    models = {"policy": policy, "reference": ref}
    std, _ = DPO(beta=0.3).loss(models, batch, None)
    lig, _ = DPO(beta=0.3, use_liger_kernel=True).loss(models, batch, None)
    assert lig.item() == pytest.approx(std.item(), rel=1e-5)


# ------------------------------------------------------------------------------ reference copy


def test_reference_copy_must_equal_the_initial_policy(tok):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memlab.distributed.single import Single
    from memlab.model.tiny import Tiny

    cfg = Tiny(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               num_kv_heads=1).hf_config(tok)

    def model(seed: int):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg)

    policy = get_peft_model(model(0), LoraConfig(r=4, target_modules="all-linear"))
    n = _reference.check_same_weights(policy, model(0), Single())
    assert n == len(list(model(0).parameters()))  # every reference weight was compared
    with pytest.raises(ValueError, match="differs from the policy"):
        _reference.check_same_weights(policy, model(1), Single())
