"""summary.json: atomic writes, flattening for loggers, the end-of-run table, environment; the
names shared by every view of a run (the user's group choices, short labels of what varies)."""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MiB = 1024**2


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write ``text`` to a temp file in the same dir, fsync, then rename over ``path``.

    A reader never sees half a file, and a symbolic link planted at ``path`` is replaced, never
    followed: no write of memlab's lands outside its directory. The file gets the mode a plain
    ``open(path, "w")`` would give (0644 under the usual umask 022), not the temp file's
    private 0600: colleagues on a shared cluster read the results."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise


def write_atomic(path: Path | str, obj: Any) -> None:
    """``obj`` as JSON, written by :func:`write_text_atomic` (atomic, links not followed)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str))


def unlink_link(path: Path | str) -> None:
    """Remove a symbolic link at ``path`` (a file a library is about to write there, which would
    follow it out of its directory); a real file or nothing there is left alone."""
    if os.path.islink(path):
        os.unlink(path)


FALLBACK_ENV = "MEMLAB_FALLBACK_DIR"
"""Where summaries go first when their own directory cannot be written (default: the temp dir's
``memlab-unsaved/``, then ``~/.memlab/unsaved/``)."""

RECORD_ID_ENV = "MEMLAB_RECORD_ID"
"""The id a sweep's launcher gives a job (its record carries it as ``job.record_id``): the only
way a record at a fallback path is taken for that job's."""


def _private(d: str, create: bool) -> bool:
    """Directory ``d`` is this user's alone (created so when ``create``): owned by this user,
    no access for group or others, not a link. The shared temp dir's fallback place must be,
    or anyone could plant a record there for a job that wrote none (or read what a job wrote);
    one that is not is skipped."""
    if create:
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError:
            return False
    try:
        st = os.lstat(d)
    except OSError:
        return False
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    if st.st_mode & 0o077:
        try:
            os.chmod(d, 0o700)  # ours, made with a looser umask by an older memlab
        except OSError:
            return False
    return True


def fallback_name(path: Path | str) -> str:
    """The file name, in a fallback place, of a record meant for ``path``."""
    full = os.path.abspath(str(path))
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", full.strip("/"))
    if len(name) > 200:  # file names have a limit; keep the end (the run's own dirs) + a hash
        import hashlib

        name = hashlib.sha1(full.encode()).hexdigest()[:12] + "_" + name[-180:]
    return name


def fallback_paths(path: Path | str, create: bool = False) -> list[Path]:
    """The places, in order, for a record meant for ``path`` that cannot be written there; the
    file is named after the whole path it was meant for, so records of different runs never
    collide and a launcher finds its job's record again. ``$MEMLAB_FALLBACK_DIR`` is the user's
    choice, taken as it is; the temp dir's ``memlab-unsaved/`` and ``~/.memlab/unsaved/`` are
    used only where they are private to this user (:func:`_private`; ``create``: make them so).
    Records written there keep the run dir's umask-given mode; only their directory is
    private."""
    name = fallback_name(path)
    dirs = [os.environ.get(FALLBACK_ENV)] + [
        d for d in (os.path.join(tempfile.gettempdir(), "memlab-unsaved"),
                    os.path.join(os.path.expanduser("~"), ".memlab", "unsaved"))
        if _private(d, create)]
    return [Path(d) / name for d in dirs if d]


def write_summary(path: Path | str, obj: dict[str, Any]) -> tuple[Path, str | None]:
    """:func:`write_atomic` ``obj`` to ``path``; when that fails (the run dir is unwritable, gone,
    full...), to the first of :func:`fallback_paths` that works, with ``obj["write_error"]``
    naming both. Returns ``(where it was written, the error or None)``; raises the first
    OSError only when nothing could be written anywhere."""
    path = Path(path)
    try:
        write_atomic(path, obj)
        return path, None
    except OSError as first:
        error = first
    for alt in fallback_paths(path, create=True):
        obj["write_error"] = (f"could not write {path} ({type(error).__name__}: {error}); "
                              f"this record was written to {alt} instead")
        try:
            write_atomic(alt, obj)
            return alt, obj["write_error"]
        except OSError:
            continue
    obj.pop("write_error", None)
    raise error


