"""Packed preference training (packing=bfd / bfd_split, method.share_prompt) is the padded
training of the same units, on a tiny model, one micro-batch at a time.

For dpo, kto and reward x bfd / bfd_split x share_prompt off / on x reference copy /
adapter_disabled (a LoRA policy) / precomputed x attention eager / sdpa (memlab's per-document
kernels): every micro-batch the packer made is collated packed and, from the same units, padded
(one sequence per row, unshared); the per-sequence log-probs (KTO: also of the KL sequences;
reward: the rewards), the loss, its metrics and the gradients must agree. The policy differs
from the reference (perturbed weights / a non-zero adapter), so the loss is not trivially
log 2. Tolerances (fp32, CPU): the same math through differently shaped kernels, summed in
another order. Log-probs are sums of 100-700 token log-probs: measured up to 2e-4 apart (3e-7
relative; the padding-free layout memlab already had differs from padded by the same), asserted
1e-5 relative + 1e-4 absolute; the loss and metrics take differences of such sums times beta:
1e-5 relative + 1e-4 absolute; gradients 1e-4 of their norm. A negative control shows the comparison would catch a document
seeing another's tokens. flex_attention and flash_attention_2 run on a GPU only (marked gpu).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import types

import datasets
import pytest
import torch

from memlab import pipeline
from memlab.context import validate
from memlab.method import _layout
from memlab.method import _layout as _logps
from memlab.method.base import Segments
from memlab.packing.groups import PACK_ROWS
from memlab.run import seed_everything
from memlab_testing import FAST, compose

LOGPS = {"rtol": 1e-5, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _no_full_collections(monkeypatch):
    """The reference's precompute ends with ``gc.collect()`` (it frees the reference copy for
    the training after it); here the copy lives on (the padded side reuses it) and a full
    collection of this process's heap costs ~1 s a call, three calls a precomputed case."""
    from memlab.method import _reference

    monkeypatch.setattr(_reference, "gc", types.SimpleNamespace(collect=lambda *a: 0))


@functools.cache
def _config(method: str, lora: bool, attention: str, device: str) -> dict:
    """The composed configuration (a plain dict; Hydra's compose takes ~0.5 s), once per
    method, policy and attention node: :func:`_ctx` sets the options below on a copy."""
    from omegaconf import OmegaConf, open_dict

    over = [f"method={method}", "packing=bfd", f"attention={attention}",
            "method.max_length=128", "train.batch_size=3", "data.n_examples=10",
            "data.median_tokens=60", "data.max_tokens=300", f"train.device={device}"]
    if method != "reward":
        over += ["method.max_prompt_length=48"] + (["peft=lora"] if lora else [])
    else:
        over += ["method.truncation_mode=keep_end"]
    if device == "cuda":
        over += ["precision=bf16"] if attention.startswith("flash") else []
    cfg = compose([o for o in FAST if not o.startswith(("method.", "train.device"))] + over)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True)


NAME_ONLY = ("eager", "sdpa")
"""Attention options whose nodes differ in their name only (so do packing=bfd and bfd_split):
set on a copy of one composed dict."""


@functools.cache
def _ctx(method: str, packing: str, share: bool, attention: str = "sdpa",
         reference: str = "copy", device: str = "cpu"):
    data = copy.deepcopy(_config(method, reference == "adapter_disabled",
                                 "sdpa" if attention in NAME_ONLY else attention, device))
    assert packing in ("bfd", "bfd_split")
    data["packing"]["name"] = packing
    data["attention"]["name"] = attention
    data["method"]["share_prompt"] = share
    if method != "reward":
        data["method"]["reference"] = reference
    ctx = validate(data)
    seed_everything(ctx.train.seed)
    return ctx


@functools.cache
def _data(method: str, packing: str, share: bool):
    ctx = _ctx(method, packing, share)
    tok = ctx.model.load_tokenizer(ctx)
    ds, stats = pipeline.prepare_data(ctx, tok)
    return tok, ds, stats


def _models(ctx, tok, reference: str):
    """A policy that differs from its reference: perturbed weights, or a non-zero adapter."""
    loader = pipeline.Loader(ctx, tok, pipeline.Seams())
    policy = loader.model(ctx)
    models = {"policy": policy}
    if ctx.method.name != "reward" and reference != "adapter_disabled":
        models["reference"] = loader()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad and (reference != "adapter_disabled" or "lora_B" in name):
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return models


