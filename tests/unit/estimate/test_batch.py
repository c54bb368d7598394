"""The batches an estimate measures (memlab.estimate.batch), without a training step: which
candidates each configuration gets, that the padded one really takes the padding-mask path
through the method's own collate with the full one's shapes, and which run batches
``--from-data`` can skip."""

from __future__ import annotations

import pytest
import torch

from memlab.data.assets import load_tokenizer
from memlab.estimate import validate_for
from memlab.estimate.batch import (
    candidates,
    distinct,
    dominated,
    padded,
    run_micro_batches,
    signature,
)
from memlab.method.base import layout_shapes
from memlab.trainer.batch import Batch, Segments
from memlab_testing import compose

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("no_cpu_bf16")]

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
        "train.batch_size=3"]
LEN = ["method.max_length=64"]


def _ctx(*overrides: str):
    from omegaconf import OmegaConf, open_dict

    cfg = compose([*TINY, *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    return validate_for(OmegaConf.create(OmegaConf.to_container(cfg)), "cpu")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _collated(ctx, tok, cand) -> dict:
    return ctx.method.collate(cand.rows, tok, ctx).tensors


def test_padded_sft_rows_have_the_full_shapes_and_a_padding_mask(tok):
    ctx = _ctx(*LEN, "method.padding_mask=always")
    full, pad = candidates(ctx, tok, 64)
    assert (full.name, pad.name) == ("full", "padded")
    tf, tp = _collated(ctx, tok, full), _collated(ctx, tok, pad)
    assert layout_shapes(tf) == layout_shapes(tp)
    assert tf["loss_index"].numel() == tp["loss_index"].numel() + 1  # one label fewer
    assert tp["input_ids"].shape == (3, 64)
    assert not padded(tf) and padded(tp)
    # the least padding a padded batch can have: one token in one row (most real tokens)
    assert int((tp["attention_mask"] == 0).sum()) == 1


def test_sft_rows_padded_without_a_mask_need_no_more_than_full_rows(tok):
    """method.padding_mask=auto under sdpa: the padded candidate goes without a mask (causal
    kernel) and one label fewer: the full one dominates it, so the
    estimate measures the full one only; flash-style backends keep the mask."""
    ctx = _ctx(*LEN)
    full, pad = candidates(ctx, tok, 64)
    tf, tp = _collated(ctx, tok, full), _collated(ctx, tok, pad)
    assert "attention_mask" not in tp and not padded(tp)
    assert set(tp) == {"input_ids", "labels", "loss_index"}
    assert dominated(signature(_batch(**tp)), signature(_batch(**tf)))
    assert distinct([full, pad], key=lambda c: ctx.method.collate(c.rows, tok, ctx)) == [full]
    import dataclasses

    from memlab.attention.flash_attention_2 import FlashAttention2

    flash = dataclasses.replace(ctx, attention=FlashAttention2())
    assert not flash.method.causal_padding(flash)
    assert "attention_mask" in _collated(flash, tok, pad)
    assert not ctx.attention.skips_padding and ctx.method.causal_padding(ctx)


def test_one_row_cannot_be_padded_and_flat_rows_have_no_mask(tok):
    assert [c.name for c in candidates(_ctx(*LEN, "train.batch_size=1"), tok, 64)] == ["full"]
    ctx = _ctx(*LEN, "method.padding_free=true")
    (full,) = candidates(ctx, tok, 64)
    t = _collated(ctx, tok, full)
    assert t["input_ids"].shape == (1, 3 * 64) and "attention_mask" not in t


def test_packed_rows_measure_one_and_two_documents_unless_told(tok):
    ctx = _ctx(*LEN, "packing=bfd", "method.padding_free=false")
    one, two = candidates(ctx, tok, 64)
    assert (one.name, two.name) == ("1 document per row", "2 documents per row")
    segs = [_collated(ctx, tok, c)["segments"] for c in (one, two)]
    assert list(segs[0]) == [(64,)] * 3 and list(segs[1]) == [(32, 32)] * 3
    flat = _ctx(*LEN, "packing=bfd")  # padding-free (packing's default): one flat row
    assert list(_collated(flat, tok, candidates(flat, tok, 64)[1])["segments"]) == [(32,) * 6]
    assert [c.name for c in candidates(ctx, tok, 64, docs_per_row=4)] == ["4 documents per row"]


@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_preference_methods_get_a_padded_candidate_of_the_longest_rows(tok, method):
    """With the padding mask (reward always; DPO / KTO with method.padding_mask=always); DPO /
    KTO's default sends right-padded rows without it under sdpa: no padded candidate."""
    extra = [] if method == "reward" else ["method.max_prompt_length=32",
                                           "method.padding_mask=always"]
    ctx = _ctx(f"method={method}", "train.batch_size=2", *LEN, *extra)
    cands = {c.name: c for c in candidates(ctx, tok, 64)}
    assert {"longest", "padded"} <= set(cands)
    tl, tp = _collated(ctx, tok, cands["longest"]), _collated(ctx, tok, cands["padded"])
    assert padded(tp) and tp["input_ids"].shape == tl["input_ids"].shape
    if method != "reward":
        auto = _ctx(f"method={method}", "train.batch_size=2", *LEN, *extra[:1])
        assert "padded" not in {c.name for c in candidates(auto, tok, 64)}


def test_online_prompts_are_padded_on_the_left(tok):
    ctx = _ctx("method=grpo", "method.max_prompt_length=32", "train.batch_size=2")
    cands = {c.name: c for c in candidates(ctx, tok, 32)}
    t = _collated(ctx, tok, cands["padded"])
    assert t["prompt_ids"].shape == (2, 32) and t["prompt_mask"][1, 0] == 0


def _batch(**tensors) -> Batch:
    return Batch(dict(tensors), num_items=1, real_tokens=1, total_tokens=1)


def test_dominated_batches_are_the_ones_from_data_can_skip():
    def ones(*shape):
        return torch.ones(shape, dtype=torch.long)

    wide = _batch(input_ids=ones(2, 8), attention_mask=ones(2, 8))
    narrow = _batch(input_ids=ones(2, 6), attention_mask=ones(2, 6))
    pad = ones(2, 6)
    pad[1, -1] = 0
    narrow_padded = _batch(input_ids=ones(2, 6), attention_mask=pad)
    s = {n: signature(b) for n, b in (("wide", wide), ("narrow", narrow),
                                      ("narrow_padded", narrow_padded))}
    assert dominated(s["narrow"], s["wide"]) and not dominated(s["wide"], s["narrow"])
    # another mask decision is another path: never skipped for a wider unpadded batch
    assert not dominated(s["narrow_padded"], s["wide"])
    items = [narrow, wide, narrow_padded, wide]
    assert distinct(items, key=lambda b: b) == [wide, narrow_padded]
    # packed rows: other documents are another memory, kept
    a = _batch(input_ids=ones(1, 8))
    a.tensors["segments"] = Segments([(4, 4)])
    b = _batch(input_ids=ones(1, 8))
    b.tensors["segments"] = Segments([(8,)])
    assert distinct([a, b], key=lambda x: x) == [a, b]


def test_run_micro_batches_counts_what_the_run_draws():
    from memlab.trainer.epochs import StepPlan

    five = StepPlan(steps=5)
    assert run_micro_batches(_ctx(*LEN, "train.steps=5", "train.grad_accum=3"), five) == 15
    ctx = _ctx("method=grpo", "train.steps=5", "method.num_iterations=2",
               "train.save_every=0")
    assert run_micro_batches(ctx, five) == 3  # a prompt batch every second step
    # train.epochs: every pass's micro-batches, whatever the steps
    assert run_micro_batches(ctx, StepPlan(steps=4, epochs=2, steps_per_epoch=2,
                                           micro_batches=6)) == 6


def test_packed_preference_pairs_measure_the_fullest_pack(tok):
    ctx = _ctx("method=dpo", "packing=bfd", "train.batch_size=2", *LEN,
               "method.max_prompt_length=32")
    (pack,) = candidates(ctx, tok, 64)
    assert pack.name == "fullest pack" and len(pack.rows) == 1  # one item: one micro-batch
    t = _collated(ctx, tok, pack)
    ids = t["input_ids"]
    # the most token slots a micro-batch can have: batch_size rows of max_length (long pairs)
    assert ids.numel() == 2 * 64
