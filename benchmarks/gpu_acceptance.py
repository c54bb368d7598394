"""Certify memlab's GPU-only paths on a CUDA machine with one command (issue 28).

Every case is a real run of ``python -m memlab`` in a fresh process on the GPU (its loss curve
and the allocator's peaks, ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, from
its summary.json), checked against a reference case of its piece (the same loss within a stated
tolerance, a lower peak where the technique exists to lower it), plus ``memlab estimate
--device cuda --from-data`` of the same configuration against those peaks. Pieces, one per
group of techniques, each under 9 minutes on one H100 (``--list``):

    python benchmarks/gpu_acceptance.py                  # every piece not done yet (resumable)
    python benchmarks/gpu_acceptance.py --only liger,qlora
    python benchmarks/gpu_acceptance.py --dry-run        # any machine: compose + validate all
    python benchmarks/gpu_acceptance.py --fetch-wheels .whl   # where pip reaches PyPI
    python benchmarks/gpu_acceptance.py --wheels .whl    # on the GPU machine: install, then run
    python benchmarks/gpu_acceptance.py --wheels .whl --dry-run   # there: check what was carried

A machine without a package index gets the Python 3.12 wheels of :data:`WHEELS` (memlab's own
requirements it may lack, Liger, bitsandbytes, TRL: ~45 MB) from ``--fetch-wheels`` and
installs them with ``--wheels`` (``pip install --no-index --target``); a case whose package is
missing there (flash-attn, vLLM, the kernels backend's hub download...) reads "not installed",
one that needs a newer torch says so, and the distributed cases need 2+ GPUs. Results: one JSON
and a Markdown table (``--out``, default benchmarks/results/gpu_acceptance.{json,md}), rewritten
after every case: a second call skips the cases already there (``--redo`` runs them again).
The docs' "verified on" table (docs/gpu.md) is generated from that JSON. On a machine without
CUDA the command refuses to run (``--dry-run`` checks every case against a hypothetical CUDA
machine instead; the test suite runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
SITE = Path("/tmp/memlab-gpu-site")
WHEEL_BUDGET_MIB = 52
"""The wheels that travel with the repository (~8 MB) in one 64 MiB call."""
WHEELS = {  # what the GPU machine's Python 3.12 lacks (torch, transformers, peft, accelerate,
    # pyarrow, pandas, huggingface-hub, xxhash are there)
    "hydra-core": "1.3.2", "omegaconf": "2.3.0", "antlr4-python3-runtime": "4.9.3",
    "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19", "fsspec": "2026.9.0",
    "liger-kernel": "0.8.5", "trl": "1.16.0", "bitsandbytes": "0.50.2",
}
SDIST_ONLY = {"antlr4-python3-runtime"}
VERSIONS = ("torch", "triton", "transformers", "peft", "accelerate", "datasets", "hydra-core",
            "liger-kernel", "bitsandbytes", "flash-attn", "kernels", "vllm", "trl")


@dataclass(frozen=True)
class Case:
    """One run, checked against another case of its piece."""

    name: str
    overrides: tuple[str, ...]
    what: str = ""
    needs: tuple[str, ...] = ()
    """Modules that must import on the GPU machine (``torch.*``: a newer torch)."""
    ref: str | None = None
    """The case whose loss curve this one must give (within ``rel``)."""
    rel: float = 1e-3
    lower_than: str | None = None
    """The case whose allocator peak this one must stay below."""
    gpus: int = 1


@dataclass(frozen=True)
class Piece:
    name: str
    what: str
    minutes: float
    """Its time on one H100 with the carried wheels (estimated, not yet measured: flash-attn,
    vLLM and a second GPU absent, so their cases end at once; the limit is 9)."""
    cases: tuple[Case, ...] = ()
    command: tuple[str, ...] = ()
    """A script instead of cases (``{out}``: the output dir)."""


SMALL = ("train.steps=4", "train.progress=false", "measure.memory_steps=all", "logger=none",
         "model.hidden_size=256", "model.intermediate_size=768", "model.num_layers=4",
         "data.n_examples=64", "method.max_length=512", "train.batch_size=4")
BF16 = ("precision=bf16_mixed",)
PACKED, PADDED = ("packing=bfd",), ("packing=none", "method.padding_mask=always")
BACKENDS = {"eager": (), "sdpa": (), "flex_attention": (), "flash_attention_2": ("flash_attn",),
            "flash_attention_3": ("flash_attn_interface",), "kernels": ("kernels",)}
LIGER_ALL = ("method.use_liger_kernel=true",)  # rope, rms_norm, swiglu, fused linear loss


def _attention() -> tuple[Case, ...]:
    out = []
    for layout, o in (("packed", PACKED), ("padded", PADDED)):
        for b, needs in BACKENDS.items():
            out.append(Case(f"{b} {layout}", SMALL + BF16 + o + (f"attention={b}",),
                            f"attention={b} on {layout} rows", needs,
                            None if b == "eager" else f"eager {layout}", rel=2e-2))
    return tuple(out)


def _liger() -> tuple[Case, ...]:
    out = []
    for m, o in (("sft", ("model.vocab_size=65536",)), ("dpo", ("method=dpo",)),
                 ("kto", ("method=kto",))):
        base = SMALL + o + ("method.max_length=256",)
        out += [Case(m, base, f"method={m} without Liger"),
                Case(f"{m} liger", base + LIGER_ALL, f"method={m} with every Liger kernel",
                     ("liger_kernel",), m, rel=1e-3,
                     lower_than=m if m == "sft" else None)]
    return tuple(out)


BIG = ("model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=8",
       "precision=bf16", "train.steps=4", "train.progress=false", "measure.memory_steps=all",
       "logger=none", "data.n_examples=32", "method.max_length=256", "train.batch_size=2")
GRPO = tuple(o for o in SMALL if not o.startswith("method.")) + (
    "method=grpo", "method.max_prompt_length=128", "method.max_completion_length=32")
PIECES: tuple[Piece, ...] = (
    Piece("attention", "every attention backend installed, packed and padded rows, against "
          "eager's loss (bf16_mixed)", 4, _attention()),
    Piece("liger", "Liger's kernels (all of them) against the plain path: sft, dpo, kto; "
          "sft's fused loss lowers the peak (vocab 65536)", 3.5, _liger()),
    Piece("qlora", "QLoRA 4-bit (NF4) and 8-bit against LoRA on the bf16 base: a lower peak, "
          "a close loss", 2, (
              Case("lora", BIG + ("peft=lora",), "LoRA on the bf16 base"),
              Case("qlora 4-bit", BIG + ("peft=qlora",), "NF4, double quantization, bf16 "
                   "compute", ("bitsandbytes",), "lora", 5e-2, "lora"),
              Case("qlora 8-bit", BIG + ("peft=qlora", "peft.bits=8"), "LLM.int8",
                   ("bitsandbytes",), "lora", 5e-2, "lora"))),
    Piece("offload", "activation offloading: the same loss, a lower peak", 1, (
        Case("no offload", SMALL + ("train.gradient_checkpointing=false",)),
        Case("offload activations", SMALL + ("train.gradient_checkpointing=false",
                                              "offload=activations"),
             "saved activations to pinned host memory", (), "no offload", 1e-4, "no offload"))),
    Piece("precision", "bf16, bf16_mixed and fp16_mixed (loss scaler) against fp32", 2, (
        # the reference pins fp32: SMALL leaves precision=auto, which is bf16_mixed on a GPU
        Case("fp32", SMALL + ("precision=fp32",)),
        *(Case(p, SMALL + (f"precision={p}",), "", (), "fp32", 3e-2)
          for p in ("bf16_mixed", "bf16", "fp16_mixed")))),
    Piece("varlen", "torch's varlen attention on packed rows (sdpa, eager) against "
          "transformers' block-diagonal mask, each backend against its own mask case (eager "
          "builds full score matrices: an H200 run compared it with sdpa's)", 2, tuple(
              c for b in ("sdpa", "eager") for c in (
                  Case(f"{b} mask", SMALL + BF16 + PACKED + (f"attention={b}",
                                                             "attention.varlen=false")),
                  Case(f"{b} varlen", SMALL + BF16 + PACKED + (f"attention={b}",),
                       "per-document attention through torch.nn.attention.varlen",
                       ("torch.nn.attention.varlen",), f"{b} mask", 2e-2, f"{b} mask")))),
    Piece("vllm", "GRPO with a colocated vLLM engine; sleep mode releases it while training",
          1, (
              Case("grpo hf", GRPO, "transformers' generate"),
              Case("grpo vllm", GRPO + ("generation=vllm",), "colocate", ("vllm",)),
              Case("grpo vllm sleep", GRPO + ("generation=vllm",
                                              "generation.enable_sleep_mode=true"),
                   "colocate, sleep mode", ("vllm",), lower_than="grpo vllm"))),
    Piece("distributed", "DDP and FSDP2 over NCCL (2 GPUs) against one GPU with the same "
          "global batch", 0.5, (
              Case("single", SMALL, "one GPU, batch 4", gpus=2),
              *(Case(d, SMALL + (f"distributed={d}", "distributed.nproc=2",
                                 "train.batch_size=2"), "2 ranks x batch 2", (), "single",
                     1e-3, gpus=2) for d in ("ddp", "fsdp2")))),
    Piece("techniques", "benchmarks/techniques.py --quick on the GPU: memlab's techniques "
          "against its baseline and TRL's SFTTrainer (TRL when installed)", 5,
          command=("benchmarks/techniques.py", "--quick", "--device", "cuda", "--rounds", "1",
                   "--out", "{out}/techniques_cuda.json")),
)


# ---------------------------------------------------------------- where it runs

def environment() -> dict[str, Any]:
    """The GPU, driver, CUDA, torch and package versions."""
    import importlib.metadata as md

    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "cuda": torch.version.cuda,
                           "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        env["driver"] = None
    for name in VERSIONS:
        try:
            env[name] = md.version(name)
        except md.PackageNotFoundError:
            env[name] = None
    return env


def missing(needs: tuple[str, ...]) -> str | None:
    """Why a case cannot run here (a module that does not import), or None."""
    for mod in needs:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            import torch

            return (f"needs a newer torch ({mod}; this is {torch.__version__})"
                    if mod.startswith("torch.") else f"not installed ({mod})")
    return None


def fetch_wheels(dest: Path) -> int:
    """Download :data:`WHEELS` for CPython 3.12 on x86-64 Linux into ``dest`` (here, where pip
    reaches PyPI); an sdist-only package is built into a wheel."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    plat = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            "--no-deps"] + [f"--platform={p}" for p in (
                "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")]
    for name, version in WHEELS.items():
        spec = f"{name}=={version}"
        if name in SDIST_ONLY:  # pure Python: a wheel built here installs there
            subprocess.run(pip + ["wheel", "--no-deps", "-w", str(dest), spec], check=True)
        else:
            subprocess.run(pip + ["download", *plat, "-d", str(dest), spec], check=True)
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"[gpu_acceptance] {len(list(dest.glob('*.whl')))} wheels, {size:.1f} MiB in {dest}")
    if size > WHEEL_BUDGET_MIB:
        print(f"[gpu_acceptance] over the {WHEEL_BUDGET_MIB} MiB a call carries beside the "
              "repository: leave the largest out (its cases read 'not installed')")
        return 1
    return 0