def _padded_rows(method, units: list[dict]) -> list[dict]:
    """The units as unpacked, unshared rows (a KTO pair: its two examples)."""
    rows = [{k: v for k, v in u.items() if k != PACK_ROWS} for u in units]
    if method.name != "kto" or not method.share_prompt:
        return rows
    out = []
    for r in rows:
        for i in range(2):
            out.append({k: (v[i] if isinstance(v, list) and k != "prompt_ids" else v)
                        for k, v in r.items()})
    return out


def _sequence_values(method, model, batch, ctx) -> list[torch.Tensor]:
    t = batch.tensors
    with torch.no_grad():
        if method.name == "reward":
            return [method.rewards(model, t, ctx.attention)]
        n = batch.num_items * (2 if method.name == "dpo" else 1)
        out = [_logps.completion_logps(model, t, n, attention=ctx.attention)[0]]
        if method.name == "kto":
            out.append(_logps.completion_logps(model, t, n, "kl_", attention=ctx.attention)[0])
        return out


def _loss_and_grad(method, models, batch, ctx):
    policy = models["policy"]
    policy.zero_grad(set_to_none=True)
    loss, metrics = method.loss(models, batch, ctx)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])
    return loss.item(), metrics, grad


def _compare(method_name, packing, share, reference, attention, device="cpu", packs=2):
    tok, ds, stats = _data(method_name, packing, share)
    ctx = _ctx(method_name, packing, share, attention, reference, device)
    method = ctx.method
    assert PACK_ROWS in ds.column_names and stats.rows >= len(ds)
    models = _models(ctx, tok, reference)
    padded_m = dataclasses.replace(method, share_prompt=False, padding_free=False)
    items = [ds[i] for i in range(min(packs, len(ds)))]
    if reference == "precomputed":  # the reference's log-probs stored once, packed and padded
        stored = method.before_training(dict(models), datasets.Dataset.from_list(items), ctx)
        items = [stored[i] for i in range(len(stored))]
    n_split = 0
    for item in items:
        units, rows_of = _layout.units_of([item])
        n_split += sum(len(r) > 1 for r in rows_of)
        packed = method.collate([item], tok, ctx).to(device)
        rows = _padded_rows(method, units)
        if reference == "precomputed":
            plain = [{k: v for k, v in r.items() if not k.startswith("ref_")} for r in rows]
            stored = padded_m.before_training(dict(models), datasets.Dataset.from_list(plain),
                                              ctx)
            rows = [stored[i] for i in range(len(stored))]
        padded = padded_m.collate(rows, tok, ctx).to(device)
        assert packed.num_items == padded.num_items
        assert packed.tensors["input_ids"].shape[0] <= ctx.train.batch_size  # rows per batch
        for a, b in zip(_sequence_values(method, models["policy"], packed, ctx),
                        _sequence_values(padded_m, models["policy"], padded, ctx), strict=True):
            torch.testing.assert_close(a.float(), b.float(), **LOGPS)
        if reference == "precomputed":
            torch.testing.assert_close(packed.tensors["ref_logps"], padded.tensors["ref_logps"],
                                       **LOGPS)
        lp, mp, gp = _loss_and_grad(method, no_ref(models, reference), packed, ctx)
        lq, mq, gq = _loss_and_grad(padded_m, no_ref(models, reference), padded, ctx)
        assert lp == pytest.approx(lq, rel=1e-5, abs=1e-4)
        for key in mq:
            assert mp[key] == pytest.approx(mq[key], rel=1e-5, abs=1e-4), key
        assert (gp - gq).norm() <= 1e-4 * gq.norm()
    return n_split


def no_ref(models: dict, reference: str) -> dict:
    """precomputed: training runs without a reference model (the batch carries its values)."""
    return {"policy": models["policy"]} if reference == "precomputed" else models


def _cases(methods, references):
    """Every method x packing x share_prompt x reference x attention, less the one
    test_bfd_split_splits_some_units_here compares on every micro-batch (bfd_split, its
    method's share_prompt, the reference copy, sdpa)."""
    share_ids = {False: "unshared", True: "share_prompt"}
    return [pytest.param(m, p, sh, r, a, id="-".join(
                ([m] if len(methods) > 1 else []) + [p, share_ids[sh]]
                + ([r] if len(references) > 1 else []) + [a]))
            for m, p, sh, r, a in itertools.product(methods, ["bfd", "bfd_split"],
                                                    [False, True], references,
                                                    ["eager", "sdpa"])
            if (p, sh, r, a) != ("bfd_split", m != "reward", "copy", "sdpa")]


