"""Per-document attention for eager and sdpa ("varlen" without flash-attn).

Transformers isolates the documents of a packed / padding-free row on eager and sdpa with one
block-diagonal [N, N] mask over the whole row: attention then costs N^2 over the row's total
length N, more than the padding it removed (a padded batch pays B * L_max^2). Flash attention's
varlen kernel avoids that by running attention per document; this module does the same with
the eager / sdpa kernels: when a layer gets no padding mask, the row is cut where position_ids
restart and each document runs causal attention alone (cost sum(L_i^2)); under sdpa, adjacent
documents of one length run as one batched kernel call, and so do rows cut alike (the same
memory: sdpa's causal kernel builds no scores; one call instead of one per document, on the
GPU fewer launches and in ``memlab estimate`` fewer fake ops). Where the documents
are comes from the batch: memlab's collators compute the rows' ``Segments`` once on the host and
the methods pass them as ``memlab_segments`` (transformers forwards extra keyword arguments down
to the attention function), so no layer reads position_ids back from the device. A call
without ``memlab_segments`` is one document per row; rows that carry a padding mask (ordinary
padded batches) go through transformers' own functions unchanged.

Shared prefixes: a document the segments mark as also seeing a token range ``[a, b)`` before
it (a preference pair's prompt stored once, :class:`memlab.trainer.batch.Segments`) runs its
queries against the keys of ``[a, b)`` followed by its own, with a mask that shows the whole
prefix and its own tokens causally. Its tokens keep the position ids that continue the prefix,
so each gets exactly the attention it has when the prefix and the document are one sequence
(cost ``n * (prefix + n)`` instead of the ``(prefix + n)^2 / 2`` of a second copy of the
prefix). Rows of plain documents take the path above, unchanged.

For flex_attention, :func:`block_mask` builds the same structure as a ``BlockMask`` (passed to
the model as its ``attention_mask``, which transformers then uses as it is).

On CUDA with fp16 / bf16 tensors the documents run in one call of torch's own
variable-length attention (``torch.nn.attention.varlen.varlen_attn``, flash-based; no
flash-attn package), not one kernel per document: :func:`varlen_plan` turns the segments into
cumulative sequence offsets once per batch (cached; the device copy has no host read), and a
document with a shared prefix gets its prefix keys gathered before its own, where flash's
bottom-right-aligned causal mask shows it the whole prefix and its own tokens causally. On the
CPU (and in fp32) the per-document loop above stays the path: exact, tested against
transformers' masks. :func:`varlen_reference` computes what ``varlen_attn`` computes with
sdpa, one document at a time, so the offsets and gathers are tested on the CPU; the CUDA
kernel itself is tested in GPU-marked tests (not run here: no GPU was available).

Registered with transformers' AttentionInterface / AttentionMaskInterface under
``memlab_eager_varlen`` and ``memlab_sdpa_varlen``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from memlab.trainer.batch import Segments

_REGISTERED = False
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
"""What torch's flash-based varlen kernel takes (fp32 stays on the per-document path)."""


