"""Token-level log-probs: per token, per sequence and per packed segment.

Everything here is plain PyTorch (no Triton, no CUDA-only ops), so it runs on any device.

* :func:`token_logps` -- ``log p(label_t)`` for every position, in fp32, without keeping an
  extra ``[..., V]`` copy of the logits for backward (a custom autograd function saves only the
  logits that already exist and one fp32 log-sum-exp per token).
* :func:`sequence_logps` -- per-sequence sums of those log-probs and token counts (DPO, KTO, ...).
* :func:`segment_logps` -- the same for packed / padding-free rows, where several sequences share
  a row and ``segment_ids`` says which sequence each token belongs to.

The chunked linear cross-entropy (the head and the loss without ``[N, V]`` logits) is in
:mod:`memlab.losses.linear_ce`.

Labels are always *already aligned* with the logits / hidden states (the caller shifts them);
positions whose label equals ``ignore_index`` contribute nothing.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "forked_token_logps",
    "segment_logps",
    "sequence_logps",
    "token_logps",
]

AutogradCtx: TypeAlias = Any
"""The ``ctx`` of a custom autograd function: forward stores on it what backward reads
(torch types it as ``FunctionCtx``, which declares neither those attributes nor
``saved_tensors`` / ``needs_input_grad``)."""

# Default work budget of one chunk of ``token_logps`` (elements of the fp32 [chunk, V] temporary).
_LOGPS_CHUNK_ELEMENTS = 1 << 24  # 64 MiB in fp32


def tokens_per_chunk(vocab: int, elements: int) -> int:
    """Tokens whose fp32 ``[tokens, vocab]`` block holds ``elements`` (at least one token)."""
    return max(1, elements // max(1, vocab))


# ---------------------------------------------------------------------------------------------
# per-token log-probs
# ---------------------------------------------------------------------------------------------


def _as_3d(x: Tensor) -> Tensor:
    """View ``[..., T, V]`` as ``[B, T, V]`` without copying where possible.

    A contiguous tensor is viewed as one long row ``[1, B*T, V]`` (fewest chunks); a strided
    3-D tensor (e.g. ``logits[:, :-1]``) is kept as is and walked row by row.
    """
    if x.dim() < 2:
        raise ValueError(f"logits need at least 2 dims [..., V], got shape {tuple(x.shape)}")
    if x.is_contiguous():
        return x.view(1, -1, x.shape[-1])
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])  # rare: >3-D and strided (may copy)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for half / bf16 / fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def token_chunks(n: int, size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of consecutive chunks of ``size`` over ``n`` tokens (the last shorter)."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


class _TokenLogps(torch.autograd.Function):
    """``logits[..., label] - logsumexp(logits)`` in fp32, masked; saves no ``[..., V]`` copy.
    Also scores ``extra_labels`` at the flat positions ``extra_index`` (a second label at a
    position), so that backward writes one gradient of the logits' size for both."""

    @staticmethod
    def forward(
        ctx: AutogradCtx, logits: Tensor, labels: Tensor, ignore_index: int, chunk_tokens: int,
        extra_index: Tensor, extra_labels: Tensor,
    ) -> tuple[Tensor, Tensor]:
        valid = labels != ignore_index
        safe = labels.masked_fill(~valid, 0)
        x3 = _as_3d(logits)
        acc = acc_dtype(logits.dtype)
        lse = torch.empty(x3.shape[:-1], dtype=acc, device=logits.device)
        for b in range(x3.shape[0]):
            for s, e in token_chunks(x3.shape[1], chunk_tokens):
                torch.logsumexp(x3[b, s:e].to(acc), dim=-1, out=lse[b, s:e])
        lse = lse.view(labels.shape)
        target = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(acc)
        out = (target - lse).masked_fill_(~valid, 0.0)
        at = torch.unravel_index(extra_index, labels.shape)
        index = (*at, extra_labels)  # (a starred subscript is Python 3.11 syntax)
        extra = logits[index].to(acc) - lse[at]
        ctx.save_for_backward(logits, safe, valid, lse, extra_index, extra_labels)
        ctx.chunk_tokens = chunk_tokens
        return out, extra

    @staticmethod
    @once_differentiable
    def backward(ctx: AutogradCtx, grad_out: Tensor, grad_extra: Tensor
                 ) -> tuple[Tensor | None, None, None, None, None, None]:
        logits, safe, valid, lse, extra_index, extra_labels = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        # d logp_t / d logits_t = onehot(label_t) - softmax(logits_t)
        x3 = _as_3d(logits)
        col = (*x3.shape[:-1], 1)  # same [B, T] walk as forward, one column
        g3 = (grad_out.to(lse.dtype) * valid).reshape(col)
        lse3, lab3 = lse.reshape(col), safe.reshape(col)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad3 = grad.view(x3.shape)
        for b in range(x3.shape[0]):
            for s, e in token_chunks(x3.shape[1], ctx.chunk_tokens):
                p = (x3[b, s:e].to(lse.dtype) - lse3[b, s:e]).exp_()
                p.mul_(-g3[b, s:e])
                p.scatter_add_(-1, lab3[b, s:e], g3[b, s:e])
                grad3[b, s:e].copy_(p)
        if extra_index.numel():  # the extra labels' terms, added at their positions
            at = torch.unravel_index(extra_index, safe.shape)
            ge = grad_extra.to(lse.dtype).unsqueeze(-1)
            p = (logits[at].to(lse.dtype) - lse[at].unsqueeze(-1)).exp_().mul_(-ge)
            p.scatter_add_(-1, extra_labels.unsqueeze(-1), ge)
            grad.index_put_(at, p.to(grad.dtype), accumulate=True)
        return grad, None, None, None, None, None


