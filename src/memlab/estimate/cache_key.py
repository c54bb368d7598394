"""FakeTensorMode's dispatch-cache key, the same key computed in a third of the time.

Every op an estimate runs on fake tensors looks its output up in ``FakeTensorMode``'s dispatch
cache (:mod:`torch._subclasses.fake_tensor`), keyed by the op and its arguments flattened into
a list: each fake tensor as its metadata (``extract_tensor_metadata``: dtype, shape, strides,
device, layout, memory format, storage offset and size, autograd and view flags), each other
value with its type. torch builds a ``TensorMetadata`` dataclass per tensor and walks its
fields with ``dataclasses.fields``, a shape and a stride through the generic walk, which made
the key a third of an estimate's time at real size (Qwen2.5-0.5B: 28,000 ops a build).

:func:`prep_args_for_hash` appends exactly what torch's ``_prep_args_for_hash`` appends, in the
same order, for what an estimate's ops take: lists and tuples of strided fake tensors of the
mode (no constant), plain Python values, dtypes, devices, layouts and memory formats. Anything
else (a dict, a ``torch.Size``, a symbolic value, a sparse or foreign tensor, a function) goes
to torch's own walk, which also raises where the op must bypass the cache. The key is the
same, so are the hits, misses and cached outputs (``tests/unit/estimate/test_cache_key.py``
compares the two on every op of a training step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
"""Argument types torch's walk appends as ``type, value``."""
_LENGTHS = [f"length_{n}" for n in range(65)]
_CONTIGUOUS = torch.contiguous_format
_STRIDED = torch.strided


def _length(n: int) -> str:
    return _LENGTHS[n] if n < len(_LENGTHS) else f"length_{n}"


def _tensor(result: list[object], t: Any) -> None:
    """What ``extract_tensor_metadata(t)._flatten_into(result, ...)`` appends for a strided
    tensor without symbolic sizes."""
    shape, stride = t.shape, t.stride()
    ndim = len(shape)
    memory_format: Any = _CONTIGUOUS
    if ndim in (4, 5):  # (suggest_memory_format: channels-last strides are 4- or 5-d)
        memory_format = suggest_memory_format(t)
    if not t.is_contiguous(memory_format=memory_format):
        memory_format = None
    append = result.append
    append(t.dtype)
    append(torch.Size)
    append(_length(ndim))
    for d in shape:
        append(int)
        append(d)
    append(tuple)
    append(_length(ndim))
    for s in stride:
        append(int)
        append(s)
    append(t.device)
    append(_STRIDED)
    append(memory_format)
    append(t.storage_offset())
    append(t.untyped_storage().nbytes())
    append(t.requires_grad)
    append(t.is_quantized)
    append(t.is_conj())
    append(t.is_neg())
    append(t.is_inference())
    append(False)  # is_sparse
    append(None)  # is_coalesced
    append(None)  # dense_dim
    append(None)  # sparse_dim


def prep_args_for_hash(mode: FakeTensorMode, result: list[object], args: Any, state: Any,
                       id_hashed_objects: list[object]) -> None:
    """``FakeTensorMode._prep_args_for_hash``, faster where it can be (module docstring)."""
    kind = type(args)
    if kind is not list and kind is not tuple:
        FakeTensorMode._prep_args_for_hash(mode, result, args, state, id_hashed_objects)
        return
    result.append(kind)
    result.append(_length(len(args)))
    for arg in args:
        tp = type(arg)
        if tp in _PLAIN:
            result.append(tp)
            result.append(arg)
        elif (tp is FakeTensor and arg.fake_mode is mode and arg.constant is None
              and arg.layout is _STRIDED and not arg._has_symbolic_sizes_strides):
            _tensor(result, arg)
        elif tp is list or tp is tuple:
            prep_args_for_hash(mode, result, arg, state, id_hashed_objects)
        else:  # torch's walk of this one argument (an iterator: no type / length entries)
            FakeTensorMode._prep_args_for_hash(mode, result, iter((arg,)), state,
                                               id_hashed_objects)
