"""The CUDA variable-length path of memlab's per-document attention (``attention/_varlen.py``)
checked on the CPU: the offsets and prefix gathers of :func:`varlen_plan`, run through
:func:`varlen_reference` (varlen_attn's causal semantics with sdpa, one document at a time),
give the per-document loop's output exactly, for plain packed rows and for rows whose
documents share a prompt. tests/gpu/test_cuda_paths.py runs torch's own kernel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memlab.attention._varlen import (
    _make,
    uses_varlen_kernel,
    varlen_attention,
    varlen_plan,
    varlen_reference,
)
from memlab.trainer.batch import Segments

PLAIN = Segments([(5, 3, 8), (16,)])  # row 0: three documents; row 1: one
# row 0: a prompt of 4 seen by two completions (3 and 5 tokens), then a plain document of 4;
# row 1: a pair with a prompt of 6, and a pad tail of 4 (its own document)
SHARED = Segments([(4, 3, (5, 0, 4), 4), (6, 2, (4, 0, 6), 4)])


def _qkv(rows: int, width: int, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, width, dim, generator=g)
    k = torch.randn(rows, kv_heads, width, dim, generator=g)
    v = torch.randn(rows, kv_heads, width, dim, generator=g)
    return q, k, v


def test_plan_offsets_and_prefix_gathers():
    plain = varlen_plan(PLAIN, 16)
    assert plain.cu_q.tolist() == plain.cu_k.tolist() == [0, 5, 8, 16, 32]
    assert (plain.max_q, plain.max_k, plain.k_index) == (16, 16, None)
    shared = varlen_plan(SHARED, 16)
    assert shared.cu_q.tolist() == [0, 4, 7, 12, 16, 22, 24, 28, 32]
    # a completion's keys: the prompt's tokens, then its own
    assert shared.cu_k.tolist() == [0, 4, 7, 16, 20, 26, 28, 38, 42]
    assert shared.k_index[7:16].tolist() == [0, 1, 2, 3, 7, 8, 9, 10, 11]
    assert shared.k_index[28:38].tolist() == [16, 17, 18, 19, 20, 21, 24, 25, 26, 27]
    assert (shared.max_q, shared.max_k) == (6, 10)  # the second pair: 6 + 4
    assert varlen_plan(SHARED, 16) is shared  # once per batch, whatever the layers
    with pytest.raises(ValueError, match="cover 32 tokens"):
        varlen_plan(PLAIN, 20)


@pytest.mark.parametrize("segments", [PLAIN, SHARED], ids=["packed", "shared-prompt"])
def test_one_varlen_call_equals_the_per_document_loop(segments):
    q, k, v = _qkv(2, 16)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    loop, _ = _make("sdpa")(module, q, k, v, None, scaling=0.3, memlab_segments=segments)
    one = varlen_attention(q, k, v, segments, scaling=0.3, kernel=varlen_reference)
    assert one.shape == loop.shape == (2, 16, 4, 8)
    torch.testing.assert_close(one, loop, rtol=1e-5, atol=1e-6)


def test_the_kernel_is_chosen_only_where_it_runs():
    q = torch.zeros(1, 2, 4, 8)
    assert not uses_varlen_kernel(q, 0.0)  # CPU: the exact per-document loop
    assert not uses_varlen_kernel(q.bfloat16(), 0.0)