def record_id_of(record: Any) -> str | None:
    job = record.get("job") if isinstance(record, dict) else None
    return job.get("record_id") if isinstance(job, dict) else None


def read_summary(path: Path | str, record_id: str | None = None) -> dict[str, Any] | None:
    """The record written for ``path``; None when there is none or it cannot be read. With
    ``record_id`` (the id the job was given, ``job.record_id`` in its record), a record at
    ``path`` or at one of its fallback paths, and only one that carries that id: a stale record
    of an earlier run, or one planted there, is never taken for this job's. Without it, the
    record at ``path`` only."""
    places = [Path(path)] + (fallback_paths(path) if record_id else [])
    for p in places:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (record_id is None or record_id_of(data) == record_id):
            return data
    return None


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'memory': {'peak_bytes': 1}} -> {'memory/peak_bytes': 1} (lists are left out).

    The W&B run summary is this, written with one ``run.summary.update``. Handing W&B the nested
    dict instead would name the keys ``memory.peak_bytes`` (W&B nests summaries with dots), not
    the ``memory/peak_bytes`` the per-step metrics and the W&B views use; and
    ``pandas.json_normalize(sep="/")``, which flattens alike, is in the report extra only."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif not isinstance(v, list):
            out[key] = v
    return out


NOT_MEASURED = ("config", "choices", "overrides", "job", "run_dir", "versions", "schema_version",
                "rank")
"""summary.json's entries that describe the job rather than measure it: a logger's config (and
W&B's own run fields: group, name, tags) holds them, not its run summary."""

MEASURED = ("status", "error", "wall_time_s", "memory", "throughput", "data", "train", "eval",
            "profile")
"""summary.json's sections that hold measurements (how the job ended, and what it measured).
Every other section (``logger``, ``device``, ``resolved``, ``resume``, ``distributed``...) is
bookkeeping: a logger's run summary has it under ``meta/``."""

META_KEYS = ("memory/device", "memory/source", "memory/distributed", "throughput/note",
             "data/hollow_warning", "data/hollow_groups_warning",
             "data/chat_template/training_template", "train/checkpoint", "eval/source",
             "eval/metric", "eval/every", "eval/batch_size", "eval/batch_size_asked",
             "eval/batch_note", "eval/greater_is_better", "eval/best/checkpoint",
             "eval/stopped_early/reason", "profile/time")
"""Keys (and sub-trees) of the measured sections that say where a measurement came from or how
it was set up (a path, a note, a setting): under ``meta/`` too."""

LOGGED_PREFIXES = (*MEASURED, "meta")
"""Every top-level name of a logger's run summary (:func:`logged_summary`)."""


def logged_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """What a logger's run summary holds of summary.json: its measurements, flattened with ``/``
    (:func:`flatten`: ``memory/peak_bytes``, ``eval/final/loss``), and its bookkeeping (every
    section but :data:`MEASURED`; :data:`META_KEYS`) under one ``meta/`` prefix
    (``meta/logger/id``, ``meta/device/type``, ``meta/eval/source``), so that a runs table's
    columns outside ``meta/`` are measurements. What describes the job (:data:`NOT_MEASURED`)
    is the logger's config, not its summary."""
    flat = flatten({k: v for k, v in summary.items() if k not in NOT_MEASURED})
    out: dict[str, Any] = {}
    for key, value in flat.items():
        meta = key.split("/", 1)[0] not in MEASURED or any(
            key == m or key.startswith(m + "/") for m in META_KEYS)
        out[f"meta/{key}" if meta else key] = value
    return out