class VarlenPlan(NamedTuple):
    """A batch's documents for a variable-length kernel over the flattened ``[rows * width]``
    tokens: query document ``i`` is tokens ``cu_q[i]:cu_q[i+1]``; its keys are
    ``cu_k[i]:cu_k[i+1]`` of the key tokens, which are the flat tokens themselves
    (``k_index`` None: no shared prefix) or the flat tokens gathered by ``k_index`` (each
    document's prefix range, then its own tokens)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    k_index: torch.Tensor | None


@functools.lru_cache(maxsize=4)
def _plan_cpu(segments: Segments, width: int) -> VarlenPlan:
    cu_q, cu_k, index = [0], [0], []
    max_q = max_k = 0
    prefixed = segments.shares_prefixes()
    for r in range(len(segments)):
        base = r * width
        for s, e, prefix in segments.documents(r):
            keys = list(range(base + prefix[0], base + prefix[1])) if prefix else []
            keys += range(base + s, base + e)
            cu_q.append(cu_q[-1] + e - s)
            cu_k.append(cu_k[-1] + len(keys))
            max_q, max_k = max(max_q, e - s), max(max_k, len(keys))
            if prefixed:
                index += keys
    if cu_q[-1] != len(segments) * width:
        raise ValueError(f"the segments cover {cu_q[-1]} tokens, the batch has "
                         f"{len(segments)} x {width}")
    i32 = torch.int32
    return VarlenPlan(torch.tensor(cu_q, dtype=i32), torch.tensor(cu_k, dtype=i32), max_q, max_k,
                      torch.tensor(index, dtype=torch.long) if prefixed else None)


@functools.lru_cache(maxsize=4)
def _plan_on(segments: Segments, width: int, device: torch.device) -> VarlenPlan:
    plan = _plan_cpu(segments, width)
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return VarlenPlan(move(plan.cu_q), move(plan.cu_k), plan.max_q, plan.max_k,
                      None if plan.k_index is None else move(plan.k_index))


def varlen_plan(segments: Segments, width: int, device: torch.device | str = "cpu") -> VarlenPlan:
    """The :class:`VarlenPlan` of rows ``segments`` of ``width`` tokens, on ``device`` (built
    once per batch and device: every layer of a forward reuses it)."""
    return _plan_on(Segments.of(segments), int(width), torch.device(device))


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                     window_size: tuple[int, int] = (-1, 0),
                     enable_gqa: bool = False) -> torch.Tensor:
    """What ``varlen_attn`` computes for causal attention (``window_size=(-1, 0)``: the causal
    mask aligned to the bottom right, a query sees every key up to its own position counted
    from the end), with sdpa one document at a time: ``[T_q, H, D]`` queries, ``[T_k, H_kv,
    D]`` keys and values."""
    if window_size != (-1, 0):
        raise ValueError("varlen_reference implements causal attention only")
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        n, m = qe - qs, ke - ks
        allowed = torch.ones((n, m), dtype=torch.bool, device=q.device).tril(m - n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
            v[ks:ke].transpose(0, 1)[None], attn_mask=allowed, scale=scale,
            enable_gqa=enable_gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     segments: Segments, scaling: float | None = None,
                     kernel: Any = None) -> torch.Tensor:
    """Per-document causal attention of ``[B, H, T, D]`` rows described by ``segments`` in one
    variable-length kernel call (``kernel``: torch's ``varlen_attn`` by default); returns
    ``[B, T, H, D]``, the layout transformers' attention functions return."""
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel
    b, h, t, d = query.shape
    plan = varlen_plan(segments, t, query.device)
    q = query.transpose(1, 2).reshape(b * t, h, d)
    k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)
    if plan.k_index is not None:
        k, v = k.index_select(0, plan.k_index), v.index_select(0, plan.k_index)
    out = kernel(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale=scaling,
                 window_size=(-1, 0), enable_gqa=key.shape[1] != h)
    return out.reshape(b, t, h, d)


def uses_varlen_kernel(query: torch.Tensor, dropout: float) -> bool:
    """Whether :func:`varlen_attention` runs (CUDA, fp16 / bf16, no dropout); else the
    per-document loop."""
    return query.is_cuda and query.dtype in _VARLEN_DTYPES and not dropout


