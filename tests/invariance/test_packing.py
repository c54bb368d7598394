"""Packing and padding-free batching change the memory, never the loss.

Model level: documents packed in one row with restarting position_ids (no attention mask,
use_cache=False) give each token exactly the logits it has when its document runs alone, on
eager and sdpa; a negative control (an all-ones mask) shows the test would catch documents
attending across boundaries. Method level: SFT's padded, padding-free and packed (bfd,
bfd_split, wrapped) batches of the same examples give the same summed loss over the same
loss tokens. Tolerances: fp32 CPU, 1e-5 absolute on logits, 1e-5 relative on loss sums.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from memlab.method.base import IGNORE, Segments, model_inputs

BACKENDS = ["eager", "sdpa", "memlab_eager_varlen", "memlab_sdpa_varlen"]


@pytest.fixture(autouse=True, scope="module")
def _varlen_registered():
    from memlab.attention._varlen import register

    register()


def _model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn).eval()


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (n,), generator=g) for n in lengths]


def _packed_logits(model, docs, mask=None, segments=True):
    """Logits of ``docs`` packed in one row, with the row's document segments as memlab's
    collators pass them (transformers' own backends ignore them)."""
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    extra = {"memlab_segments": Segments.from_positions(pos.tolist())} if segments else {}
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, attention_mask=mask,
                     use_cache=False, **extra).logits[0]


@pytest.mark.parametrize("attn", BACKENDS)
def test_packed_row_logits_equal_documents_alone(attn):
    model = _model(attn)
    docs = _docs([7, 1, 12, 5])
    packed = _packed_logits(model, docs)
    start = 0
    for d in docs:
        with torch.no_grad():
            alone = model(input_ids=d[None], use_cache=False).logits[0]
        torch.testing.assert_close(packed[start : start + len(d)], alone, atol=1e-5, rtol=0)
        start += len(d)


@pytest.mark.parametrize("attn", ["memlab_eager_varlen", "memlab_sdpa_varlen"])
@pytest.mark.parametrize("cuts", [
    [[7, 1, 12, 5]] * 3, [[25]] * 2, [[6, 6, 6, 7]] * 2,
    [[7, 1, 12, 5], [12, 13], [7, 1, 12, 5]], [[8, 8, 9], [4, 4, 8, 9], [25]]])
def test_rows_attend_as_each_row_alone(attn, cuts):
    """Under sdpa, rows cut alike run together and adjacent documents of one length run as one
    batched kernel; otherwise one row and document at a time: either way every row's logits
    are those of the row alone."""
    model = _model(attn)
    rows = [_docs(c, seed=i) for i, c in enumerate(cuts)]
    ids = torch.stack([torch.cat(r) for r in rows])
    pos = torch.stack([torch.cat([torch.arange(len(d)) for d in r]) for r in rows])
    with torch.no_grad():
        batch = model(input_ids=ids, position_ids=pos, use_cache=False,
                      memlab_segments=Segments.from_positions(pos.tolist())).logits
    for i, r in enumerate(rows):
        torch.testing.assert_close(batch[i], _packed_logits(model, r), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", BACKENDS)
def test_contamination_is_detected(attn):
    """Changing document A must not change any logit of document B in the same row; with an
    all-ones attention mask (the known trap) it does, proving the check is sensitive."""
    model = _model(attn)
    a, b = _docs([9, 8])
    a2 = a.clone()
    a2[:] = (a2 + 17) % 300
    clean = _packed_logits(model, [a, b])[len(a):]
    changed = _packed_logits(model, [a2, b])[len(a):]
    torch.testing.assert_close(changed, clean, atol=1e-6, rtol=0)
    if attn in ("eager", "sdpa"):  # transformers' own paths: the known trap must show
        ones = torch.ones(1, len(a) + len(b), dtype=torch.long)
        mixed = _packed_logits(model, [a, b], ones)[len(a):]
        mixed2 = _packed_logits(model, [a2, b], ones)[len(a):]
        assert (mixed - mixed2).abs().max() > 1e-3
    else:  # memlab's per-document attention isolates what the collator's segments name
        mixed = _packed_logits(model, [a, b], segments=False)[len(a):]
        mixed2 = _packed_logits(model, [a2, b], segments=False)[len(a):]
        assert (mixed - mixed2).abs().max() > 1e-3


@functools.cache  # the padded context serves every packing of its attention
def _ctx(packing: str, padding_free=None, max_length=96, attn="sdpa"):
    from omegaconf import OmegaConf, open_dict

    from memlab.context import validate
    from memlab_testing import FAST, compose

    cfg = compose([o for o in FAST if not o.startswith("method.max_length")] + [
        f"packing={packing}", f"method.max_length={max_length}", f"attention={attn}",
        f"method.padding_free={'null' if padding_free is None else str(padding_free).lower()}"])
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.to_container(cfg, resolve=True))