@pytest.mark.parametrize("method, packing, share, reference, attention",
                         _cases(["dpo", "kto"], ["copy", "adapter_disabled", "precomputed"]))
def test_packed_equals_padded(method, packing, share, reference, attention):
    _compare(method, packing, share, reference, attention)


@pytest.mark.parametrize("method, packing, share, reference, attention",
                         _cases(["reward"], ["copy"]))
def test_packed_reward_equals_padded(method, packing, share, reference, attention):
    _compare(method, packing, share, reference, attention)


@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_bfd_split_splits_some_units_here(method):
    """The cases above cover split units: at this row capacity some pairs do not fit a row.
    Every micro-batch of bfd_split with the reference copy under sdpa (share_prompt for DPO
    and KTO) is compared here, so the cases above leave that one out."""
    share = method != "reward"
    _, ds, stats = _data(method, "bfd_split", share)
    assert stats.extra["units_split"] > 0
    assert _compare(method, "bfd_split", share, "copy", "sdpa", packs=len(ds)) == \
        stats.extra["units_split"]


def test_a_document_that_sees_another_would_be_caught():
    """Negative control: the rejected tokens of a shared-prompt row made to see the chosen
    tokens too (prefix range widened) change their log-probs beyond the tolerance."""
    tok, ds, _ = _data("dpo", "bfd", True)
    ctx = _ctx("dpo", "bfd", True)
    models = _models(ctx, tok, "copy")
    batch = ctx.method.collate([ds[0]], tok, ctx)
    t = batch.tensors
    n = 2 * batch.num_items
    good = _logps.completion_logps(models["policy"], t, n, attention=ctx.attention)[0]
    leaky = []
    for r, row in enumerate(t["segments"]):  # each rejected document also sees the chosen one
        docs = t["segments"].documents(r)
        leaky.append(tuple(e if isinstance(e, int) else (e[0], e[1], docs[j][0])
                           for j, e in enumerate(row)))
    assert Segments(leaky) != t["segments"]
    bad = _logps.completion_logps(models["policy"], dict(t, segments=Segments(leaky)), n,
                                  attention=ctx.attention)[0]
    rejected = slice(batch.num_items, n)
    torch.testing.assert_close(bad[: batch.num_items], good[: batch.num_items], **LOGPS)
    assert (bad[rejected] - good[rejected]).abs().max() > 100 * LOGPS["atol"]


def test_flex_block_mask_is_the_segments_structure():
    """flex_attention's block mask (built for shared prompts) allows exactly what memlab's
    per-document attention does: own document causally, plus the prefix range."""
    from torch.nn.attention.flex_attention import create_mask

    from memlab.attention._varlen import block_mask

    seg = Segments([(5, (4, 0, 3), 2, (2, 9, 10), 3)])
    bm = block_mask(seg, 16, "cpu")
    dense = create_mask(bm.mask_mod, 1, 1, 16, 16, device="cpu")[0, 0]
    want = torch.zeros(16, 16, dtype=torch.bool)
    for s, e, prefix in seg.documents(0):
        want[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        if prefix is not None:
            want[s:e, prefix[0]:prefix[1]] = True
    assert torch.equal(dense, want)


GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="needs a CUDA device: flex_attention has no backward on CPU in "
                                "torch 2.13, flash_attention_2 runs on CUDA only")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("share", [False, True], ids=["unshared", "share_prompt"])
@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_packed_equals_padded_with_flex_attention(method, share):
    _compare(method, "bfd_split", share, "copy", "flex_attention", device="cuda")


@pytest.mark.gpu
@GPU
@pytest.mark.skipif(not torch.cuda.is_available() or
                    __import__("importlib").util.find_spec("flash_attn") is None,
                    reason="needs flash_attn")
@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_packed_equals_padded_with_flash_attention_2(method):
    """flash isolates packed documents by their restarting position ids (bf16: looser)."""
    global LOGPS
    saved, LOGPS = LOGPS, {"rtol": 2e-2, "atol": 2e-1}
    try:
        _compare(method, "bfd_split", False, "copy", "flash_attention_2", device="cuda")
    finally:
        LOGPS = saved