def token_logps(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, chunk_tokens: int | None = None
) -> Tensor:
    """Log-probability of each label under ``softmax(logits)``, in fp32 (fp64 for fp64 logits).

    Args:
        logits: ``[..., V]`` scores, any float dtype; may be a strided view such as
            ``logits[:, :-1]`` (no copy is made of it).
        labels: ``[...]`` integer targets aligned with ``logits``.
        ignore_index: label value of positions to skip; their log-prob is 0 (and gradient 0).
        chunk_tokens: tokens per fp32 temporary (default: ``2**24 // V``) -- bounds the working
            memory of forward and backward to one ``[chunk_tokens, V]`` fp32 block.

    Returns:
        ``[...]`` fp32 (fp64) tensor of ``log p(label)`` (0 where ``labels == ignore_index``).

    Memory: besides the logits themselves (which the caller holds anyway), backward keeps only
    one fp32 log-sum-exp per token; ``log_softmax(...).gather(...)`` would save a full
    ``[..., V]`` copy (in fp32 if upcast first). Double backward is not supported.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    if chunk_tokens is None:
        chunk_tokens = tokens_per_chunk(logits.shape[-1], _LOGPS_CHUNK_ELEMENTS)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    none = torch.zeros(0, dtype=torch.long, device=labels.device)
    return _TokenLogps.apply(logits, labels, ignore_index, chunk_tokens, none, none)[0]


def forked_token_logps(
    logits: Tensor, labels: Tensor, extra_index: Tensor, extra_labels: Tensor,
    ignore_index: int = -100, chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`token_logps` plus a second label at some positions: ``(per-token log-probs,
    log p(extra_labels[k]) at flat position extra_index[k] of labels.shape)``. A shared prompt's
    last token predicts the first token of every completion after it; scoring those forks here,
    not by indexing the logits, keeps backward at one ``[..., V]`` gradient."""
    if logits.shape[:-1] != labels.shape or extra_index.shape != extra_labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} / labels {tuple(labels.shape)}, "
                         f"extra_index {tuple(extra_index.shape)} / extra_labels "
                         f"{tuple(extra_labels.shape)} do not match")
    if chunk_tokens is None:
        chunk_tokens = tokens_per_chunk(logits.shape[-1], _LOGPS_CHUNK_ELEMENTS)
    return _TokenLogps.apply(logits, labels, ignore_index, chunk_tokens, extra_index.long(),
                             extra_labels.long())


def sequence_logps(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, chunk_tokens: int | None = None
) -> tuple[Tensor, Tensor]:
    """Per-sequence sum of label log-probs and the number of scored tokens.

    Args:
        logits: ``[B, T, V]`` (labels already shifted so ``labels[:, t]`` is scored by
            ``logits[:, t]``).
        labels: ``[B, T]``; ``ignore_index`` marks prompt / padding positions.
        ignore_index: label value to skip.
        chunk_tokens: see :func:`token_logps`.

    Returns:
        ``(sum_logps, n_tokens)``: fp32 (fp64) ``[B]`` sums (differentiable) and int64 ``[B]``
        counts.
        Length-averaged log-probs (IPO, SimPO, ...) are ``sum_logps / n_tokens.clamp(min=1)``.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    per_token = token_logps(logits, labels, ignore_index, chunk_tokens)
    return per_token.sum(-1), (labels != ignore_index).sum(-1)


def segment_logps(
    logits_or_logps: Tensor,
    labels: Tensor,
    segment_ids: Tensor,
    num_segments: int,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-segment sums of label log-probs for packed / padding-free rows.

    Several sequences share a row; ``segment_ids`` names the sequence of each token
    (``0 .. num_segments-1``; a negative id, e.g. for padding, belongs to no segment).

    Args:
        logits_or_logps: either logits ``[..., V]`` (shape ``labels.shape + (V,)``, e.g. the flat
            ``[N, V]`` of a padding-free batch) or already computed per-token log-probs with the
            same shape as ``labels``.
        labels: ``[...]`` aligned labels. At a boundary between two packed sequences the label
            of the last token of the first one must be ``ignore_index`` (it must not predict the
            next sequence's first token) -- the caller's shifting takes care of that.
        segment_ids: ``[...]`` integer segment of each position (same shape as ``labels``).
        num_segments: number of output segments.
        ignore_index: label value to skip.
        chunk_tokens: see :func:`token_logps` (used only when logits are given).

    Returns:
        ``(sum_logps, n_tokens)``: fp32 (fp64) ``[num_segments]`` sums (differentiable, via
        ``index_add``) and int64 ``[num_segments]`` counts.
    """
    if segment_ids.shape != labels.shape:
        raise ValueError(
            f"segment_ids {tuple(segment_ids.shape)} and labels {tuple(labels.shape)} differ"
        )
    if logits_or_logps.shape == labels.shape:
        per_token = logits_or_logps.to(acc_dtype(logits_or_logps.dtype))
    elif logits_or_logps.shape[:-1] == labels.shape:
        per_token = token_logps(logits_or_logps, labels, ignore_index, chunk_tokens)
    else:
        raise ValueError(
            f"expected logits {tuple(labels.shape)}+(V,) or log-probs {tuple(labels.shape)}, "
            f"got {tuple(logits_or_logps.shape)}"
        )
    keep = (labels != ignore_index) & (segment_ids >= 0)
    index = segment_ids.masked_fill(~keep, 0).reshape(-1).long()
    values = per_token.masked_fill(~keep, 0.0).reshape(-1)
    device = per_token.device
    sums = torch.zeros(num_segments, dtype=values.dtype, device=device).index_add(0, index, values)
    counts = torch.zeros(num_segments, dtype=torch.long, device=device).index_add_(
        0, index, keep.reshape(-1).long()
    )
    return sums, counts
