"""Token losses: closed forms, naive references, gradients and measured peak memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from memlab.losses import (
    ChunkedCrossEntropy,
    chunked_linear_cross_entropy,
    forked_token_logps,
    segment_logps,
    sequence_logps,
    token_logps,
)

IGNORE = -100


def _math_logp(row: list[float], label: int) -> float:
    """log softmax(row)[label] with python math."""
    m = max(row)
    return row[label] - (m + math.log(sum(math.exp(x - m) for x in row)))


# ---------------------------------------------------------------------------------------------
# token / sequence / segment log-probs
# ---------------------------------------------------------------------------------------------

LOGITS = [
    [[1.0, 2.0, 3.0, 0.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 4.0, 2.0, 1.0]],
    [[10.0, -10.0, 0.0, 1.0], [2.0, 2.0, -3.0, 0.0], [0.0, 1.0, 0.0, 1.0]],
]
LABELS = [[2, 1, IGNORE], [0, IGNORE, 3]]


def test_sequence_logps_closed_form() -> None:
    sums, counts = sequence_logps(torch.tensor(LOGITS, dtype=torch.float64), torch.tensor(LABELS))
    expected = [
        sum(_math_logp(r, y) for r, y in zip(rows, labs) if y != IGNORE)
        for rows, labs in zip(LOGITS, LABELS)
    ]
    assert sums.tolist() == pytest.approx(expected, rel=1e-12)
    assert counts.tolist() == [2, 2]
    # 0.5 everywhere: log(1/4) exactly
    assert _math_logp(LOGITS[0][1], 1) == pytest.approx(-math.log(4))


def _naive_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = []
    for b in range(logits.shape[0]):
        total = logits.new_zeros(())
        for t in range(logits.shape[1]):
            if labels[b, t] != IGNORE:
                total = total + torch.log_softmax(logits[b, t].double(), -1)[labels[b, t]]
        out.append(total)
    return torch.stack(out)


@pytest.mark.parametrize("chunk_tokens", [None, 1, 3])
def test_sequence_logps_matches_naive_loop_on_strided_view(chunk_tokens: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 8, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :4] = IGNORE
    labels[2, -1] = IGNORE
    logits = full[:, :-1]  # strided view, as after shifting
    assert not logits.is_contiguous()
    sums, counts = sequence_logps(logits, labels, chunk_tokens=chunk_tokens)
    ref = _naive_sequence_logps(logits, labels)
    torch.testing.assert_close(sums, ref, rtol=1e-12, atol=1e-12)
    assert counts.tolist() == (labels != IGNORE).sum(-1).tolist()
    w = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    (g_ours,) = torch.autograd.grad((sums * w).sum(), full)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), full)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)
    assert g_ours[:, -1].abs().max() == 0  # the dropped last position gets no gradient


def test_token_logps_gradcheck() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[1, 2] = IGNORE
    assert torch.autograd.gradcheck(lambda t: token_logps(t, labels, chunk_tokens=2), (x,))


def test_token_logps_bf16_is_computed_in_fp32() -> None:
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 6, 50, generator=g) * 4).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (2, 6), generator=g)
    out = token_logps(logits, labels, chunk_tokens=4)
    assert out.dtype == torch.float32
    ref32 = logits.detach().float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref32, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_grad = F.one_hot(labels, 50).float() - logits.detach().float().softmax(-1)
    torch.testing.assert_close(logits.grad.float(), ref_grad, rtol=1e-2, atol=4e-3)


def test_token_logps_no_grad_and_shape_check() -> None:
    with torch.no_grad():
        out = token_logps(torch.zeros(2, 3, 4, requires_grad=True), torch.zeros(2, 3).long())
    assert not out.requires_grad
    torch.testing.assert_close(out, torch.full((2, 3), -math.log(4)))
    with pytest.raises(ValueError):
        token_logps(torch.zeros(2, 3, 4), torch.zeros(2, 4).long())


def test_segment_logps_packed_row_equals_per_sequence() -> None:
    g = torch.Generator().manual_seed(3)
    V, lengths = 13, [5, 3, 6]
    seqs = [torch.randn(n, V, generator=g, dtype=torch.float64) for n in lengths]
    labs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    for lab in labs:
        lab[-1] = IGNORE  # the last token of a packed sequence must not predict the next one
    labs[1][0] = IGNORE  # plus a prompt token
    per_seq = [sequence_logps(x.unsqueeze(0), y.unsqueeze(0)) for x, y in zip(seqs, labs)]
    # one packed row with two padding positions (segment id -1) at the end
    pad = 2
    row = torch.cat([*seqs, torch.randn(pad, V, generator=g, dtype=torch.float64)])
    row.requires_grad_()
    row_labels = torch.cat([*labs, torch.randint(0, V, (pad,), generator=g)])
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    sums, counts = segment_logps(row, row_labels, seg, num_segments=3)
    torch.testing.assert_close(sums, torch.cat([s for s, _ in per_seq]), rtol=1e-12, atol=1e-12)
    assert counts.tolist() == [int(c) for _, c in per_seq] == [4, 1, 5]
    sums.sum().backward()
    assert row.grad[-pad:].abs().max() == 0  # padding gets no gradient
    # batched [1, N, V] logits and precomputed per-token log-probs give the same sums
    sums_3d, _ = segment_logps(row.detach()[None], row_labels[None], seg[None], 3)
    per_token = token_logps(row.detach(), row_labels)
    sums_tok, counts_tok = segment_logps(per_token, row_labels, seg, 3)
    torch.testing.assert_close(sums_3d, sums.detach())
    torch.testing.assert_close(sums_tok, sums.detach())
    assert counts_tok.tolist() == counts.tolist()


def test_forked_token_logps_equals_log_softmax_with_a_second_label() -> None:
    """Per-token log-probs as token_logps, plus log p(extra label) at flat positions (repeats
    allowed); gradients equal log_softmax's, on a strided view and in chunks."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 8, 11, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[0, 0] = IGNORE
    index, extra = torch.tensor([3, 10, 3]), torch.tensor([5, 1, 2])
    w_tok, w_extra = torch.randn(2, 7, generator=g, dtype=torch.float64), torch.tensor(
        [0.5, 2.0, -1.0], dtype=torch.float64)
    per, ex = forked_token_logps(base[:, :-1], labels, index, extra, chunk_tokens=3)
    ((per * w_tok).sum() + (ex * w_extra).sum()).backward()
    grad, base.grad = base.grad.clone(), None
    ls = torch.log_softmax(base[:, :-1], -1)
    ref = ls.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1).masked_fill(labels < 0, 0)
    ref_ex = ls.reshape(-1, 11)[index, extra]
    torch.testing.assert_close(per, ref)
    torch.testing.assert_close(per, token_logps(base[:, :-1], labels))
    torch.testing.assert_close(ex, ref_ex)
    ((ref * w_tok).sum() + (ref_ex * w_extra).sum()).backward()
    torch.testing.assert_close(grad, base.grad)
    with pytest.raises(ValueError, match="do not match"):
        forked_token_logps(base, labels, index, extra[:2])