def install_wheels(src: Path) -> None:
    """Install ``src``'s wheels into :data:`SITE` and run this command again with it (and
    memlab's src/) on PYTHONPATH."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", str(SITE),
                    *map(str, sorted(src.glob("*.whl")))], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO / "src")])}
    args = [a for i, a in enumerate(sys.argv) if a != "--wheels" and (
        i == 0 or sys.argv[i - 1] != "--wheels")]
    os.execve(sys.executable, [sys.executable, *args], env)


# ---------------------------------------------------------------- one case

def _memlab(args: list[str], log: Path, timeout: float) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), str(REPO / "src")]))}
    with log.open("w") as f:
        try:
            return subprocess.run([sys.executable, "-m", "memlab", *args], cwd=REPO, env=env,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def run_case(piece: Piece, case: Case, work: Path, done: dict[str, dict]) -> dict[str, Any]:
    """Run one case (and its estimate); check it against its reference's result in ``done``."""
    import torch

    row: dict[str, Any] = {"piece": piece.name, "case": case.name, "what": case.what,
                           "overrides": list(case.overrides)}
    why = missing(case.needs)
    if why is None and case.gpus > torch.cuda.device_count():
        why = f"needs {case.gpus} GPUs (this machine has {torch.cuda.device_count()})"
    if why:
        return {**row, "status": why}
    d = work / piece.name / case.name.replace(" ", "_")
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    code = _memlab([*case.overrides, "train.device=cuda", f"hydra.run.dir={d / 'run'}"],
                   d / "run.log", 480)
    summary_path = d / "run" / "summary.json"
    s = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    mem = s.get("memory") or {}
    cuda = mem.get("cuda") or {}
    row |= {"run_status": s.get("status", f"exit {code}"), "error": s.get("error"),
            "loss_curve": (s.get("train") or {}).get("loss_curve"),
            "peak_allocated": cuda.get("peak_allocated_bytes"),
            "peak_reserved": cuda.get("peak_reserved_bytes"),
            "wall_s": round(time.perf_counter() - t0, 1)}
    if code == 0 and s.get("status") == "ok":
        _memlab(["estimate", *case.overrides, "--device", "cuda", "--from-data", "--out",
                 str(d / "estimate")], d / "estimate.log", 240)
        est_path = d / "estimate" / "estimate.json"
        est = json.loads(est_path.read_text()) if est_path.is_file() else {}
        row["estimate"] = est.get("peak_bytes")
        row["estimate_error"] = est.get("error") if est.get("status") != "ok" else None
        if row["estimate"] and row["peak_allocated"]:  # reported, not a check of the technique
            rel = (row["estimate"] - row["peak_allocated"]) / row["peak_allocated"]
            row["estimate_vs_allocated"] = round(rel, 4)
            row["estimate_within_5pct"] = abs(rel) <= 0.05
    row["checks"] = checks(case, row, done)
    ok = row["run_status"] == "ok" and all(c["passed"] for c in row["checks"])
    row["status"] = "ok" if ok else "failed"
    return row


