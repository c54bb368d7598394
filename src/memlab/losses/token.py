"""Token-level losses: per-token / per-sequence log-probs and a chunked linear cross-entropy.

Everything here is plain PyTorch (no Triton, no CUDA-only ops), so it runs on any device.

* :func:`token_logps` -- ``log p(label_t)`` for every position, in fp32, without keeping an
  extra ``[..., V]`` copy of the logits for backward (a custom autograd function saves only the
  logits that already exist and one fp32 log-sum-exp per token).
* :func:`sequence_logps` -- per-sequence sums of those log-probs and token counts (DPO, KTO, ...).
* :func:`segment_logps` -- the same for packed / padding-free rows, where several sequences share
  a row and ``segment_ids`` says which sequence each token belongs to.
* :func:`chunked_linear_cross_entropy` / :class:`ChunkedCrossEntropy` -- cross-entropy of
  ``hidden @ weight.T`` that never materializes the ``[N, V]`` logits: the "fused linear
  cross-entropy" idea (as in Liger-Kernel), written with ordinary matmuls over token chunks.
* ``weight_grad_to`` (:class:`memlab.losses.tied.TiedWeightGrad`) -- a head tied to the input
  embedding: the loss's weight gradient is handed to the embedding lookup's backward.

Labels are always *already aligned* with the logits / hidden states (the caller shifts them);
positions whose label equals ``ignore_index`` contribute nothing.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from memlab.losses.tied import TiedWeightGrad

__all__ = [
    "ChunkedCrossEntropy",
    "LinearCrossEntropyFunction",
    "chunked_linear_cross_entropy",
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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for half / bf16 / fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
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
        acc = _acc_dtype(logits.dtype)
        lse = torch.empty(x3.shape[:-1], dtype=acc, device=logits.device)
        for b in range(x3.shape[0]):
            for s, e in _chunks(x3.shape[1], chunk_tokens):
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
            for s, e in _chunks(x3.shape[1], ctx.chunk_tokens):
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
        chunk_tokens = max(1, _LOGPS_CHUNK_ELEMENTS // max(1, logits.shape[-1]))
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
        chunk_tokens = max(1, _LOGPS_CHUNK_ELEMENTS // max(1, logits.shape[-1]))
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
        per_token = logits_or_logps.to(_acc_dtype(logits_or_logps.dtype))
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


# ---------------------------------------------------------------------------------------------
# chunked (fused) linear cross-entropy
# ---------------------------------------------------------------------------------------------


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` computed over token chunks.

    Forward walks the tokens in chunks of ``chunk_size``; per chunk it forms the logits
    ``[chunk, V]`` (matmul in the input dtype -- GPU GEMMs accumulate in fp32), upcasts them to
    fp32 (fp64 stays fp64), takes log-sum-exp and target logit, and -- when gradients are
    needed -- turns them into ``d loss / d logits = softmax - onehot`` right away and folds that
    into the gradients of ``hidden`` (written to a stored ``[N, H]`` buffer) and ``weight`` /
    ``bias`` (accumulated ``[V, H]`` / ``[V]``). Backward only scales the stored gradients by
    ``grad_output``; it can run once (the stored gradients are handed over, not copied).
    """

    @staticmethod
    def forward(
        ctx: AutogradCtx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None,
        chunk_size: int,
        ignore_index: int,
        logit_softcap: float | None,
        need_grads: tuple[bool, bool, bool],
        grad_weight_fp32: bool,
        weight_grad_to: TiedWeightGrad | None = None,
    ) -> Tensor:
        n, device = hidden.shape[0], hidden.device
        need_h, need_w, need_b = need_grads
        need_any = need_h or need_w or need_b
        acc = _acc_dtype(hidden.dtype)
        loss = torch.zeros((), dtype=acc, device=device)
        grad_h = torch.empty_like(hidden) if need_h else None
        w_acc_dtype = acc if grad_weight_fp32 else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=w_acc_dtype, device=device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=device) if need_b else None
        w_t = weight.t()
        for s, e in _chunks(n, chunk_size):
            h = hidden[s:e]
            lab = labels[s:e]
            valid = lab != ignore_index
            safe = lab.masked_fill(~valid, 0).unsqueeze(1)
            raw = torch.addmm(bias, h, w_t) if bias is not None else h @ w_t
            z = raw.to(acc)  # [c, V] fp32 (no copy when already fp32)
            del raw
            tanh = None
            if logit_softcap is not None:
                tanh = z.div_(logit_softcap).tanh_()
                z = tanh * logit_softcap
            lse = torch.logsumexp(z, dim=1)
            target = z.gather(1, safe).squeeze(1)
            loss += (lse - target).masked_fill_(~valid, 0.0).sum()
            if not need_any:
                continue
            # dz = (softmax(z) - onehot(label)) on valid rows, 0 on ignored rows
            dz = z.sub_(lse.unsqueeze(1)).exp_()
            dz.scatter_add_(1, safe, torch.full_like(target, -1.0).unsqueeze(1))
            dz.mul_(valid.unsqueeze(1))
            if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                dz.mul_(tanh.mul_(tanh).neg_().add_(1.0))
                del tanh
            if grad_b is not None:
                grad_b += dz.sum(0)
            dz_lp = dz.to(hidden.dtype)  # matmuls in the input dtype
            del dz, z
            if grad_h is not None:
                torch.mm(dz_lp, weight, out=grad_h[s:e])
            if grad_w is not None:
                if grad_w.dtype == hidden.dtype:
                    grad_w.addmm_(dz_lp.t(), h)
                else:  # low-precision GEMM per chunk, fp32 accumulation across chunks
                    grad_w += dz_lp.t() @ h
            del dz_lp
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and bias is not None and grad_b.dtype != bias.dtype:
            grad_b = grad_b.to(bias.dtype)
        ctx.grads = [grad_h, grad_w, grad_b]
        ctx.weight_grad_to = weight_grad_to
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: AutogradCtx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "chunked_linear_cross_entropy: backward can run only once per forward "
                "(the gradients were computed in forward and already handed over)"
            )
        ctx.grads = None
        out: list[Tensor | None] = []
        needs = ctx.needs_input_grad
        for g, needed in zip(grads, (needs[0], needs[1], needs[3])):
            out.append(g.mul_(grad_out) if (g is not None and needed) else None)
        grad_h, grad_w, grad_b = out
        if ctx.weight_grad_to is not None and grad_w is not None:
            ctx.weight_grad_to.put(grad_w)  # the embedding lookup's backward returns it
            grad_w = None
        return grad_h, grad_w, None, grad_b, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: Literal["sum", "mean"] = "mean",
    logit_softcap: float | None = None,
    num_items: int | float | Tensor | None = None,
    grad_weight_fp32: bool = True,
    weight_grad_to: TiedWeightGrad | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` without ``[N, V]`` logits.

    Equals ``F.cross_entropy(hidden @ weight.T + bias, labels, ignore_index=ignore_index,
    reduction=reduction)`` (with ``logit_softcap``: on ``cap * tanh(logits / cap)``), in value
    and in the gradients of ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``, flattened) final hidden states, labels aligned.
        weight: ``[V, H]`` output projection (``lm_head.weight``).
        labels: ``[N]`` (or ``[...]``) target ids; ``ignore_index`` positions are skipped.
        bias: optional ``[V]`` output bias.
        chunk_size: tokens per chunk; working memory is a few ``[chunk_size, V]`` fp32 blocks.
        ignore_index: label value to skip.
        reduction: ``"sum"`` over scored tokens or ``"mean"`` over them (0 when none is
            scored, where ``F.cross_entropy`` gives NaN).
        logit_softcap: if set, logits are ``cap * tanh(logits / cap)`` (Gemma-2 style).
        num_items: explicit normalizer: when given the loss is ``sum / num_items`` whatever
            ``reduction`` says (gradient accumulation: pass the scored-token count of the whole
            accumulated / global batch so that micro-batches add up to the true mean).
        grad_weight_fp32: accumulate the weight (and bias) gradient across chunks in fp32 when
            the weight is in lower precision (more exact; ``[V, H]`` fp32 buffer plus one
            ``[V, H]`` temporary per chunk). ``False`` accumulates in place in the weight dtype.
        weight_grad_to: ``weight`` is tied to an input embedding looked up through
            :meth:`TiedWeightGrad.embedding`: the weight's gradient goes to that lookup's
            backward (which adds the embedding's rows into it and returns the sum for the
            weight) instead of straight to ``weight``.

    Returns:
        Scalar loss in fp32 (fp64 for fp64 inputs), also for half / bf16 inputs.

    Memory: the gradients are computed during forward, so the stored state is ``grad_hidden``
    ``[N, H]`` plus ``grad_weight`` ``[V, H]`` (only for inputs that require grad and only when
    grad mode is on), never ``[N, V]``. Backward can be called once per forward.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} differ")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1)
    if h2.shape[0] != lab.shape[0]:
        raise ValueError(f"{h2.shape[0]} hidden rows but {lab.shape[0]} labels")
    if h2.dtype != weight.dtype:
        raise ValueError(f"hidden is {h2.dtype} but weight is {weight.dtype}")
    grad_on = torch.is_grad_enabled()
    need = (
        grad_on and h2.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    total = LinearCrossEntropyFunction.apply(
        h2.contiguous(),
        weight,
        lab,
        bias,
        chunk_size,
        ignore_index,
        logit_softcap,
        need,
        grad_weight_fp32,
        weight_grad_to,
    )
    if num_items is not None:
        return total / num_items
    if reduction == "mean":
        return total / (lab != ignore_index).sum().clamp(min=1)
    return total


class ChunkedCrossEntropy(nn.Module):
    """Module form of :func:`chunked_linear_cross_entropy` holding its settings.

    ``loss = ChunkedCrossEntropy(chunk_size=1024)(hidden, lm_head.weight, labels)``.
    """

    def __init__(
        self,
        chunk_size: int = 1024,
        ignore_index: int = -100,
        reduction: Literal["sum", "mean"] = "mean",
        logit_softcap: float | None = None,
        grad_weight_fp32: bool = True,
    ) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.logit_softcap = logit_softcap
        self.grad_weight_fp32 = grad_weight_fp32

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None = None,
        num_items: int | float | Tensor | None = None,
    ) -> Tensor:
        """See :func:`chunked_linear_cross_entropy`."""
        return chunked_linear_cross_entropy(
            hidden,
            weight,
            labels,
            bias=bias,
            chunk_size=self.chunk_size,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            logit_softcap=self.logit_softcap,
            num_items=num_items,
            grad_weight_fp32=self.grad_weight_fp32,
        )

    def extra_repr(self) -> str:
        return (
            f"chunk_size={self.chunk_size}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction!r}, logit_softcap={self.logit_softcap}"
        )