def test_forked_token_logps_backward_holds_one_logits_gradient() -> None:
    """Scoring the forks inside the one autograd function: backward's peak is the logits, one
    [T, V] gradient and a chunk block; reading them by indexing the logits adds a second
    gradient of the logits' size (what shared-prompt log-probs did before)."""
    t, v = 512, 4096
    logits = torch.randn(1, t, v).requires_grad_()
    labels = torch.randint(0, v, (1, t))
    index, extra = torch.tensor([10, 300]), torch.tensor([1, 2])

    def peak(fn) -> int:
        tracker = MemTracker()
        tracker.track_external(logits, labels, index, extra)
        with tracker:
            fn().backward()
        logits.grad = None
        (p,) = (snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
        return p

    def fused():
        per, ex = forked_token_logps(logits, labels, index, extra, chunk_tokens=64)
        return per.sum() + ex.sum()

    def indexed():
        flat = logits.reshape(-1, v)[index]
        return (token_logps(logits, labels, chunk_tokens=64).sum()
                + token_logps(flat, extra).sum())

    size = t * v * 4
    fused_peak, indexed_peak = peak(fused), peak(indexed)
    block = 64 * v * 4  # one chunk's fp32 temporary
    # the logits, their gradient, chunk blocks, and [T]-sized values (labels, lse, log-probs)
    assert fused_peak <= 2 * size + 2 * block + 64 * 1024
    assert indexed_peak - fused_peak >= 0.9 * size


def test_segment_logps_closed_form() -> None:
    flat = torch.tensor([LOGITS[0][0], LOGITS[0][2], LOGITS[1][0], LOGITS[1][1]])
    labels = torch.tensor([2, 1, 0, 3])
    seg = torch.tensor([1, 0, 1, 0])
    sums, counts = segment_logps(flat, labels, seg, num_segments=3)
    expected = [
        _math_logp(LOGITS[0][2], 1) + _math_logp(LOGITS[1][1], 3),
        _math_logp(LOGITS[0][0], 2) + _math_logp(LOGITS[1][0], 0),
        0.0,
    ]
    assert sums.tolist() == pytest.approx(expected, rel=1e-6)
    assert counts.tolist() == [2, 2, 0]


# ---------------------------------------------------------------------------------------------
# chunked linear cross-entropy
# ---------------------------------------------------------------------------------------------


def _problem(
    n: int = 50, h: int = 16, v: int = 97, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.3
    bias = torch.randn(v, generator=g, dtype=dtype) * 0.1
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = IGNORE
    labels[-3:] = IGNORE
    return hidden, weight, bias, labels


def _standard(hidden, weight, labels, bias=None, reduction="mean", softcap=None):
    logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction=reduction)


def _loss_and_grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    loss = fn(*leaves)
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


def _assert_close_fp32(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """fp32 tolerance: 1e-5 relative, with atol 1e-5 * max|ref| for near-zero entries."""
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()) + 1e-12)