def user_choices(choices: Mapping[Any, Any]) -> dict[str, str]:
    """The group choices a user made, from Hydra's ``runtime.choices``: top-level groups only.

    Left out: Hydra's own groups (``hydra/launcher``...), unselected optional groups (``None``)
    and nested helper groups of the config tree (``debug/data@_global_``: the slice
    ``debug=smoke`` takes of each data source), which are implied by the top-level choices."""
    return {str(k): str(v) for k, v in choices.items()
            if v is not None and "/" not in str(k) and "@" not in str(k)}


def short_label(params: Iterable[tuple[str, Any]], sep: str = ",") -> str:
    """``[("peft", "lora"), ("train.gradient_checkpointing", False)]`` ->
    ``"peft=lora,gradient_checkpointing=false"``: each key by its last dotted part (the whole key
    where two last parts would collide), values as Hydra writes them. Names a run or a plot point
    by what varies in its sweep."""
    items = [(str(k), v) for k, v in params]
    last = [k.rsplit(".", 1)[-1] for k, _ in items]
    parts = []
    for (key, value), tail in zip(items, last):
        name = tail if last.count(tail) == 1 else key
        if isinstance(value, bool):
            value = str(value).lower()
        elif value is None:
            value = "null"
        parts.append(f"{name}={value}")
    return sep.join(parts)