def checks(case: Case, row: dict, done: dict[str, dict]) -> list[dict[str, Any]]:
    """The case's own checks against its reference rows (a reference that did not run: none)."""
    out = []
    ref = done.get(case.ref or "")
    if ref and ref.get("loss_curve") and row.get("loss_curve"):
        a, b = row["loss_curve"], ref["loss_curve"]
        worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
        out.append({"check": f"loss vs {case.ref}", "value": worst, "tolerance": case.rel,
                    "passed": len(a) == len(b) and worst <= case.rel})
    low = done.get(case.lower_than or "")
    if low and low.get("peak_allocated") and row.get("peak_allocated"):
        out.append({"check": f"peak below {case.lower_than}", "value": row["peak_allocated"],
                    "tolerance": low["peak_allocated"],
                    "passed": row["peak_allocated"] < low["peak_allocated"]})
    return out


def run_command(piece: Piece, out: Path) -> dict[str, Any]:
    args = [a.format(out=out) for a in piece.command]
    if not importlib.util.find_spec("trl"):
        args.append("--no-trl")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=540)
    (out / f"{piece.name}.log").write_text(r.stdout + r.stderr)
    return {"piece": piece.name, "case": piece.name, "what": " ".join(args),
            "status": "ok" if r.returncode == 0 else f"failed (exit {r.returncode})",
            "wall_s": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------- the dry run

def dry_run(pieces: list[Piece]) -> int:
    """Compose and validate every case as a run on a hypothetical CUDA machine with its
    packages and GPUs (nothing is built): what the GPU machine will be asked to run is valid."""
    import dataclasses

    sys.path.insert(0, str(REPO / "src"))
    from memlab.cli.compose import compose
    from memlab.config import Platform
    from memlab.context import validate
    from memlab.registry import ConfigErrors

    bad = 0
    for piece in pieces:
        for case in piece.cases:
            platform = Platform.cuda_machine(gpus=case.gpus)
            platform = dataclasses.replace(platform, assume_installed=platform.assume_installed
                                           | {m for m in case.needs if "." not in m})
            try:
                cfg, choices = compose([*case.overrides, "train.device=cuda"])
                validate(cfg, ".", choices, platform=platform)
                status = "valid"
            except ConfigErrors as e:
                status, bad = f"INVALID: {e}", bad + 1
            print(f"  {piece.name:12} {case.name:28} {status}")
        if piece.command:
            r = subprocess.run([sys.executable, piece.command[0], "--help"], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
            flags = [a for a in piece.command[1:] if a.startswith("--")]
            ok = r.returncode == 0 and all(f in r.stdout for f in flags)
            bad += not ok
            print(f"  {piece.name:12} {'(command)':28} {'valid' if ok else 'INVALID: flags'}")
    print(f"[gpu_acceptance] dry run: {bad} invalid")
    return 1 if bad else 0


# ---------------------------------------------------------------- results

def markdown(result: dict[str, Any]) -> str:
    env = result.get("environment") or {}
    head = (f"GPU acceptance: {env.get('gpu', '?')} (driver {env.get('driver')}, CUDA "
            f"{env.get('cuda')}), torch {env.get('torch')}, transformers "
            f"{env.get('transformers')}; {result.get('date', '?')}\n\n")
    lines = ["| piece | case | result | checks | peak allocated | estimate (error) |",
             "|---|---|---|---|---|---|"]
    for row in result.get("rows", []):
        mib = (row.get("peak_allocated") or 0) / 2**20
        est = row.get("estimate")
        err = (f"{est / 2**20:.0f} MiB ({100 * (est - row['peak_allocated']) / row['peak_allocated']:+.1f}%)"
               if est and row.get("peak_allocated") else row.get("estimate_error") or "")
        chk = "; ".join(f"{c['check']}: {'ok' if c['passed'] else 'FAILED'}"
                        for c in row.get("checks", []))
        lines.append(f"| {row['piece']} | {row['case']} | {row['status']} | {chk} | "
                     f"{f'{mib:.0f} MiB' if mib else ''} | {err} |")
    return head + "\n".join(lines) + "\n"


def save(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "gpu_acceptance.json.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out / "gpu_acceptance.json")
    (out / "gpu_acceptance.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated pieces")
    ap.add_argument("--list", action="store_true", help="the pieces and their cases")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose + validate every case for a hypothetical CUDA machine")
    ap.add_argument("--redo", action="store_true", help="run cases already in the results")
    ap.add_argument("--out", type=Path, default=OUT, help="results dir (JSON + Markdown)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/memlab-gpu-acceptance"))
    ap.add_argument("--fetch-wheels", type=Path, metavar="DIR")
    ap.add_argument("--wheels", type=Path, metavar="DIR")
    a = ap.parse_args(argv)
    names = a.only.split(",") if a.only else [p.name for p in PIECES]
    unknown = sorted(set(names) - {p.name for p in PIECES})
    if unknown:
        ap.error(f"unknown piece(s) {', '.join(unknown)}; --list shows them")
    pieces = [p for p in PIECES if p.name in names]
    if a.list:
        for p in pieces:
            print(f"{p.name:12} ~{p.minutes:g} min  {p.what}")
            common = os.path.commonprefix([list(c.overrides) for c in p.cases]) if p.cases \
                else []
            for c in p.cases:
                print(f"    {c.name:28} {' '.join(c.overrides[len(common):]) or '(the base)'}")
            if p.command:
                print(f"    {' '.join(p.command)}")
        return 0
    if a.fetch_wheels:
        return fetch_wheels(a.fetch_wheels)
    if a.wheels:
        install_wheels(a.wheels)  # runs this command again without --wheels
    if a.dry_run:
        return dry_run(pieces)
    import torch

    if not torch.cuda.is_available():
        print("gpu_acceptance: refuses to run without a CUDA device (torch.cuda.is_available() "
              "is False): it certifies memlab's GPU paths on a GPU; --dry-run composes and "
              "validates every case for a hypothetical CUDA machine instead")
        return 2
    lacking = missing(("hydra", "omegaconf", "datasets", "memlab"))
    if lacking:
        print(f"gpu_acceptance: memlab cannot run here: {lacking}; carry its wheels: "
              "--fetch-wheels DIR where pip works, then --wheels DIR here")
        return 2
    path = a.out / "gpu_acceptance.json"
    result = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    result |= {"environment": environment(), "date": time.strftime("%Y-%m-%d %H:%M")}
    rows = {(r["piece"], r["case"]): r for r in result["rows"]}
    for piece in pieces:
        t0 = time.perf_counter()
        done = {c: r for (p, c), r in rows.items() if p == piece.name}
        for case in piece.cases or (Case(piece.name, ()),):
            key = (piece.name, case.name)
            if key in rows and not a.redo and rows[key]["status"] == "ok":
                continue
            row = (run_command(piece, a.out) if piece.command
                   else run_case(piece, case, a.work, done))
            rows[key] = done[case.name] = row
            result["rows"] = list(rows.values())
            save(result, a.out)
            print(f"[gpu_acceptance] {piece.name:12} {case.name:28} {row['status']}",
                  flush=True)
        print(f"[gpu_acceptance] {piece.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(markdown(result))
    return 0 if all(r["status"] == "ok" or not r["status"].startswith("failed")
                    for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
