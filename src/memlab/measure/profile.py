"""Where one training step's time goes: ``measure.profile_step=N`` runs step N under
``torch.profiler`` and writes, into the run dir,

- ``profile/trace.json``: the Chrome / Perfetto trace of the step (open in ``ui.perfetto.dev``);
- ``profile/ops.txt``: torch's operator table, sorted by self time;
- ``summary.json["profile"]``: the step's wall time, the time of each phase (forward,
  backward, optimizer: the loop labels them with ``record_function``), and every event's self
  time in :data:`BUCKETS` (matmuls, attention, softmax + loss, optimizer kernels, copies and
  indexing, other tensor ops, and the Python / dispatcher / autograd time between kernels),
  with the top operators.

Self time: an event's time minus its children's, so the buckets add up to the profiled
thread's busy time without double counting (a CPU run's backward runs on the calling thread).
On CUDA the buckets use the kernels' self device time and the phases stay host-side
(not verified on a GPU here). The profiled step is left out of tokens/s and runs without the
memory tracker (whose dispatch mode would be most of what it sees).

:func:`summarize` takes any profiler's ``key_averages()``, so a benchmark can profile another
trainer's step the same way (``benchmarks/techniques.py --profile`` does TRL's).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from memlab.measure.summary import unlink_link, write_text_atomic

PHASE_PREFIX = "memlab."
"""``record_function`` label of a loop phase: ``memlab.forward`` / ``.backward`` / ..."""

BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                "aten::_addmm_activation", "aten::addmv", "aten::mv", "aten::dot")),
    ("attention", ("aten::_scaled_dot_product", "aten::_flash_attention",
                   "aten::_efficient_attention", "aten::_cudnn_attention",
                   "aten::_varlen_attn", "flex_attention")),
    ("softmax + loss", ("aten::_log_softmax", "aten::log_softmax", "aten::_softmax",
                        "aten::softmax", "aten::nll_loss", "aten::cross_entropy")),
    ("optimizer", ("aten::_foreach_", "aten::_fused_adam", "aten::addcdiv", "aten::lerp",
                   "aten::_fused_sgd")),
    ("copies + indexing", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous",
                           "aten::cat", "aten::index", "aten::gather", "aten::scatter",
                           "aten::embedding", "aten::fill_", "aten::zero_", "aten::zeros",
                           "aten::empty", "aten::ones", "aten::full", "aten::masked_fill",
                           "aten::where", "aten::_unsafe_view", "aten::resize_",
                           "aten::nonzero", "aten::arange", "aten::stack", "aten::repeat")),
)
"""(bucket, name prefixes) in order of precedence; any other ``aten::`` op is ``tensor ops``
(elementwise, norms, reductions, views), anything else (autograd nodes, ``record_function``
labels, Python, the profiler's own markers) is ``overhead``."""
ORDER = (*(b for b, _ in BUCKETS), "tensor ops", "overhead")


def bucket_of(name: str) -> str:
    """The :data:`BUCKETS` bucket of an operator name."""
    for bucket, prefixes in BUCKETS:
        if name.startswith(prefixes):
            return bucket
    return "tensor ops" if name.startswith("aten::") else "overhead"


def _self_s(evt: Any, device: bool) -> float:
    us = evt.self_device_time_total if device else evt.self_cpu_time_total
    return float(us) / 1e6


def summarize(events: Any, wall_s: float, *, device: bool = False, top: int = 12
              ) -> dict[str, Any]:
    """A profiled step's summary from ``profiler.key_averages()``: wall time, phase times
    (``record_function`` labels starting with :data:`PHASE_PREFIX`), self time per bucket
    (seconds and share of the summed self time) and the ``top`` operators by self time.
    ``device``: bucket the kernels' self device time (CUDA) instead of host time."""
    buckets = dict.fromkeys(ORDER, 0.0)
    phases: dict[str, float] = {}
    ops = []
    for evt in events:
        name = evt.key
        if name.startswith(PHASE_PREFIX):
            phases[name[len(PHASE_PREFIX):]] = float(evt.cpu_time_total) / 1e6
        if name.startswith("ProfilerStep"):
            continue
        s = _self_s(evt, device)
        buckets[bucket_of(name)] += s
        ops.append((s, name, int(evt.count)))
    total = sum(buckets.values())
    ops.sort(reverse=True)
    return {
        "wall_s": wall_s,
        "self_s": total,
        "time": "device" if device else "host",
        "phases_s": phases,
        "buckets": {b: {"s": s, "share": s / total if total else 0.0}
                    for b, s in buckets.items()},
        "top_ops": [{"op": n, "calls": c, "self_s": s, "share": s / total if total else 0.0}
                    for s, n, c in ops[:top]],
    }


@contextlib.contextmanager
def profiled(out_dir: Path, *, cuda: bool = False) -> Iterator[dict[str, Any]]:
    """Profile the block; on exit write ``trace.json`` and ``ops.txt`` under ``out_dir`` and
    fill the yielded dict with :func:`summarize`'s result (``cuda``: kernels' device time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    result: dict[str, Any] = {}
    with profile(activities=activities, record_shapes=False) as prof:
        t0 = time.perf_counter()
        yield result
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    unlink_link(out_dir / "trace.json")  # a link there is replaced, never followed
    prof.export_chrome_trace(str(out_dir / "trace.json"))
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    write_text_atomic(out_dir / "ops.txt", events.table(sort_by=sort, row_limit=60) + "\n")
    result.update(summarize(events, wall, device=cuda))
    write_text_atomic(out_dir / "summary.json", json.dumps(result, indent=2) + "\n")


def phase_label(name: str, on: bool) -> contextlib.AbstractContextManager:
    """``record_function`` for a loop phase while a step is profiled, else nothing."""
    if not on:
        return contextlib.nullcontext()
    return torch.profiler.record_function(PHASE_PREFIX + name)


def table(profiles: dict[str, dict[str, Any]]) -> str:
    """Markdown: one column per profiled step (its label -> :func:`summarize` result), rows =
    wall time, phases, buckets (ms and share)."""
    names = list(profiles)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(profiles[n]) for n in names) + " |")

    row("step wall (ms)", lambda p: f"{1e3 * p['wall_s']:.1f}")
    for ph in ("forward", "backward", "optimizer"):
        if any(ph in p["phases_s"] for p in profiles.values()):
            row(f"phase: {ph} (ms)", lambda p, ph=ph: (f"{1e3 * p['phases_s'][ph]:.1f}"
                                                       if ph in p["phases_s"] else "-"))
    for b in ORDER:
        row(f"{b} (ms, share)", lambda p, b=b: (f"{1e3 * p['buckets'][b]['s']:.1f} "
                                                 f"({100 * p['buckets'][b]['share']:.0f}%)"))
    return "\n".join(lines) + "\n"