def parse_bytes(text: str) -> int:
    """'24GiB' / '24G' (GiB) / '24GB' (10^9) / '512MiB' / '1.5T' / plain bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 24GiB, 80GB, 512MiB)")
    num, unit, i, b = m.groups()
    power = " kmgt".index(unit or " ")
    base = 1000 if (b and not i and unit) else 1024
    return int(float(num) * base**power)


def versions() -> dict[str, str]:
    """Installed versions (read from package metadata: no heavy imports)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("memlab", "torch", "transformers", "peft", "datasets", "accelerate",
                 "hydra-core"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def device_info(device: str) -> dict[str, Any]:
    import torch

    from memlab.config import CPU_BF16_ENV

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    info = _device_info(device, torch)
    info["visible_devices"] = visible
    if os.environ.get(CPU_BF16_ENV):  # the CPU's bf16 kernels taken as said, not detected
        info["cpu_bf16_env"] = os.environ[CPU_BF16_ENV]
    return info


def _device_info(device: str, torch) -> dict[str, Any]:
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        p = torch.cuda.get_device_properties(idx)
        return {"type": "cuda", "name": p.name, "count": torch.cuda.device_count(),
                "total_memory_bytes": int(p.total_memory),
                "capability": f"{p.major}.{p.minor}"}
    return {"type": "cpu", "name": platform.processor() or platform.machine(),
            "count": 1, "threads": torch.get_num_threads()}


def data_notes(d: dict[str, Any]) -> list[str]:
    """What happened to the rows, from a summary's ``data`` section: rows rendered with a
    training template, skipped as unsplittable, hollow (no training signal), converted on load,
    a mixture's sources."""
    notes = []
    if d.get("chat_template"):
        ct = d["chat_template"]
        notes.append(f"chat template: memlab's {ct['training_template']} training template "
                     f"rendered {ct['rows']} rows the stock one cannot split")
    if d.get("unsplittable"):
        un = d["unsplittable"]
        notes.append(f"skipped: {un['skipped']} rows the chat template cannot split (first: "
                     f"{'; '.join(un['first'])}): {un['reason']}")
    if d.get("hollow_warning"):
        notes.append(f"warning: {d['hollow_warning']}")
    elif d.get("hollow_rows"):
        notes.append(f"hollow: {d['hollow_rows']} examples carry no training signal")
    if d.get("hollow_groups_warning"):
        notes.append(f"warning: {d['hollow_groups_warning']}")
    if d.get("converted"):
        notes.append("converted on load: " + ", ".join(
            f"{k} ({v} rows)" for k, v in d["converted"].items()))
    if d.get("sources"):
        notes.append("mixture: " + ", ".join(f"{k} {v['rows']} rows"
                                             for k, v in d["sources"].items()))
    return notes


def format_table(s: dict[str, Any]) -> str:
    """Human-readable end-of-run table."""
    lines = []
    ch = user_choices(s.get("choices") or {})
    resolved = s.get("resolved") or {}
    lines.append("memlab run: " + " ".join(
        f"{k}={v}" + (f" ({resolved[k]})" if k in resolved else "") for k, v in ch.items()))
    lines.append(f"status: {s.get('status')}" + (f"  ({s['error']})" if s.get("error") else ""))
    m = s.get("memory") or {}
    if m.get("peak_bytes") is not None:
        lines.append(f"peak memory ({m.get('source')}, {m.get('device')}): "
                     f"{m['peak_bytes'] / MiB:10.2f} MiB")
        for k, v in (m.get("by_category") or {}).items():
            share = v / m["peak_bytes"] if m["peak_bytes"] else 0.0
            lines.append(f"  {k:<12}{v / MiB:12.2f} MiB  {share:6.1%}")
        ph = m.get("by_phase") or {}
        if ph:
            lines.append("  by phase:   " + "  ".join(f"{k} {v / MiB:.2f}" for k, v in ph.items())
                         + " MiB")
        if m.get("cuda"):
            lines.append(f"  cuda reserved peak: {m['cuda']['peak_reserved_bytes'] / MiB:.2f} MiB")
    t = s.get("throughput") or {}
    if t.get("tokens_per_s") is not None:
        lines.append(f"throughput: {t['tokens_per_s']:.1f} tokens/s (non-padding), "
                     f"{t.get('step_time_s', 0):.3f} s/step")
    d = s.get("data") or {}
    if d:
        fill = d.get("fill_ratio")
        lines.append(
            f"data: {d.get('examples')} examples -> {d.get('rows')} rows, padding "
            f"{(d.get('padding_fraction') or 0):.1%}, tokens dropped {d.get('tokens_dropped')}"
            + (f", fill {fill:.3f}" if fill is not None else "")
        )
        lines += [f"  {note}" for note in data_notes(d)]
    tr = s.get("train") or {}
    if tr:
        steps, planned = tr.get("steps"), tr.get("steps_planned")
        done = f"{steps} of {planned}" if planned not in (None, steps) else f"{steps}"
        loss = (f", final loss {tr['final_loss']:.4f}" if tr.get("final_loss") is not None
                else "")
        nan = f", non-finite loss at step {tr['nan_step']}" if tr.get("nan_step") else ""
        lines.append(f"train: {done} steps{loss}{nan}")
    ev = s.get("eval") or {}
    if ev.get("history"):
        final, best = ev.get("final") or {}, ev.get("best") or {}
        metric = ev.get("metric") or "loss"
        shown = ", ".join(f"{k} {v:.4f}" for k, v in final.items()
                          if k != "step" and isinstance(v, (int, float)))
        line = (f"eval: {shown} at step {final.get('step')} ({len(ev['history'])} evals on "
                f"{ev.get('examples')} held-out examples, {ev.get('seconds', 0):.1f} s)")
        if best and best.get("step") != final.get("step"):
            line += f"; best {metric} {best['value']:.4f} at step {best['step']}"
        lines.append(line)
        if best.get("checkpoint"):
            lines.append(f"  best checkpoint: {best['checkpoint']}")
        if ev.get("stopped_early"):
            lines.append(f"  stopped early at step {ev['stopped_early']['step']}: "
                         f"{ev['stopped_early']['reason']}")
    for err in (s.get("checkpoint") or {}).get("errors") or []:
        lines.append(f"checkpoint NOT written: {err}")
    if s.get("write_error"):
        lines.append(f"summary: {s['write_error']}")
    width = max(len(x) for x in lines)
    bar = "=" * min(width, 100)
    return "\n".join([bar, *lines, bar])