def test_chunked_ce_closed_form() -> None:
    # N=2, H=2, V=3 by hand: logits = hidden @ W.T
    hidden = torch.tensor([[1.0, 0.0], [0.5, -1.0]])
    weight = torch.tensor([[1.0, 2.0], [0.0, 1.0], [-1.0, 0.5]])
    rows = [[1.0, 0.0, -1.0], [0.5 - 2.0, -1.0, -0.5 - 0.5]]
    labels = torch.tensor([0, 2])
    expected = [-_math_logp(r, y) for r, y in zip(rows, [0, 2])]
    out_sum = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=1, reduction="sum")
    out_mean = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=1)
    assert out_sum.item() == pytest.approx(sum(expected), rel=1e-6)
    assert out_mean.item() == pytest.approx(sum(expected) / 2, rel=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 50, 1000])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_chunked_ce_matches_standard_fp32(chunk_size: int, reduction: str) -> None:
    hidden, weight, _, labels = _problem()  # N=50: 7 does not divide it, 1000 > N
    ref = _loss_and_grads(lambda h, w: _standard(h, w, labels, reduction=reduction), hidden, weight)
    got = _loss_and_grads(
        lambda h, w: chunked_linear_cross_entropy(
            h, w, labels, chunk_size=chunk_size, reduction=reduction
        ),
        hidden,
        weight,
    )
    _assert_close_fp32(got, ref)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_ce_bias_and_softcap(softcap: float | None) -> None:
    hidden, weight, bias, labels = _problem(seed=1)
    ref = _loss_and_grads(
        lambda h, w, b: _standard(h, w, labels, b, softcap=softcap), hidden, weight, bias
    )
    ce = ChunkedCrossEntropy(chunk_size=9, logit_softcap=softcap)
    got = _loss_and_grads(lambda h, w, b: ce(h, w, labels, bias=b), hidden, weight, bias)
    _assert_close_fp32(got, ref)


def test_chunked_ce_fp64_is_exact() -> None:
    """In fp64 everything (bias, softcap, chunking) agrees with autograd to rounding error."""
    hidden, weight, bias, labels = _problem(n=30, h=8, v=41, dtype=torch.float64, seed=2)
    ref = _loss_and_grads(
        lambda h, w, b: _standard(h, w, labels, b, reduction="sum", softcap=3.0),
        hidden,
        weight,
        bias,
    )
    got = _loss_and_grads(
        lambda h, w, b: chunked_linear_cross_entropy(
            h, w, labels, bias=b, chunk_size=7, reduction="sum", logit_softcap=3.0
        ),
        hidden,
        weight,
        bias,
    )
    assert got[0].dtype == torch.float64
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_chunked_ce_num_items_gradient_accumulation() -> None:
    hidden, weight, _, labels = _problem(n=60, seed=3)
    total_items = int((labels != IGNORE).sum())
    ref = _loss_and_grads(lambda h, w: _standard(h, w, labels), hidden, weight)
    h_leaf = hidden.clone().requires_grad_()
    w_leaf = weight.clone().requires_grad_()
    loss = torch.zeros(())
    for part in (slice(0, 23), slice(23, 60)):  # two uneven micro-batches
        micro = chunked_linear_cross_entropy(
            h_leaf[part], w_leaf, labels[part], chunk_size=8, num_items=total_items
        )  # reduction="mean" is overridden by num_items
        micro.backward()
        loss = loss + micro.detach()
    _assert_close_fp32([loss, h_leaf.grad, w_leaf.grad], ref)
    # a tensor normalizer works too (no host sync needed)
    as_tensor = chunked_linear_cross_entropy(
        hidden, weight, labels, num_items=torch.tensor(float(total_items))
    )
    torch.testing.assert_close(as_tensor, ref[0], rtol=1e-5, atol=0)


def test_chunked_ce_leading_dims_and_all_ignored() -> None:
    hidden, weight, _, labels = _problem(n=24, seed=4)
    flat = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=5)
    batched = chunked_linear_cross_entropy(
        hidden.view(2, 12, -1), weight, labels.view(2, 12), chunk_size=5
    )
    torch.testing.assert_close(batched, flat)
    h = hidden.clone().requires_grad_()
    none_scored = chunked_linear_cross_entropy(h, weight, torch.full((24,), IGNORE))
    assert none_scored.item() == 0.0  # F.cross_entropy would give NaN
    none_scored.backward()
    assert h.grad.abs().max() == 0


