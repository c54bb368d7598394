"""``memlab estimate``: predict the peak memory of a configuration before running it, no GPU.

Usage::

    memlab estimate peft=lora method.max_length=2048                   # the table
    memlab estimate model=hf model.name_or_path=Qwen/Qwen2.5-0.5B --card a100-40gb
    memlab estimate model.hidden_size=2048 model.num_layers=16 --budget 24GiB
    memlab estimate model=hf model.name_or_path=./my_model --set num_hidden_layers=8
    memlab estimate --world-size 8 --zero-stage 3 precision=bf16
    memlab estimate -m peft=none,lora packing=none,bfd --budget 24GiB   # a sweep: what fits
    memlab estimate -m 'method.max_length=range(1024,8193,1024)'       # Hydra's sweep grammar
    memlab estimate -m sweep=packing                                   # a ready sweep
    python -m memlab mode=estimate ...                                 # the same

The command line is a run's: every ``key=value`` is a Hydra override composed over memlab's
configs and validated like a run (as a CUDA run with ``--device cuda``), ``-m`` sweeps with
Hydra's own sweeper (comma lists, ``range()``, ``choice()``, ``glob()``, ``sweep=<name>``), and
Hydra's flags (``--cfg job``, ``--config-dir DIR``, ``hydra.run.dir=...``) work as for a run;
options (``--...``) are this command's. The estimate runs one training step of the configured
model and method on fake tensors under the run's memory tracker (see
:mod:`memlab.estimate`) and prints categories x phases, the peak and, with ``--budget`` or
``--card``, a verdict. It writes ``estimate.json`` (atomically) into a Hydra output dir: ``--out``,
else ``hydra.run.dir``, else ``outputs/estimate/<date>/<time>/``. A sweep runs its points one
after another in this process and writes ``<n>/estimate.json`` per point under ``--out`` /
``hydra.sweep.dir`` / ``multirun/estimate/<date>/<time>/``, then ``sweep.json`` and one line per
point. While it runs, stderr shows progress from the start (``hydra/sweeper=progress``,
:mod:`hydra_plugins.memlab_launcher.progress`): a bar of the points' configurations Hydra
composes and checks (minutes for thousands of points), then a bar of the points estimated with
the lowest peak so far, each with its ETA; nothing else per point.

An estimate reads no weights: a hub model (``model=hf model.name_or_path=Qwen/...``) that cannot
be reached (offline, ``HF_HUB_OFFLINE=1``, the hub down, a gated repo) and is not in the local
cache is estimated from memlab's shipped config of that model where there is one (one console
line says so, and the assumptions); otherwise the estimate is invalid, naming the fix
(:func:`model_source`).

Exit status: 0 estimated (whatever the verdict), 1 the estimate failed, 2 invalid command line or
configuration (for a sweep: 0 unless every point failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab.cli.compose import app_argv, compose, parse_command
from memlab.measure.console import printable
from memlab.registry import ConfigErrors

if TYPE_CHECKING:
    from memlab.estimate import EstimateOptions


def build_parser() -> argparse.ArgumentParser:
    from memlab.estimate import CARDS

    p = argparse.ArgumentParser(
        prog="memlab estimate",
        description="Predict peak training memory (categories x phases) on fake tensors.",
        epilog="Every key=value argument is a Hydra override, as for a training run; -m sweeps "
               "with Hydra's sweeper (a=x,y  range(1,4)  choice(a,b)  glob(*)  sweep=<name>); "
               "Hydra's flags (--cfg job, --config-dir DIR, hydra.run.dir=DIR) work as for a run.",
        allow_abbrev=False,
    )
    p.add_argument("--budget", metavar="SIZE",
                   help="memory per device for the verdict, e.g. 24GiB, 80GB, 40960MiB")
    p.add_argument("--card", choices=sorted(CARDS), metavar="CARD",
                   help=f"a GPU: {', '.join(CARDS)} (budget = its memory; implies "
                        "--device cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cpu: byte-exact CPU tracker peak; cuda: the CUDA model (512-byte "
                        "allocator blocks, cuBLAS workspace, foreach AdamW; validated as a "
                        "CUDA run). Default: cuda with --card, else cpu")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="ranks sharing the model (with --zero-stage / --shard)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage: 1 shards optimizer state, 2 + gradients, 3 + parameters")
    p.add_argument("--shard", choices=("none", "ddp", "zero1", "zero2", "zero3", "fsdp"),
                   default=None, help="the same as --zero-stage by name (fsdp = zero3)")
    p.add_argument("--length", type=int, default=None, metavar="N",
                   help="tokens per row of the worst-case batches (default: method.max_length)")
    p.add_argument("--from-data", action="store_true",
                   help="measure the run's own batches (its batch stream over the prepared "
                        "data, every micro-batch of train.steps) instead of the worst case "
                        "the settings allow")
    p.add_argument("--docs-per-row", type=int, default=None, metavar="K",
                   help="documents per packed row (default: the larger estimate of 1 and 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="change a field of the model's HF config (repeatable), e.g. "
                        "--set num_hidden_layers=8")
    p.add_argument("--inexact-masks", action="store_true",
                   help="keep transformers' fake-tensor mask behaviour (measures the "
                        "discrepancy the exact hooks remove)")
    p.add_argument("--every-layer", action="store_true",
                   help="build and measure every decoder layer (the reference) instead of two "
                        "shallow builds extended exactly to the model's depth")
    p.add_argument("--run-first-step", action="store_true",
                   help="track step 0 too instead of creating the optimizer state directly")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where estimate.json goes (the same as hydra.run.dir=DIR, or "
                        "hydra.sweep.dir=DIR with -m; default outputs/estimate/<date>/<time>)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--cards", action="store_true", help="list the known cards and exit")
    return p


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def options_from(args: argparse.Namespace) -> EstimateOptions:
    from memlab.estimate import EstimateOptions, parse_bytes
    from memlab.estimate.options import device_of

    stage = args.zero_stage
    if args.shard is not None:
        named = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[args.shard]
        if stage is not None and stage != named:
            raise ValueError(f"--shard {args.shard} and --zero-stage {stage} disagree")
        stage = named
    if args.world_size < 1:
        raise ValueError("--world-size must be >= 1")
    if args.docs_per_row is not None and args.docs_per_row < 1:
        raise ValueError("--docs-per-row must be >= 1")
    sets = {}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        sets[key] = _value(value)
    return EstimateOptions(
        device=device_of(args.device, args.card), card=args.card,
        budget_bytes=parse_bytes(args.budget) if args.budget else None,
        world_size=args.world_size, zero_stage=stage or 0, length=args.length,
        from_data=args.from_data, docs_per_row=args.docs_per_row,
        exact_masks=not args.inexact_masks, config_overrides=sets,
        run_first_step=args.run_first_step, every_layer=args.every_layer,
    )


def _cards_table() -> str:
    from memlab.estimate import CARDS, CUDA_CONTEXT_BYTES, cublas_workspace_bytes, fmt_bytes

    lines = [f"{'card':<11}{'memory':>11}  {'cuBLAS ws':>9}  name"]
    for key, c in CARDS.items():
        lines.append(f"{key:<11}{fmt_bytes(c['mib'] * 1024**2):>11}  "
                     f"{fmt_bytes(cublas_workspace_bytes(c['sm'])):>9}  {c['name']}")
    lines.append(f"(memory as nvidia-smi reports it; the verdict also counts "
                 f"~{fmt_bytes(CUDA_CONTEXT_BYTES)} of CUDA context)")
    return "\n".join(lines)


class NoModelConfig(ConfigErrors):
    """The model's config cannot be read from anywhere (:func:`model_source`): no point of an
    estimate or a search can be estimated. Its text is one line, ``invalid: ...``."""

    def __str__(self) -> str:
        return f"invalid: {self.errors[0]}"


_SAID: set[str] = set()
"""The shipped-config lines this process has printed (a search says it once)."""


def model_source(cfg) -> tuple[Any, str | None]:
    """``cfg`` (a composed config) as an estimate reads it, and a line to print, or None.

    An estimate needs the model's config.json and no weights: a hub model (``model.name_or_path``
    of ``model=hf``) that cannot be reached and is not cached is read from memlab's shipped
    config of the same model (:func:`memlab.model._files.config_source`); its tokenizer stays
    the hub's (the estimate builds its batch with memlab's own when that cannot load either).
    This is the estimate's difference from a run, passed explicitly: the config it gets names
    the shipped directory; the overrides it records keep the hub name. Raises
    :class:`NoModelConfig` when there is no config to read."""
    from omegaconf import OmegaConf, open_dict

    from memlab.model import _files

    model = cfg.get("model")
    if model is None or model.get("name") != "hf":
        return cfg, None
    name = model.get("name_or_path")
    if not isinstance(name, str) or not name or _files.looks_like_path(name):
        return cfg, None
    try:
        where, note = _files.config_source("model.name_or_path", name, model.get("revision"),
                                           bool(model.get("local_files_only")))
    except _files.ModelFilesError as e:
        raise NoModelConfig([str(e)]) from None
    if note is None:
        return cfg, None
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(cfg):
        cfg.model.tokenizer = cfg.model.tokenizer or name
        cfg.model.name_or_path = where
    return cfg, note


def _say_once(note: str) -> None:
    if note not in _SAID:
        _SAID.add(note)
        print(printable(f"memlab: {note}"), file=sys.stderr, flush=True)


def _with_note(est: dict[str, Any], note: str | None) -> dict[str, Any]:
    if note is not None and est.get("status") == "ok":
        est["assumptions"] = [note, *est.get("assumptions", [])]
    return est


def estimate_one(overrides: list[str], opts, stop_above: int | None = None) -> dict[str, Any]:
    """Compose + estimate one point outside a Hydra app (for library use); a bad configuration
    is an ``invalid`` estimate, but a model whose config cannot be read from anywhere raises
    :class:`NoModelConfig` (no point can be estimated: a search stops there). A hub model
    estimated from memlab's shipped config says so on stderr, once a process. ``stop_above``:
    :func:`memlab.estimate.estimate`'s (stop once the need is known to be larger)."""
    from memlab.estimate import estimate

    try:
        cfg, choices = compose(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's override / compose errors
        if type(e).__module__.split(".")[0] not in ("hydra", "omegaconf") and not isinstance(
                e, ConfigErrors):
            raise
        return {"kind": "estimate", "status": "invalid", "error": str(e),
                "choices": {}, "overrides": list(overrides)}
    cfg, note = model_source(cfg)
    if note is not None:
        _say_once(note)
    return _with_note(estimate(cfg, opts, choices, list(overrides), stop_above=stop_above), note)


SWEEPER = "progress"
"""The sweeper of ``memlab estimate -m`` unless the command line names one: Hydra's basic
sweeper with a progress bar (:mod:`hydra_plugins.memlab_launcher.progress`)."""


def _job(cfg, opts, as_json: bool, done: list[tuple[Path, dict[str, Any], str]],
         ) -> dict[str, Any]:
    """One Hydra job: estimate the composed config, write estimate.json into the job's output
    dir, print the table (a single run) or a line (a sweep point; none under the progress
    bar's sweeper, :data:`SWEEPER`, which counts it). Returns the estimate."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from memlab.estimate import estimate
    from memlab.measure.summary import user_choices, write_atomic

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    choices = user_choices(hc.runtime.choices)
    est: dict[str, Any]
    try:
        plain, note = model_source(plain)
    except NoModelConfig as e:
        est = {"kind": "estimate", "status": "invalid", "error": e.errors[0],
               "choices": choices, "overrides": overrides,
               "options": dataclasses.asdict(opts)}
    else:
        if note is not None:
            _say_once(note)
        est = _with_note(estimate(plain, opts, choices, overrides,
                                  parallel_builds=(os.cpu_count() or 1) > 1), note)
    write_atomic(out / "estimate.json", est)
    done.append((out, est, str(hc.sweep.dir)))
    if hc.mode == RunMode.MULTIRUN:
        peak = est.get("peak_bytes")
        if hc.runtime.choices.get("hydra/sweeper") != SWEEPER:
            print(f"[memlab estimate] #{hc.job.num} {' '.join(overrides)}: {est['status']}"
                  + (f", peak {peak / 2**20:.1f} MiB" if peak is not None else ""), flush=True)
        return est
    print(json.dumps(est, indent=2, default=str) if as_json
          else printable(format_table(est), keep_newlines=True))
    print(f"\nwrote {out / 'estimate.json'}", file=sys.stderr)
    return est


def main(argv: list[str] | None = None) -> int:
    """Run ``memlab estimate``; see the module docstring for the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parsed = parse_command(argv, build_parser(), "memlab estimate")
    if parsed is None:
        return 2
    hydra_args, args, rest = parsed
    if args.cards:
        print(_cards_table())
        return 0
    try:
        opts = options_from(args)
    except ValueError as e:
        print(f"memlab estimate: {e}", file=sys.stderr)
        return 2

    from memlab.cli.app import run_app

    multirun = any(a in ("-m", "--multirun") for a in hydra_args)
    chosen = {a.lstrip("+").split("=", 1)[0] for a in rest if "=" in a}
    sweeper = [f"hydra/sweeper={SWEEPER}"] if multirun and "hydra/sweeper" not in chosen else []
    done: list[tuple[Path, dict[str, Any], str]] = []
    try:
        run_app(lambda cfg: _job(cfg, opts, args.json, done),
                [*hydra_args, *sweeper, *app_argv(rest, "estimate", args.out)],
                prog="memlab estimate")
    except SystemExit as e:  # Hydra reports a bad override / config and exits
        if done or not e.code:
            raise
        return 2
    if not done:  # --cfg, --help, --info: Hydra printed what was asked
        return 0
    if not multirun:
        return {"ok": 0, "invalid": 2}.get(done[0][1]["status"], 1)
    return _finish_sweep(done, args.json)


def _finish_sweep(done: list[tuple[Path, dict[str, Any], str]], as_json: bool) -> int:
    """Mark each point with what varies across the sweep, write ``sweep.json``, print the table."""
    from memlab.measure.summary import write_atomic

    points = [est.get("overrides") or [] for _, est, _ in done]
    varied = _varied(points)
    rows = []
    for (out, est, _), point in zip(done, points):
        est["sweep_point"] = [o for o in point if o in varied]
        write_atomic(out / "estimate.json", est)
        rows.append(est)
    sweep_dir = Path(done[0][2])
    summary = [{k: r.get(k) for k in ("sweep_point", "status", "error", "peak_bytes",
                                      "by_category", "verdict")} for r in rows]
    write_atomic(sweep_dir / "sweep.json", {"kind": "estimate_sweep", "points": summary,
                                            "options": rows[0].get("options")})
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(printable(format_sweep(rows), keep_newlines=True))
    print(f"\nwrote {sweep_dir}/<n>/estimate.json and {sweep_dir / 'sweep.json'}",
          file=sys.stderr)
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def format_table(est: dict[str, Any]) -> str:
    """Categories x phases, the peak, the verdict and the assumptions."""
    from memlab.estimate import ALL_PHASES, PHASES, fmt_bytes
    from memlab.measure.memory import CATEGORIES

    lines = []
    ch = est.get("choices") or {}
    lines.append("memlab estimate: " + " ".join(f"{k}={v}" for k, v in ch.items()))
    if est.get("overrides"):
        lines.append("overrides: " + " ".join(est["overrides"]))
    if est.get("status") != "ok":
        lines.append(f"status: {est.get('status')}  {est.get('error') or ''}")
        return "\n".join(lines)
    m, b = est.get("model") or {}, est.get("batch") or {}
    lines.append(f"model: {m.get('total', 0) / 1e6:.1f}M params ({m.get('trainable', 0) / 1e6:.2f}M "
                 f"trainable)  batch: {b.get('rows')}; tensors "
                 + ", ".join(f"{k}{v}" for k, v in (b.get("shapes") or {}).items()))
    phc = est.get("by_phase_category") or {}
    phases = [ph for ph in ALL_PHASES if ph in PHASES or ph in phc]
    head = ["", *phases, "peak"]
    body = []
    cats = [*CATEGORIES, *(["generation_engine"] if "generation_engine" in est["by_category"]
                           else [])]
    for cat in cats:
        body.append([cat, *(fmt_bytes(phc.get(ph, {}).get(cat)) if ph in phc else "-"
                            for ph in phases), fmt_bytes(est["by_category"].get(cat, 0))])
    body.append(["total", *(fmt_bytes(est["by_phase"].get(ph)) for ph in phases),
                 fmt_bytes(est["peak_bytes"])])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    for r in [head, *body]:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)))
    pa = est.get("peak_at") or {}
    lines.append(f"estimated peak: {fmt_bytes(est['peak_bytes'])} (device={est['device']}, "
                 f"{pa.get('phase')} of step {pa.get('step')}"
                 + (f", {pa['batch']} batch" if pa.get("batch") else "") + ")")
    if est.get("offload"):
        lines.append(f"host memory for offloaded activations: "
                     f"{fmt_bytes(est['offload'].get('host_peak_bytes'))}")
    v = est.get("verdict")
    if v:
        where = est["card"]["key"] if est.get("card") else fmt_bytes(v["budget_bytes"])
        lines.append(f"verdict vs {where}: {v['text']}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in est.get("assumptions", [])]
    e = est.get("estimator") or {}
    if e:
        lines.append(f"(estimated in {e.get('wall_s', 0):.1f} s, max RSS "
                     f"{fmt_bytes(e.get('max_rss_bytes'))})")
    return "\n".join(lines)


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """One line per estimate of a sweep: what was varied, the peak, the verdict."""
    from memlab.estimate import fmt_bytes

    varied: list[str] = []
    for est in rows:
        for o in est.get("sweep_point", []):
            k = o.split("=", 1)[0]
            if k not in varied:
                varied.append(k)
    head = [*varied, "peak", "dominant", "verdict"]
    body = []
    for est in rows:
        point = dict(o.split("=", 1) for o in est.get("sweep_point", []))
        if est.get("status") != "ok":
            body.append([*(point.get(k, "") for k in varied), "-", "-",
                         f"{est.get('status')}: {(est.get('error') or '').splitlines()[-1][:60]}"])
            continue
        cats = est["by_category"]
        top = max(cats, key=cats.__getitem__)
        v = est.get("verdict")
        body.append([*(point.get(k, "") for k in varied), fmt_bytes(est["peak_bytes"]), top,
                     v["text"] if v else "-"])
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(widths[i]) for i, c in enumerate(r))
                     for r in [head, *body])


def _varied(points: list[list[str]]) -> set[str]:
    """Overrides that differ between sweep points (the columns of the sweep table)."""
    if len(points) <= 1:
        return set(points[0]) if points else set()
    return {o for p in points for o in p if not all(o in q for q in points)}


if __name__ == "__main__":
    sys.exit(main())
