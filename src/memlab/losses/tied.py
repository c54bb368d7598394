"""A weight shared by the output head and the input embedding (tied embeddings) gets one
gradient tensor: the head's loss hands its gradient of the weight to the embedding lookup's
backward, which adds its rows into it in place (:class:`TiedWeightGrad`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from memlab.losses.token import AutogradCtx

__all__ = ["TiedWeightGrad"]


class TiedWeightGrad:
    """The gradient of a weight shared by the output head and the input embedding (tied
    embeddings, e.g. Qwen2.5-0.5B's 151,936 x 896), handed from the head's loss to the
    embedding lookup's backward, so that one weight-sized gradient is alive, not three.

    Autograd sums the two uses' gradients of a tensor in its input buffer in place only when it
    holds the last reference to one of them and no dispatch mode is active
    (``at::isTensorSubclassLike`` is true under any TorchDispatchMode: memlab's memory tracker,
    torch's MemTracker); else ``head + embedding`` is a third weight-sized tensor beside the
    two (the measured backward peak of a tied weight). Here the loss
    (:func:`chunked_linear_cross_entropy` with ``weight_grad_to``) parks its weight gradient
    instead of returning it; the lookup (:meth:`embedding`: the embedding's own forward) adds
    its rows into that tensor with ``index_add_`` in backward and returns it as the weight's
    only gradient, which ``AccumulateGrad`` takes over without a copy. The embedding's dense
    ``[V, H]`` gradient is never built. The same sum up to the order of the float additions
    (each row's head term first). The loss's backward runs before the lookup's: the lookup's
    output reaches the loss only through the decoder."""

    def __init__(self) -> None:
        self._grad: Tensor | None = None

    def put(self, grad: Tensor) -> None:
        """The head's gradient of the weight (a second one is added to the first)."""
        if self._grad is None:
            self._grad = grad
        else:
            self._grad.add_(grad)

    def take(self) -> Tensor | None:
        """The parked gradient (None when no head gradient came), which this then drops."""
        grad, self._grad = self._grad, None
        return grad

    def embedding(self, module: nn.Embedding, ids: Tensor) -> Tensor:
        """``module(ids)`` (a plain ``nn.Embedding``: no ``max_norm``, dense gradient), whose
        backward returns the parked head gradient plus the embedding's rows."""
        return _TiedEmbedding.apply(module.weight, ids, module.padding_idx, self)


class _TiedEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)``; backward adds ``grad_out``'s rows (but the
    padding index's, as ``embedding_dense_backward``) into :meth:`TiedWeightGrad.take`'s
    tensor (zeros when none) and returns it."""

    @staticmethod
    def forward(ctx: AutogradCtx, weight: Tensor, ids: Tensor, padding_idx: int | None,
                sink: TiedWeightGrad) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.sink = padding_idx, sink
        ctx.weight_shape, ctx.weight_device = weight.shape, weight.device
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx: AutogradCtx, grad_out: Tensor) -> tuple[Tensor | None, None, None, None]:
        (ids,) = ctx.saved_tensors
        grad = ctx.sink.take()
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if grad is None:
            grad = torch.zeros(ctx.weight_shape, dtype=grad_out.dtype, device=ctx.weight_device)
        index = ids.reshape(-1)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((index == ctx.padding_idx).unsqueeze(1), 0.0)
        grad.index_add_(0, index, rows.to(grad.dtype))
        return grad, None, None, None
