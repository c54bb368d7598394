"""The chunked linear cross-entropy: the output head and the token loss together, without the
``[N, V]`` logits.

* :func:`chunked_linear_cross_entropy` / :class:`ChunkedCrossEntropy` -- cross-entropy of
  ``hidden @ weight.T`` that never materializes the ``[N, V]`` logits: the "fused linear
  cross-entropy" idea (as in Liger-Kernel), written with ordinary matmuls over token chunks, so
  it runs on any device.
* ``weight_grad_to`` (:class:`memlab.losses.tied.TiedWeightGrad`) -- a head tied to the input
  embedding: the loss's weight gradient is handed to the embedding lookup's backward.

Labels are *already aligned* with the hidden states (the caller shifts them); positions whose
label equals ``ignore_index`` contribute nothing.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from memlab.losses.tied import TiedWeightGrad
from memlab.losses.token import AutogradCtx, acc_dtype, token_chunks, tokens_per_chunk

__all__ = ["ChunkedCrossEntropy", "LinearCrossEntropyFunction", "chunked_linear_cross_entropy"]

LOSS_CHUNK_TOKENS = 1024
LOSS_CHUNK_ELEMENTS = 1 << 26
"""The default chunk: ``LOSS_CHUNK_TOKENS`` tokens, fewer where their fp32 ``[chunk, V]`` block
would pass ``LOSS_CHUNK_ELEMENTS`` (256 MiB: vocabularies over 65,536; 441 tokens at 151,936).
Larger than ``token_logps``' 64 MiB: each chunk also updates the whole ``[V, H]`` weight
gradient, and fewer, larger updates are faster."""


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` computed over token chunks.

    Forward walks the tokens in chunks of ``chunk_size``; per chunk it forms the logits
    ``[chunk, V]`` (matmul in the input dtype -- GPU GEMMs accumulate in fp32), upcasts them to
    fp32 (fp64 stays fp64), takes log-sum-exp and target logit, and -- when gradients are
    needed -- turns them into ``d loss / d logits = softmax - onehot`` right away and folds that
    into the gradients of ``hidden`` (written to a stored ``[N, H]`` buffer) and ``weight`` /
    ``bias`` (accumulated ``[V, H]`` / ``[V]``). Backward only scales the stored gradients by
    ``grad_output``; it can run once (the stored gradients are handed over, not copied).

    Under bf16 autocast (bf16 mixed precision) the hidden states' gradient is computed as
    a standard ``linear`` + cross-entropy computes it there: ``d logits`` cast to autocast's
    dtype times the weight cast to it (in-place and ``out=`` matmuls are not
    autocast, so it was an fp32 matmul: 1.8 s against 1.0 s in bf16 for a 441-token chunk at
    Qwen2.5's vocabulary on a 2-core AVX-512 CPU with bf16 kernels; on a GPU more still).
    The weight is cast again for it after the chunk's fp32 block is freed, so no chunk holds
    more than the logits' matmul already does (the cast weight beside a low-precision
    ``[chunk, V]`` block). The weight's gradient stays an fp32 matmul accumulated in place: as
    fast here as a low-precision one plus its ``[V, H]`` temporary and sum, and more exact.
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
        acc = acc_dtype(hidden.dtype)
        loss = torch.zeros((), dtype=acc, device=device)
        grad_h = torch.empty_like(hidden) if need_h else None
        w_acc_dtype = acc if grad_weight_fp32 else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=w_acc_dtype, device=device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=device) if need_b else None
        w_t = weight.t()
        # the hidden states' gradient runs in autocast's dtype where the logits' matmul does
        # (None: every matmul in the input dtype)
        mm_dtype = _autocast_dtype(hidden, weight)
        for s, e in token_chunks(n, chunk_size):
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
            target = z.gather(1, safe).squeeze(1)
            # log-sum-exp as torch.logsumexp computes it (the same floats), in place: z becomes
            # exp(z - max), whose row sums give the log-sum-exp and divide it into the softmax
            # (torch's kernel makes a [c, V] temporary for z - max, then the softmax needed a
            # second subtraction and exp)
            top = z.amax(dim=1, keepdim=True)
            top.masked_fill_(top.abs() == float("inf"), 0.0)
            z.sub_(top).exp_()
            total = z.sum(dim=1)
            lse = total.log().add_(top.squeeze(1))
            del top
            loss += (lse - target).masked_fill_(~valid, 0.0).sum()
            if not need_any:
                continue
            # dz = (softmax(z) - onehot(label)) on valid rows, 0 on ignored rows
            dz = z.div_(total.unsqueeze(1))
            del total
            dz.scatter_add_(1, safe, torch.full_like(target, -1.0).unsqueeze(1))
            dz.mul_(valid.unsqueeze(1))
            if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                dz.mul_(tanh.mul_(tanh).neg_().add_(1.0))
                del tanh
            if grad_b is not None:
                grad_b += dz.sum(0)
            del lse, target
            if mm_dtype is None:
                dz_lp = dz.to(hidden.dtype)  # matmuls in the input dtype
                del dz, z
                if grad_h is not None:
                    torch.mm(dz_lp, weight, out=grad_h[s:e])
                if grad_w is not None:
                    if grad_w.dtype == hidden.dtype:
                        grad_w.addmm_(dz_lp.t(), h)
                    else:  # low-precision GEMM per chunk, fp32 accumulation across chunks
                        grad_w += dz_lp.t() @ h
            else:  # the weight's gradient in fp32, in place; the hidden states' in autocast's
                if grad_w is not None:  # dtype, the fp32 block freed before the weight's cast
                    grad_w.addmm_(dz.t(), h)
                dz_lp = dz.to(mm_dtype)
                del dz, z
                if grad_h is not None:
                    grad_h[s:e] = dz_lp @ weight.to(mm_dtype)
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


def _autocast_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype | None:
    """bf16 where autocast runs ``hidden @ weight.T`` in bf16, casting that matmul's fp32
    inputs (bf16 mixed precision's forward); None where autocast is off, is fp16, or the inputs
    are not fp32 (autocast leaves fp64 alone; low-precision inputs are the matmul's dtype
    already)."""
    device = hidden.device.type
    if not torch.is_autocast_enabled(device) or not (
            hidden.dtype == weight.dtype == torch.float32):
        return None
    dtype = torch.get_autocast_dtype(device)
    # bf16 only: fp16's range would flush the unscaled softmax's small entries (a loss scaler
    # scales this function's gradients after they are made)
    return dtype if dtype == torch.bfloat16 else None


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
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
        chunk_size: tokens per chunk; working memory is a few ``[chunk_size, V]`` fp32 blocks
            (default: 1024 tokens, at most a 256 MiB block: 441 at vocab 151,936).
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
    if chunk_size is None:
        chunk_size = min(LOSS_CHUNK_TOKENS, tokens_per_chunk(weight.shape[0],
                                                             LOSS_CHUNK_ELEMENTS))
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

    ``loss = ChunkedCrossEntropy()(hidden, lm_head.weight, labels)``.
    """

    def __init__(
        self,
        chunk_size: int | None = None,
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