def _loss_sum(model, batch):
    t = batch.tensors
    with torch.no_grad():
        logits = model(**model_inputs(t), use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           t["labels"].reshape(-1), ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("packing", ["bfd", "bfd_split", "wrapped"])
def test_sft_loss_padded_vs_padding_free_vs_packed(attn, packing):
    """Same examples, three layouts, same total loss over the same loss tokens.

    bfd truncates like the padded run (same max_length); bfd_split and wrapped keep overflow
    tokens, so they are compared with a padded run without truncation of equal-length chunks:
    here every example fits in max_length, so all layouts see identical documents."""
    from memlab.data.assets import load_tokenizer
    from memlab.data.embedded import Embedded

    tok = load_tokenizer()
    base = _ctx("none", attn=attn, max_length=4096)
    raw = Embedded(n_examples=12, median_tokens=60, max_tokens=200).load(base)
    model = _model(base.attention.implementation())
    model.resize_token_embeddings(len(tok))
    torch.manual_seed(0)

    padded_ctx = base
    ds, _ = padded_ctx.method.prepare(raw, tok, padded_ctx)
    rows = [ds[i] for i in range(len(ds))]
    cap = max(len(r["input_ids"]) for r in rows)
    padded = padded_ctx.method.collate(rows, tok, padded_ctx)
    flat_ctx = dataclasses.replace(base, method=dataclasses.replace(base.method,
                                                                    padding_free=True))
    flat = flat_ctx.method.collate(rows, tok, flat_ctx)
    assert flat.tensors["input_ids"].shape[0] == 1 and "attention_mask" not in flat.tensors

    pctx = _ctx(packing, attn=attn, max_length=cap)
    pds, stats = pctx.method.prepare(raw, tok, pctx)
    pds, stats = pctx.packing.apply(pds, stats, pctx)
    assert stats.tokens_dropped == 0 and stats.rows < len(rows)
    prow = [pds[i] for i in range(len(pds))]
    packed = pctx.method.collate(prow, tok, pctx)

    n = padded.num_items
    assert flat.num_items == n
    ref = _loss_sum(model, padded)
    torch.testing.assert_close(_loss_sum(model, flat), ref, rtol=1e-5, atol=1e-4)
    if packing == "wrapped":
        # documents cross rows: a token at the head of a row loses its earlier context, so
        # only the item count is invariant here (documented in conf/packing/wrapped.yaml)
        assert packed.num_items == n
    else:
        assert packed.num_items == n
        torch.testing.assert_close(_loss_sum(model, packed), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.integration
def test_padding_free_lowers_measured_activation_peak(job):
    """Padded rows with their mask (``method.padding_mask=always``, TRL's way), padded rows
    without it (``auto``: sdpa's causal kernel) and padding-free rows train the same curve;
    the mask costs memory at the padded steps, and padding-free rows need less than padded
    ones there (fewer tokens)."""
    # the standard loss: its logits set the forward peak at a step of full rows (below); with
    # the chunked one (the default) the peak moves to a padded step, where the mask counts
    common = ["train.batch_size=4", "method.max_length=512", "measure.memory_steps=all",
              "data.n_examples=64", "train.steps=4", "method.loss_impl=standard"]
    masked = job(common + ["method.padding_free=false", "method.padding_mask=always"])
    padded = job(common + ["method.padding_free=false"])
    flat = job(common + ["method.padding_free=true"])
    assert flat["status"] == padded["status"] == masked["status"] == "ok", flat["error"]
    assert flat["data"]["padding_fraction"] == 0.0 < padded["data"]["padding_fraction"]
    act = {k: r["memory"]["by_phase_category"]["forward"]["activations"]
           for k, r in (("masked", masked), ("padded", padded), ("flat", flat))}
    # the forward peak is at a step whose rows are all full (no mask either way); padding-free
    # rows pay rotary tables per token there ([1, N] positions, not [1, T]): a few hundred KiB
    assert act["padded"] == act["masked"] <= act["flat"] <= 1.01 * act["padded"], act
    steps = {k: r["memory"]["tracked_step_peaks"]
             for k, r in (("masked", masked), ("padded", padded), ("flat", flat))}
    assert all(p <= m for p, m in zip(steps["padded"], steps["masked"], strict=True)), steps
    assert any(p < m for p, m in zip(steps["padded"], steps["masked"], strict=True)), steps
    assert any(f < p for f, p in zip(steps["flat"], steps["padded"], strict=True)), steps
    assert padded["train"]["loss_curve"] == pytest.approx(masked["train"]["loss_curve"],
                                                          rel=1e-6)
    assert flat["train"]["loss_curve"] == pytest.approx(padded["train"]["loss_curve"], rel=1e-4)


@pytest.mark.integration
@pytest.mark.parametrize("packing", ["bfd", "bfd_split", "wrapped"])
def test_packed_runs_record_fill_and_rows(job, packing):
    s = job([f"packing={packing}", "method.max_length=256", "data.n_examples=64"])
    assert s["status"] == "ok", s["error"]
    d = s["data"]
    assert 0.5 < d["fill_ratio"] <= 1.0
    if packing == "bfd":  # bfd_split / wrapped cut long conversations, so rows may outnumber them
        assert d["rows"] < d["examples"]
    if packing == "bfd":
        assert d["tokens_dropped"] > 0
    else:
        assert d["tokens_dropped"] == 0
