"""What the checkpoint's content hashes cost at real size (issue 43, item 1).

Qwen2.5-0.5B's architecture with random weights (memlab's ``model=tiny`` with the shipped
config's sizes, as benchmarks/real_size.py builds it), full fine-tuning in fp32 with AdamW, one
step of 1 x 32 tokens, then, best of ``--repeat``:

- save: ``checkpoint.save`` as it is (memlab's safetensors hashed while written, the Hugging
  Face files read back and hashed) against the same save before hashes (the Rust
  ``safetensors.torch.save_file``, nothing hashed): the overhead in seconds and percent;
- resume: the check ``plan_resume`` runs before anything loads (``file_problems``: headers, and
  now every file's sha256) with and without the hashes recorded, and the finite check of the
  tensors loaded (weights and optimizer state: safetensors maps them lazily, so the check's time
  includes paging them in, which loading pays anyway).

The files are in the page cache (just written): the hashes' CPU cost, not the disk's.
Usage: ``python benchmarks/checkpoint_hashing.py [--repeat 2] [--dry-run]`` (the dry run
composes and validates the configuration, builds nothing). Needs ~16 GB of free memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def overrides() -> list[str]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from real_size import tiny_knobs

    knobs = tiny_knobs("Qwen2.5-0.5B")
    return ["debug=smoke", "model=tiny", *(f"model.{k}={str(v).lower()}" for k, v in knobs.items()),
            "method=sft", "method.max_length=32", "train.batch_size=1", "train.steps=1",
            "precision=fp32", "optimizer=adamw", "measure.memory=false",
            "measure.memory_steps=0"]


def context(run_dir: Path):
    from memlab.cli.compose import compose
    from memlab.context import validate

    cfg, choices = compose(overrides())
    return validate(cfg, run_dir, choices)


def best(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(repeat: int, work: Path) -> dict[str, float]:
    import gc

    from safetensors.torch import save_file

    from memlab import pipeline
    from memlab.trainer import checkpoint, integrity
    from memlab.trainer.state_files import load_tensors

    def unhashed_save(path: Path, tensors: dict) -> str:  # save_tensors before issue 43
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
                  str(path))
        return ""

    pipe = pipeline.build(context(work / "run"))
    trainer = pipe.trainer
    trainer.train()
    out: dict[str, float] = {}
    out["save_hashed_s"] = best(repeat, trainer.save_checkpoint)
    real_save, real_hashes = checkpoint.save_tensors, integrity.file_hashes
    try:
        checkpoint.save_tensors = unhashed_save  # type: ignore[assignment]
        integrity.file_hashes = lambda *a, **k: {}  # type: ignore[assignment]
        out["save_before_s"] = best(repeat, trainer.save_checkpoint)
    finally:
        checkpoint.save_tensors, integrity.file_hashes = real_save, real_hashes
    ckpt = trainer.save_checkpoint()  # with its hashes again
    del pipe, trainer
    gc.collect()
    state = checkpoint.read_state(ckpt)
    unhashed = {k: v for k, v in state.items() if k not in ("files", "state_sha256")}
    out["checkpoint_gib"] = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) / 2**30

    def verify() -> None:
        integrity._VERIFIED.clear()  # a fresh process's first check
        assert not checkpoint.file_problems(ckpt, state)

    out["verify_hashed_s"] = best(repeat, verify)
    out["verify_before_s"] = best(repeat, lambda: checkpoint.file_problems(ckpt, unhashed))
    t = time.perf_counter()
    tensors = load_tensors(ckpt / checkpoint.OPTIMIZER)
    tensors.update(checkpoint.export.read_model_weights(ckpt, set(state["weights_in_model"])))
    out["read_tensors_s"] = time.perf_counter() - t
    out["finite_check_s"] = best(repeat, lambda: integrity.nonfinite(tensors, ckpt))
    out["hashed_files"] = len(state["files"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true",
                        help="compose and validate the configuration only")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    with tempfile.TemporaryDirectory(prefix="memlab-ckpt-hash-") as tmp:
        if args.dry_run:
            ctx = context(Path(tmp) / "run")
            print(f"valid: {ctx.model.name} hidden_size={ctx.model.hidden_size}")
            return 0
        r = measure(args.repeat, Path(tmp))
    r["save_overhead_s"] = r["save_hashed_s"] - r["save_before_s"]
    r["resume_overhead_s"] = r["verify_hashed_s"] - r["verify_before_s"] + r["finite_check_s"]
    print(json.dumps({k: round(v, 3) for k, v in r.items()}, indent=1))
    print(f"save: {r['save_before_s']:.2f} s -> {r['save_hashed_s']:.2f} s "
          f"({100 * r['save_overhead_s'] / r['save_before_s']:+.0f}%); resume checks: "
          f"+{r['resume_overhead_s']:.2f} s (read of the tensors: {r['read_tensors_s']:.2f} s) "
          f"for {r['checkpoint_gib']:.2f} GiB in {r['hashed_files']} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
