"""Per-document attention for eager and sdpa ("varlen" without flash-attn).

Transformers isolates the documents of a packed / padding-free row on eager and sdpa with one
block-diagonal [N, N] mask over the whole row: attention then costs N^2 over the row's total
length N, more than the padding it removed (a padded batch pays B * L_max^2). Flash attention's
varlen kernel avoids that by running attention per document; this module does the same with
the eager / sdpa kernels: when a layer gets no padding mask, the row is cut where position_ids
restart and each document runs causal attention alone (cost sum(L_i^2)). Where the documents
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

Registered with transformers' AttentionInterface / AttentionMaskInterface under
``memlab_eager_varlen`` and ``memlab_sdpa_varlen``.
"""

from __future__ import annotations

from typing import Any

import torch

from memlab.trainer.batch import Segments

_REGISTERED = False


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
        outs = []
        for b in range(query.shape[0]):
            parts = []
            for s, e, prefix in segments.documents(b):
                q = query[b : b + 1, :, s:e]
                k, v = key[b : b + 1, :, s:e], value[b : b + 1, :, s:e]
                if prefix is None:
                    mask = None if kind == "sdpa" else _causal_mask(e - s, query.dtype,
                                                                    query.device)
                else:  # the document also sees the shared prefix [a, z) before it
                    a, z = prefix
                    k = torch.cat([key[b : b + 1, :, a:z], k], dim=2)
                    v = torch.cat([value[b : b + 1, :, a:z], v], dim=2)
                    mask = _prefix_mask(e - s, z - a, kind, query.dtype, query.device)
                o, _ = base(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
                parts.append(o)
            outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)), None

    return attention


def _make_mask(kind: str):
    from transformers.masking_utils import eager_mask, sdpa_mask

    base = sdpa_mask if kind == "sdpa" else eager_mask

    def mask(*args, attention_mask=None, **kwargs):
        # No padding mask: causal and per-document structure is handled by the attention itself.
        if attention_mask is None:
            return None
        return base(*args, attention_mask=attention_mask, **kwargs)

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