def test_chunked_ce_frozen_weight_no_grad_and_single_backward() -> None:
    hidden, weight, _, labels = _problem(seed=5)
    h = hidden.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, weight, labels, chunk_size=16)  # frozen lm_head
    loss.backward()
    ref = _loss_and_grads(lambda x: _standard(x, weight, labels), hidden)
    _assert_close_fp32([loss.detach(), h.grad], ref)
    with torch.no_grad():
        val = chunked_linear_cross_entropy(h, weight, labels, chunk_size=16)
    assert not val.requires_grad
    torch.testing.assert_close(val, ref[0], rtol=1e-5, atol=0)
    twice = chunked_linear_cross_entropy(h, weight, labels)
    twice.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        twice.backward()


@pytest.mark.parametrize("grad_weight_fp32", [True, False])
def test_chunked_ce_bf16_within_tolerance(grad_weight_fp32: bool) -> None:
    """bf16 inputs: loss within 1e-2 relative, grads within 2e-2 of max|grad| of the fp32 result.

    The fp32 reference uses the same bf16-rounded inputs; the standard bf16 path
    (``F.cross_entropy`` on bf16 logits) is held to the same bound for comparison.
    """
    hidden, weight, _, labels = _problem(n=200, h=32, v=500, seed=6)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    ref = _loss_and_grads(lambda h, w: _standard(h, w, labels), hb.float(), wb.float())
    got = _loss_and_grads(
        lambda h, w: chunked_linear_cross_entropy(
            h, w, labels, chunk_size=33, grad_weight_fp32=grad_weight_fp32
        ),
        hb,
        wb,
    )
    std = _loss_and_grads(lambda h, w: _standard(h, w, labels), hb, wb)
    assert got[0].dtype == torch.float32
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for result in (got, std):
        loss, gh, gw = (x.float() for x in result)
        assert abs(loss.item() - ref[0].item()) <= 1e-2 * abs(ref[0].item())
        assert (gh - ref[1]).abs().max() <= 2e-2 * ref[1].abs().max()
        assert (gw - ref[2]).abs().max() <= 2e-2 * ref[2].abs().max()


def _peak_bytes(fn, n: int, h: int, v: int) -> tuple[int, int]:
    """(bytes of the inputs, peak bytes) of forward + backward, tracked by MemTracker."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE
    tracker = MemTracker()
    tracker.track_external(hidden, weight, labels)
    (inputs,) = (snap["Total"] for snap in tracker.get_tracker_snapshot("current").values())
    with tracker:
        fn(hidden, weight, labels).backward()
    (peak,) = (snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return inputs, peak


@pytest.mark.slow
def test_chunked_ce_peak_memory_is_lower_at_large_vocab() -> None:
    n, h, v, chunk = 1024, 64, 32000, 256
    f32 = 4
    inputs, std_peak = _peak_bytes(lambda x, w, y: _standard(x, w, y), n, h, v)
    inputs2, chunk_peak = _peak_bytes(
        lambda x, w, y: chunked_linear_cross_entropy(x, w, y, chunk_size=chunk), n, h, v
    )
    assert inputs == inputs2 == (n * h + v * h) * f32 + n * 8
    # the standard path holds at least the logits and their log-softmax, [N, V] each
    assert std_peak - inputs >= 2 * n * v * f32
    # the chunked path: grad_hidden [N, H] + grad_weight [V, H] + a couple of [chunk, V] blocks
    budget = (n * h + v * h) * f32 + 2 * chunk * v * f32 + 64 * 1024
    assert chunk_peak - inputs <= budget
    assert chunk_peak < 0.3 * std_peak


@pytest.mark.slow
def test_chunked_ce_default_chunk_is_1024_tokens_capped_at_256_mib() -> None:
    """The default chunk: 1024 tokens up to a vocabulary of 65,536 (the same peak as an explicit
    1024), fewer beyond it, so that one fp32 ``[chunk, V]`` block stays at 2**26 elements
    (at vocab 2**17 the default's working memory is half of a 1024-token chunk's)."""
    f32, n, h = 4, 2048, 4

    def work(v: int, chunk: int | None) -> int:
        inputs, peak = _peak_bytes(
            lambda x, w, y: chunked_linear_cross_entropy(x, w, y, chunk_size=chunk), n, h, v)
        return peak - inputs - (n * h + v * h) * f32  # less the inputs and their gradients

    assert work(4096, None) == work(4096, 1024)
    big = 1 << 17
    default, whole = work(big, None), work(big, 1024)
    assert (1 << 26) * f32 <= default <= 1.1 * (1 << 26) * f32
    assert whole >= 2 * (1 << 26) * f32
