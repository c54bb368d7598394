"""The chunked linear cross-entropy under autocast (bf16 mixed precision, the default where the
CPU or GPU has bf16): the hidden states' gradient is a bf16 matmul, as a standard head +
cross-entropy's is under autocast (it was an fp32 matmul, which autocast leaves alone in an
``out=`` call: half the speed on a CPU with bf16 kernels), within 1e-3 of the standard path's
(the softmax rounds differently in its last fp32 bit: a bf16 rounding flips in 0.1% of the
entries); the loss is the forward's alone bit for bit, and the weight's gradient an fp32
matmul accumulated in place, nearer the exact one than the standard path's; without autocast
every matmul keeps the input dtype. Tiny sizes, CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.losses import chunked_linear_cross_entropy

IGNORE = -100
MATMULS = {"mm", "addmm", "addmm_", "matmul", "bmm"}


class _Matmuls(TorchDispatchMode):
    """The input dtypes of each matmul dispatched inside the block that spans the vocabulary
    (the head's)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.dtypes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in MATMULS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
            if any(self.vocab in a.shape for a in mats):
                self.dtypes.append(tuple(a.dtype for a in mats[-2:]))
        return func(*args, **(kwargs or {}))


def _problem(n=96, h=32, v=500, seed=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = IGNORE
    return hidden, weight, labels


def _grads(fn, hidden, weight, autocast=True):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
        loss = fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _chunked(labels, chunk_size=40):
    return lambda h, w: chunked_linear_cross_entropy(h, w, labels, chunk_size=chunk_size,
                                                     reduction="sum")


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_under_autocast_the_hidden_gradient_is_the_standard_paths_bf16_matmul():
    hidden, weight, labels = _problem()
    seen = _Matmuls(weight.shape[0])
    with seen:
        loss, gh, gw = _grads(_chunked(labels), hidden, weight)
    bf, f32 = torch.bfloat16, torch.float32
    # 96 tokens in chunks of 40: per chunk the logits (bf16), d weight (fp32, in place into
    # the fp32 accumulator), d hidden (bf16)
    assert seen.dtypes == [(bf, bf), (f32, f32), (bf, bf)] * 3, seen.dtypes
    assert loss.dtype == gh.dtype == gw.dtype == f32
    # the loss is the one the forward alone computes, bit for bit
    with torch.no_grad(), torch.autocast("cpu", dtype=bf, cache_enabled=False):
        assert _chunked(labels)(hidden, weight) == loss
    # the standard head + cross-entropy under the same autocast: the same bf16 matmul for
    # d hidden (0.1% of the entries round the other way: 4e-4 here)
    std = _grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), labels,
                                              ignore_index=IGNORE, reduction="sum"),
                 hidden, weight)
    assert abs(loss - std[0]) <= 1e-5 * abs(std[0])
    assert _rel(gh, std[1]) <= 1e-3
    # d weight: fp32 matmuls, nearer the exact (fp64, unrounded) gradient than the standard
    # path's bf16 one
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    F.cross_entropy(F.linear(h64, w64), labels, ignore_index=IGNORE, reduction="sum").backward()
    assert _rel(gw, w64.grad) <= 1e-3 and _rel(gw, w64.grad) < _rel(std[2], w64.grad)
    assert _rel(gh, h64.grad) <= 4e-3  # bf16's rounding (2 ** -8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_autocast_the_matmuls_stay_in_the_input_dtype(dtype):
    hidden, weight, labels = _problem()
    seen = _Matmuls(weight.shape[0])
    with seen:
        _grads(_chunked(labels), hidden.to(dtype), weight.to(dtype), autocast=False)
    assert len(seen.dtypes) == 9
    assert all(d == dtype for mats in seen.dtypes for d in mats), seen.dtypes


def test_under_fp16_autocast_the_gradients_stay_fp32():
    """fp16's range would flush the unscaled softmax's small entries: only bf16 autocast moves
    the hidden states' gradient to the low-precision matmul (the logits' is autocast's)."""
    hidden, weight, labels = _problem()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    seen = _Matmuls(weight.shape[0])
    with seen:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = _chunked(labels)(h, w)
        loss.backward()
    f16, f32 = torch.float16, torch.float32
    assert seen.dtypes == [(f16, f16), (f32, f32), (f32, f32)] * 3, seen.dtypes
