"""Files hashed while they are written: :class:`HashingFile` (a binary file whose every written
byte also goes through sha256) and :func:`write_safetensors` (the safetensors format, written
tensor by tensor through one: the checkpoint's own files get their content hash without being
read back, and no second copy of the tensors is made).

The safetensors format: 8 bytes (little-endian u64) giving the header's length, the header (JSON:
``__metadata__`` first, then each tensor's ``dtype``, ``shape`` and ``data_offsets``, padded with
spaces to a multiple of 8 bytes), then the tensors' bytes back to back. Tensors are laid out as
``safetensors.torch.save_file`` lays them out (by dtype, widest first, then by name), so the file
is byte-identical to its (a test checks every dtype torch can store); unlike it, tensors that
share memory need no copy.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from types import TracebackType

import torch

_DTYPES: dict[torch.dtype, str] = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64",
    torch.float32: "F32", torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16",
    torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL"}
"""safetensors' name of each dtype, in the order its writer lays tensors out (safetensors 0.8's
``Dtype`` enum, largest first)."""
_RANK = {name: i for i, name in enumerate(_DTYPES.values())}


class HashingFile:
    """A binary file opened for writing whose bytes are hashed (sha256) as they are written;
    what ``torch.save`` and :func:`write_safetensors` write into (``write`` and ``flush``;
    no ``fileno``, so that ``torch.save`` writes through ``write``)."""

    def __init__(self, path: Path | str):
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close() / the with block
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:  # a bytes-like object
        self._sha.update(data)
        n = self._file.write(data)
        self.size += n
        return n

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def hexdigest(self) -> str:
        """The sha256 of everything written so far."""
        return self._sha.hexdigest()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
           ) -> tuple[bytes, list[str]]:
    """The first bytes of the safetensors file of ``tensors`` (length and padded JSON header)
    and the tensors' names in the order their bytes follow."""
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"safetensors cannot store {name!r}: dtype {t.dtype}")
    order = sorted(tensors, key=lambda n: (_RANK[_DTYPES[tensors[n].dtype]], n))
    head: dict[str, object] = {}
    if metadata:
        head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        head[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors(path: Path | str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` as the safetensors file ``path``, one tensor at a time (each copied to
    the host and made contiguous on its own: the memory needed beyond the tensors is one tensor
    at most); returns the file's sha256, computed from the bytes as they were written."""
    first, order = header(tensors, metadata)
    with HashingFile(path) as f:
        f.write(first)
        for name in order:
            t = tensors[name].detach()
            if t.numel() == 0:
                continue
            t = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(t.numpy().data)  # the tensor's own bytes, no copy
        return f.hexdigest()
