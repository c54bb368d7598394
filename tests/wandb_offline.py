"""Read an offline W&B run back: the records of its ``run-<id>.wandb`` file, and the run summary
and history they amount to.

wandb 0.31 ships no Python reader for its transaction log (its core is Go), so this reads the
file's framing - LevelDB's log format under a ``:W&B`` header: 32 KiB blocks of records, each a
7-byte header (CRC-32 of type + data, length, type full/first/middle/last) - and decodes every
record with wandb's own protobuf classes (``wandb.proto.wandb_internal_pb2.Record``). The run
summary is what replaying the summary records in order leaves (W&B's core writes one after each
history row and one per ``run.summary`` update; the last value of a key wins)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, decoded (CRCs checked)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B transaction log"
    pos, chunks, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + HEADER + length > len(data):  # the writer is still at it
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"CRC at {pos}"
        pos += HEADER + length
        if kind == FULL:
            chunks.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            chunks.append(pending + chunk)
    out = []
    for raw in chunks:
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def run_file(run_dir: Path) -> Path:
    """The one ``offline-run-*/run-*.wandb`` under ``run_dir``."""
    found = sorted(Path(run_dir).rglob("offline-run-*/run-*.wandb"))
    assert len(found) == 1, found
    return found[0]


def read_run(path: Path, wait_s: float = 60.0) -> dict[str, Any]:
    """``{"run": the run record, "summary": {key: value}, "history": [{key: value}]}``.

    W&B's core writes the file in its own process, after ``run.finish()`` returns: this waits
    (up to ``wait_s``) for the run's ``exit`` record, the last one it writes."""
    import time

    deadline = time.monotonic() + wait_s
    recs = records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in recs):
        assert time.monotonic() < deadline, f"{path}: no exit record after {wait_s} s"
        time.sleep(0.2)
        recs = records(path)
    run, summary, history = None, {}, []
    for rec in recs:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
        elif kind == "summary":
            for item in rec.summary.update:
                summary[_key(item)] = json.loads(item.value_json)
            for item in rec.summary.remove:
                summary.pop(_key(item), None)
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
    return {"run": run, "summary": summary, "history": history}