def _causal_mask(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    m = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return m[None, None]


def _prefix_mask(n: int, prefix: int, kind: str, dtype: torch.dtype, device) -> torch.Tensor:
    """``[1, 1, n, prefix + n]``: every query sees the whole prefix and its own document
    causally; boolean (True = attend) for sdpa, additive for eager."""
    own = torch.ones((n, n), dtype=torch.bool, device=device).tril()
    allowed = torch.cat([torch.ones((n, prefix), dtype=torch.bool, device=device), own], dim=1)
    if kind == "sdpa":
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _row_blocks(segments: Segments, rows: int, merge: bool) -> list[tuple[int, int]]:
    """The row ranges that run together: all rows where every row is cut the same way and
    ``merge`` (sdpa), else one row at a time."""
    if merge and all(segments[b] == segments[0] for b in range(1, rows)):
        return [(0, rows)]
    return [(b, b + 1) for b in range(rows)]


def _runs(documents: list[tuple[int, int, tuple[int, int] | None]], merge: bool
          ) -> list[tuple[int, int, int, tuple[int, int] | None]]:
    """``(start, length, count, prefix)``: ``count`` consecutive documents of ``length`` tokens
    from ``start`` that run as one batched call (with ``merge``: adjacent plain documents of
    equal length; a document with a shared prefix always alone)."""
    out: list[tuple[int, int, int, tuple[int, int] | None]] = []
    for s, e, prefix in documents:
        last = out[-1] if out else None
        if (merge and prefix is None and last is not None and last[3] is None
                and last[1] == e - s):
            out[-1] = (last[0], last[1], last[2] + 1, None)
        else:
            out.append((s, e - s, 1, prefix))
    return out


def _stack(t: torch.Tensor, k: int) -> torch.Tensor:
    """``[rows, heads, k * n, dim]`` -> ``[rows * k, heads, n, dim]``: k documents of n tokens
    side by side in each row as k rows (a view where the layout allows)."""
    if k == 1:
        return t
    return t.unflatten(2, (k, t.shape[2] // k)).transpose(1, 2).flatten(0, 1)


def _make(kind: str):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    base = sdpa_attention_forward if kind == "sdpa" else eager_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  position_ids=None, memlab_segments=None, **kwargs):
        q_len, k_len = query.shape[2], key.shape[2]
        if attention_mask is not None or q_len != k_len:  # padded rows, decoding steps
            return base(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, **kwargs)
        if memlab_segments is None:  # one document per row: plain causal attention
            mask = None if kind == "sdpa" else _causal_mask(q_len, query.dtype, query.device)
            return base(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                        **kwargs)
        if len(memlab_segments) != query.shape[0]:
            raise ValueError(f"memlab_segments describes {len(memlab_segments)} rows, the batch "
                             f"has {query.shape[0]}")
        # decided once per batch by the collator: no device read here
        segments = Segments.of(memlab_segments)
        if uses_varlen_kernel(query, dropout):
            return varlen_attention(query, key, value, segments, scaling), None
        outs = []
        for r0, r1 in _row_blocks(segments, query.shape[0], merge=kind == "sdpa"):
            parts = []
            for s, n, k, prefix in _runs(segments.documents(r0), merge=kind == "sdpa"):
                e = s + k * n
                q, ke, v = (_stack(t[r0:r1, :, s:e], k) for t in (query, key, value))
                if prefix is None:
                    mask = None if kind == "sdpa" else _causal_mask(n, query.dtype,
                                                                    query.device)
                else:  # the document also sees the shared prefix [a, z) before it
                    a, z = prefix
                    ke = torch.cat([key[r0:r1, :, a:z], ke], dim=2)
                    v = torch.cat([value[r0:r1, :, a:z], v], dim=2)
                    mask = _prefix_mask(n, z - a, kind, query.dtype, query.device)
                o, _ = base(module, q, ke, v, mask, dropout=dropout, scaling=scaling, **kwargs)
                parts.append(o if k == 1 else o.reshape(r1 - r0, k * n, *o.shape[2:]))
            outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)), None

    return attention


def _make_mask(kind: str):
    from transformers.masking_utils import eager_mask, sdpa_mask

    base = sdpa_mask if kind == "sdpa" else eager_mask

    def mask(*args: Any, **kwargs: Any) -> Any:
        # No padding mask: causal and per-document structure is handled by the attention itself.
        if kwargs.get("attention_mask") is None:
            return None
        return base(*args, **kwargs)

    return mask


def block_mask(segments: Segments, width: int, device) -> Any:
    """flex_attention's ``BlockMask`` for rows described by ``segments``: a token sees the
    earlier tokens of its own document, and all of the prefix range its document also sees."""
    from torch.nn.attention.flex_attention import create_block_mask

    segments = Segments.of(segments)
    rows = len(segments)
    doc = torch.zeros((rows, width), dtype=torch.int32)
    low = torch.zeros((rows, width), dtype=torch.int32)
    high = torch.zeros((rows, width), dtype=torch.int32)
    for r in range(rows):
        for i, (s, e, prefix) in enumerate(segments.documents(r)):
            doc[r, s:e] = i
            if prefix is not None:
                low[r, s:e], high[r, s:e] = prefix
    doc, low, high = doc.to(device), low.to(device), high.to(device)

    def mask_mod(b, h, q, kv):
        own = (doc[b, q] == doc[b, kv]) & (kv <= q)
        return own | ((kv >= low[b, q]) & (kv < high[b, q]))

    return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=width, KV_LEN=width,
                             device=device)


def register() -> None:
    """Idempotently register memlab_{eager,sdpa}_varlen with transformers."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for kind in ("eager", "sdpa"):
        name = f"memlab_{kind}_varlen"
        AttentionInterface.register(name, _make(kind))
        AttentionMaskInterface.register(name, _make_mask(kind))
    _REGISTERED = True
