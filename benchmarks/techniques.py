"""Benchmark memlab's memory / speed techniques against its plain baseline and, where TRL is
installed, against TRL's ``SFTTrainer`` with the matching settings (ratios memlab / TRL).

What runs (one model, one data set, the same batches for every configuration):

* model: memlab's tiny Llama (``memlab.model.tiny.Tiny``) at ``--hidden/--intermediate/--layers``
  (default 256 / 768 / 4, 4 heads, 2 KV heads; vocab 4096 = memlab's shipped BPE tokenizer),
  random init with seed 0 (``memlab.model.base.seeded``): identical weights on both sides.
* data: ``memlab.data.synthetic.generate_chat(n, seed)`` (heavy-tailed chat, median ~300
  tokens), written once to a jsonl; memlab reads it with ``data=local``, TRL gets the same rows
  as a ``datasets.Dataset`` with a ``messages`` column. Rows whose truncated sequence has no
  assistant token are dropped up front (TRL drops them itself, memlab would keep them).
  ``n`` is the smallest count whose BFD packing fills ``steps * batch_size`` rows, so packed runs
  use every row once; padded runs use the first ``steps * batch_size`` examples of memlab's own
  shuffle. TRL's sampler is replaced by that same permutation (``memlab.trainer.loop.BatchStream``)
  of its prepared rows; with ``n <= 1000`` TRL's BFD packs globally, like memlab, into the same
  rows. Both sides therefore see the same batches step for step (the loss curves agree to the
  4th decimal, which the report checks: ``loss_first_diff`` / ``loss_final_diff``).
* training: ``--steps`` optimizer steps, batch ``--batch-size``, no grad accumulation, AdamW
  (``adamw_torch``: torch.optim.AdamW, betas 0.9/0.999, wd 0), lr 3e-4 cosine without warm-up,
  max_grad_norm 1.0, max_length ``--max-length`` (keep_start), loss on assistant tokens only
  (TRL: ``assistant_only_loss=True`` via the template's ``{% generation %}`` markers), loss
  normalised by the number of loss tokens of the step on both sides. Gradient checkpointing is on
  unless the configuration says otherwise (memlab's and TRL's default; non-reentrant on both).

Two kinds of runs per configuration, never mixed:

* memory: memlab with ``measure.memory=true measure.memory_steps=<--memory-steps>`` (default
  ``auto``: steps 0 and 1 and every later step whose batch shape is the largest so far, which is
  where the peak can move; ``all`` tracks every step, ~3x slower). TRL under the very same
  tracker class (``memlab.measure.memory._tracker_class()``, torch's MemTracker), entered per step
  by the same rule around forward + backward + optimizer step (``training_step`` to
  ``on_step_end``), with the model, optimizer and the step's input tensors registered like memlab
  does; the peak snapshot is mapped by ``memlab.measure.memory.categorize``. Byte-exact and
  deterministic on CPU: one run each.
* speed: memlab with ``measure.memory=false``; TRL without tracker. tokens/s = non-padding input
  tokens of steps 1.. (step 0 is warm-up) / the time of those steps (memlab: its own
  ``throughput.tokens_per_s``; TRL: ``on_step_begin`` -> ``on_step_end`` of a TrainerCallback;
  both exclude batch collation). ``--rounds`` rounds; in each, every memlab run is followed or
  preceded (alternating) by its TRL pair, and the configuration order reverses every round; the
  ratios (vs memlab's baseline and memlab / TRL) are taken within a round, and the median over
  rounds is reported.

Processes: two long-lived worker processes (one for memlab, in-process via
``tests/memlab_testing.run_job``; one for TRL, with the python that can import ``trl``), each
running one configuration at a time (new model, data, trainer each time; single-threaded torch).
Starting a fresh process per run (``--fresh``) is cleaner but costs ~10-25 s per run here
(TRL's import alone), which would not fit the time budget.

TRL is optional and never imported by memlab. Without it (or with ``--no-trl``) only the memlab
side runs. To get it without touching the main environment:
``.venv-trl``, a venv over ``.venv`` with TRL added (benchmarks/README.md gives the commands)
(the TRL worker is started with ``--trl-python``, default: this python if it imports trl, else
``.venv-trl/bin/python``).

Usage: ``python benchmarks/techniques.py [--quick] [--out PATH] [--rounds N] [--only a,b]``;
``--dry-run``: every configuration's memlab runs composed and validated, nothing run.
Full run ~15 min on 2 shared CPU cores; ``--quick`` (~3 min) uses a smaller model, shorter
sequences, fewer steps, one round and fewer configurations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
SENTINEL = "@@techniques-done@@"
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")


# --------------------------------------------------------------------------------------------
# settings and configurations
# --------------------------------------------------------------------------------------------


@dataclass
class Settings:
    hidden: int = 256
    intermediate: int = 768
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int | None = None
    """None = the tokenizer's 4096; larger adds unused output rows (a real LLM's vocab size)."""
    max_length: int = 512
    batch_size: int = 4
    steps: int = 5
    lr: float = 3e-4
    seed: int = 0
    data_seed: int = 0
    memory_steps: str = "auto"
    rounds: int = 3
    device: str = "cpu"
    """cpu | cuda (both sides train there; memlab's memory on CUDA is the allocator's peak)."""

    def memlab_common(self, data_path: str) -> list[str]:
        return [
            "data=local", f"data.path={data_path}",
            f"model.hidden_size={self.hidden}", f"model.intermediate_size={self.intermediate}",
            f"model.num_layers={self.layers}", f"model.num_heads={self.heads}",
            f"model.num_kv_heads={self.kv_heads}",
            *([f"model.vocab_size={self.vocab}"] if self.vocab else []),
            f"method.max_length={self.max_length}",
            f"train.batch_size={self.batch_size}", f"train.steps={self.steps}",
            f"train.lr={self.lr}", f"train.seed={self.seed}", "train.grad_accum=1",
            "optimizer=adamw", "train.scheduler=cosine", "train.warmup_steps=0",
            "train.weight_decay=0.0", "train.max_grad_norm=1.0",
            f"train.device={self.device}", "train.progress=false", "measure.warmup_steps=1",
        ]


QUICK = dict(hidden=128, intermediate=384, max_length=384, steps=5, rounds=1)


@dataclass
class Config:
    name: str
    what: str
    memlab: list[str]
    trl: str | None = None
    """Name of the TRL configuration with the matching settings (None: no TRL equivalent)."""
    quick: bool = True
    """Part of --quick."""


# TRL configurations: SFTConfig / model settings on top of the common ones.
TRL_CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "no_checkpointing": {"gradient_checkpointing": False},
    "lora": {"lora": True},
    "bf16": {"dtype": "bfloat16", "bf16": True},
    "bf16_mixed": {"bf16": True},
    "padding_free": {"padding_free": True},
    "packing_bfd": {"packing": "bfd"},
    "lora_bf16_bfd": {"lora": True, "dtype": "bfloat16", "bf16": True, "packing": "bfd"},
}

# TRL-only diagnostic runs (memory only), to attribute the memory gap.
TRL_DIAGNOSTICS: dict[str, dict[str, Any]] = {
    "baseline_tile_vocab": {"tile": "vocab"},
}
TRL_CONFIGS.update(TRL_DIAGNOSTICS)

CONFIGS: list[Config] = [
    Config("baseline", "sdpa, fp32, checkpointing every layer (memlab default)", [], "baseline"),
    Config("no_checkpointing", "train.gradient_checkpointing=false",
           ["train.gradient_checkpointing=false"], "no_checkpointing"),
    Config("selective_ckpt_2", "train.checkpoint_every=2 (every 2nd layer)",
           ["train.checkpoint_every=2"], None, quick=False),
    Config("lora", "peft=lora (r=16, all-linear)", ["peft=lora"], "lora"),
    Config("bf16", "precision=bf16 (pure bf16 weights/grads/optimizer)", ["precision=bf16"],
           "bf16", quick=False),
    Config("bf16_mixed", "precision=bf16_mixed (fp32 weights, bf16 autocast)",
           ["precision=bf16_mixed"], "bf16_mixed", quick=False),
    Config("chunked_loss", "method.loss_impl=chunked (vs TRL's default fused LM head)",
           ["method.loss_impl=chunked"], "baseline"),
    Config("padding_free", "method.padding_free=true", ["method.padding_free=true"],
           "padding_free"),
    Config("packing_bfd", "packing=bfd (padding-free rows)", ["packing=bfd"], "packing_bfd"),
    Config("lora_bf16_bfd", "peft=lora precision=bf16 packing=bfd",
           ["peft=lora", "precision=bf16", "packing=bfd"], "lora_bf16_bfd", quick=False),
    Config("bf16_chunked_bfd", "precision=bf16 method.loss_impl=chunked packing=bfd",
           ["precision=bf16", "method.loss_impl=chunked", "packing=bfd"], None, quick=False),
]


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def prepare_data(s: Settings, workdir: Path) -> dict[str, Any]:
    """The jsonl both sides train on, memlab's batch order, and what was dropped."""
    from memlab.data.assets import load_tokenizer
    from memlab.data.synthetic import generate_chat
    from memlab.packing import core
    from memlab.trainer.batch import BatchStream

    tok = load_tokenizer()
    need_rows = s.steps * s.batch_size
    pool = max(4 * need_rows, 64)
    raw = generate_chat(pool, seed=s.data_seed)
    kept, lengths, dropped = [], [], 0
    for row in raw:
        enc = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        mask = list(enc["assistant_masks"])[: s.max_length]
        if not any(mask[1:]):  # no loss token after truncation (and the shift)
            dropped += 1
            continue
        kept.append(row)
        lengths.append(min(len(enc["input_ids"]), s.max_length))
    # smallest n whose BFD rows cover every step (packed runs then use each row once)
    n = need_rows
    while n <= len(kept) and core.plan(lengths[:n], s.max_length, "bfd").num_rows < need_rows:
        n += 1
    if n > len(kept):
        raise RuntimeError("data pool too small; raise the pool size")
    rows = kept[:n]
    path = workdir / "data.jsonl"
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    order = BatchStream(list(range(n)), s.batch_size, s.seed, None)._permutation(0)
    packed = core.plan(lengths[:n], s.max_length, "bfd")
    used = order[:need_rows]
    return {
        "path": str(path), "examples": n, "dropped_no_loss_token": dropped,
        "order": order,
        "padded_runs_tokens": int(sum(lengths[i] for i in used)),
        "padded_runs_slots": int(sum(
            s.batch_size * max(lengths[i] for i in used[k:k + s.batch_size])
            for k in range(0, need_rows, s.batch_size))),
        "bfd_rows": packed.num_rows, "bfd_fill": packed.fill_ratio,
        "median_tokens": float(statistics.median(lengths[:n])),
        "max_tokens": int(max(lengths[:n])),
    }


# --------------------------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------------------------


def _setup_worker_env() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    torch.set_num_threads(1)


def memlab_job(req: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from memlab_testing import run_job

    t0 = time.perf_counter()
    summary = run_job(Path(req["dir"]), req["overrides"], fast=False, name=req["name"])
    out: dict[str, Any] = {"status": summary["status"], "error": summary.get("error"),
                           "wall_s": time.perf_counter() - t0}
    mem = summary.get("memory") or {}
    if req["mode"] == "memory" and mem:
        out.update(peak_bytes=mem["peak_bytes"], by_category=mem["by_category"],
                   by_phase=mem["by_phase"], peak_at=mem["peak_at"],
                   tracked_steps=mem["tracked_steps"])
    if req["mode"] == "profile":
        out["profile"] = summary.get("profile")
    thr = summary.get("throughput") or {}
    data = summary.get("data") or {}
    tr = summary.get("train") or {}
    out.update(tokens_per_s=thr.get("tokens_per_s"), step_time_s=thr.get("step_time_s"),
               timed_steps=thr.get("timed_steps"), tokens=data.get("tokens_trained"),
               padding_fraction=data.get("padding_fraction"), rows=data.get("rows"),
               fill_ratio=data.get("fill_ratio"), losses=tr.get("loss_curve"))
    return out


def _trl_tokenized(rows: list[dict], tok, max_length: int) -> list[dict]:
    """What TRL's own preparation makes of conversations (``_tokenize`` with the assistant mask,
    labels = ids on assistant tokens, truncated keep_start): used for padding-free without
    packing, where TRL refuses ``max_length`` and wants truncated inputs."""
    out = []
    for r in rows:
        enc = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids = list(enc["input_ids"])[:max_length]
        mask = list(enc["assistant_masks"])[:max_length]
        out.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]})
    return out


def trl_job(req: dict[str, Any]) -> dict[str, Any]:
    import datasets
    import torch
    from _trl_probe import watch_trainer
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from memlab.data.assets import load_tokenizer
    from memlab.measure.memory import MemoryProbe
    from memlab.measure.profile import phase_label, profiled
    from memlab.model.base import finish_load, seeded
    from memlab.model.tiny import Tiny
    from memlab.peft.lora import Lora

    s = Settings(**req["settings"])
    spec = TRL_CONFIGS[req["trl"]]
    mode = req["mode"]
    tok = load_tokenizer()
    rows = [json.loads(line) for line in Path(req["data"]).read_text().splitlines()]
    packing = spec.get("packing")
    pretokenized = spec.get("padding_free") and not packing
    if pretokenized:
        rows = _trl_tokenized(rows, tok, s.max_length)
    ds = datasets.Dataset.from_list(rows)

    dtype = torch.bfloat16 if spec.get("dtype") == "bfloat16" else torch.float32
    tiny = Tiny(hidden_size=s.hidden, intermediate_size=s.intermediate, num_layers=s.layers,
                num_heads=s.heads, num_kv_heads=s.kv_heads, vocab_size=s.vocab)
    with seeded(s.seed):
        model = AutoModelForCausalLM.from_config(tiny.hf_config(tok), attn_implementation="sdpa",
                                                 dtype=dtype)
    finish_load(model, tok, "causal_lm")
    peft_config = Lora().lora_config("causal_lm") if spec.get("lora") else None

    rec: dict[str, Any] = {"tokens": [], "slots": [], "dt": [], "losses": []}
    probe = MemoryProbe("cpu") if mode == "memory" else None
    state: dict[str, Any] = {"max_key": (), "t0": 0.0, "stack": None, "profiling": False,
                             "prof_stack": None, "profile": None}
    profile_step = req.get("profile_step") if mode == "profile" else None

    def track_rule(step: int, key: tuple[int, ...]) -> bool:
        """memlab's ``measure.memory_steps`` rule (Trainer._tracked), on TRL's batches."""
        if s.memory_steps == "all":
            return True
        mk = state["max_key"]
        tracked = step < 2 or not mk or any(k > m for k, m in zip(key, mk, strict=False))
        if tracked and step >= 1:
            state["max_key"] = tuple(max(a, b) for a, b in zip(key, mk or key, strict=False))
        return tracked

    if spec.get("tile") == "vocab":  # diagnostic: TRL's LM-head tile as wide as the vocab
        import trl.trainer.utils as trl_utils

        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = tiny.hf_config(tok).vocab_size

    class Bench(SFTTrainer):
        """SFTTrainer that reads rows in memlab's order, counts tokens per step and, in memory
        mode, runs each selected step under memlab's MemoryProbe with memlab's phases."""

        def _get_train_sampler(self, train_dataset=None):
            # memlab's BatchStream permutation of the prepared rows (examples, or packed rows:
            # with n <= 1000 TRL's BFD is global like memlab's and gives the same rows)
            from memlab.trainer.batch import BatchStream

            n = len(train_dataset if train_dataset is not None else self.train_dataset)
            rec["order_rows"] = n
            return BatchStream(list(range(n)), s.batch_size, s.seed, None)._permutation(0)

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs["input_ids"]
            padded = "attention_mask" in inputs
            rec["tokens"].append(int(inputs["attention_mask"].sum()) if padded else ids.numel())
            rec["slots"].append(ids.numel())
            if profile_step is not None:  # memlab's phase labels around TRL's phases
                self._label_backward()
                loss = super().training_step(model, inputs, num_items_in_batch)
                if state["profiling"]:  # clip + step + zero_grad, closed at on_step_end
                    state["prof_stack"].enter_context(phase_label("optimizer", True))
                return loss
            if probe is None:
                return super().training_step(model, inputs, num_items_in_batch)
            step = len(rec["tokens"]) - 1
            key = (ids.numel(), ids.shape[1]) if padded else (ids.numel(),)
            watch_trainer(probe, self, model)
            stack = contextlib.ExitStack()
            tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
            stack.enter_context(probe.step(step, track_rule(step, key), tensors))
            state["stack"] = stack
            loss = super().training_step(model, inputs, num_items_in_batch)
            stack.enter_context(probe.phase("optimizer"))  # clip + step + zero_grad
            return loss

        def _label_backward(self):
            if getattr(self.accelerator, "_bench_labelled", False):
                return
            orig = self.accelerator.backward

            def backward(loss, **kw):
                with phase_label("backward", state["profiling"]):
                    orig(loss, **kw)

            self.accelerator.backward = backward
            self.accelerator._bench_labelled = True

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if profile_step is not None:
                with phase_label("forward", state["profiling"]):
                    return super().compute_loss(model, inputs, return_outputs,
                                                num_items_in_batch)
            if probe is None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with probe.phase("forward"):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Timer(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if profile_step is not None and st.global_step == profile_step:
                state["profiling"] = True
                state["prof_stack"] = contextlib.ExitStack()
                state["profile"] = state["prof_stack"].enter_context(
                    profiled(Path(req["dir"]) / "profile"))
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            rec["dt"].append(time.perf_counter() - state["t0"])
            if state["profiling"]:
                state["prof_stack"].close()
                state["profiling"] = False
            if state["stack"] is not None:
                state["stack"].close()
                state["stack"] = None

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                rec["losses"].append(float(logs["loss"]))

    args = SFTConfig(
        output_dir=req["dir"], max_steps=s.steps, per_device_train_batch_size=s.batch_size,
        gradient_accumulation_steps=1, learning_rate=s.lr, lr_scheduler_type="cosine",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, optim="adamw_torch", seed=s.seed, data_seed=s.seed,
        use_cpu=s.device == "cpu",
        bf16=bool(spec.get("bf16", False)), fp16=False,
        gradient_checkpointing=spec.get("gradient_checkpointing", True),
        max_length=None if pretokenized else s.max_length, truncation_mode="keep_start",
        packing=bool(packing), packing_strategy=packing or "bfd",
        padding_free=bool(spec.get("padding_free", False)),
        assistant_only_loss=not pretokenized,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, dataset_num_proc=None,
    )
    t0 = time.perf_counter()
    trainer = Bench(model=model, args=args, train_dataset=ds, processing_class=tok,
                    peft_config=peft_config, callbacks=[Timer()])
    trainer.train()
    timed_tok = sum(rec["tokens"][1:])
    timed_s = sum(rec["dt"][1:])
    out: dict[str, Any] = {
        "status": "ok", "wall_s": time.perf_counter() - t0,
        "tokens_per_s": timed_tok / timed_s if timed_s > 0 else None,
        "step_time_s": timed_s / max(1, len(rec["dt"]) - 1),
        "timed_steps": len(rec["dt"]) - 1, "tokens": sum(rec["tokens"]),
        "padding_fraction": 1 - sum(rec["tokens"]) / max(1, sum(rec["slots"])),
        "rows": len(trainer.train_dataset), "losses": rec["losses"],
        "fill_ratio": (sum(len(x) for x in trainer.train_dataset["input_ids"])
                       / (len(trainer.train_dataset) * s.max_length)) if packing else None,
        "steps": len(rec["dt"]),
    }
    if profile_step is not None:
        out["profile"] = {"step": profile_step, **(state["profile"] or {})}
    if probe is not None:
        mem = probe.result()
        out.update(peak_bytes=mem["peak_bytes"], by_category=mem["by_category"],
                   by_phase=mem["by_phase"], peak_at=mem["peak_at"],
                   tracked_steps=mem["tracked_steps"])
    return out


def worker_main(kind: str) -> None:
    """Serve JSON requests from stdin, one per line; write each result to req['out']."""
    _setup_worker_env()
    if kind == "trl":
        import trl  # noqa: F401  (import once, outside the timed runs)
    import memlab.run  # noqa: F401

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            res = (memlab_job if kind == "memlab" else trl_job)(req)
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()}
        import gc

        gc.collect()
        Path(req["out"]).write_text(json.dumps(res))
        print(SENTINEL, flush=True)


class Worker:
    def __init__(self, kind: str, python: str, log: Path, fresh: bool):
        self.kind, self.python, self.log, self.fresh = kind, python, log, fresh
        self.proc: subprocess.Popen | None = None
        self.n = 0

    def _start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [self.python, str(Path(__file__).resolve()), "--worker", self.kind],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("a"),
            text=True, env=env, cwd=str(REPO))

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.n += 1
        req = dict(req, out=str(self.log.parent / f"{self.kind}_{self.n}.json"))
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        with self.log.open("a") as lf:
            for line in self.proc.stdout:
                if line.strip() == SENTINEL:
                    break
                lf.write(line)
            else:
                return {"status": "failed", "error": f"{self.kind} worker died (see {self.log})"}
        res = json.loads(Path(req["out"]).read_text())
        if self.fresh:
            self.close()
        return res

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None


# --------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------


def find_trl_python(explicit: str | None) -> str | None:
    cands = [explicit] if explicit else [sys.executable, str(REPO / ".venv-trl/bin/python")]
    for py in cands:
        if py and Path(py).exists():
            ok = subprocess.run([py, "-c", "import trl, memlab"], capture_output=True)
            if ok.returncode == 0:
                return py
    return None


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mib(x: float | None) -> float | None:
    return None if x is None else round(x / MIB, 2)


@dataclass
class Results:
    memory: dict[str, dict] = field(default_factory=dict)        # "memlab:<cfg>" / "trl:<cfg>"
    speed: dict[str, list[dict]] = field(default_factory=dict)   # same keys, one per round
    profile: dict[str, dict] = field(default_factory=dict)       # same keys: one step each
    round_ratio: dict[str, list[float]] = field(default_factory=dict)


def memlab_overrides(s: Settings, data: str, c: Config, mode: str, prof_step: int
                     ) -> list[str]:
    """memlab's run of ``c`` in ``mode`` (memory | speed | profile)."""
    # TRL's side trains in fp32 unless a configuration says bf16: memlab's default
    # (precision=auto) would be bf16 mixed on a CPU or GPU with bf16 kernels
    pin = [] if any(o.startswith("precision=") for o in c.memlab) else ["precision=fp32"]
    speed = ["measure.memory=false"]
    return s.memlab_common(data) + pin + c.memlab + {
        "memory": ["measure.memory=true", f"measure.memory_steps={s.memory_steps}"],
        "speed": speed, "profile": [*speed, f"measure.profile_step={prof_step}"]}[mode]


def dry_run(s: Settings, configs: list[Config], prof_step: int, trl: bool) -> int:
    """Every configuration's memlab run composed and validated (memory; the baseline's speed
    and profile runs too: the others differ from theirs only in ``measure.*``) for
    ``s.device`` (cuda: a CUDA machine with the GPU extras), on a one-row file in place of
    the generated data; each TRL configuration named; nothing run."""
    from _dry_run import TRL_MISSING, check, done, trl_importable

    from memlab.config import Platform

    platform = Platform.cuda_machine(gpus=1) if s.device == "cuda" else None
    problems = [f"{c.name}: no TRL configuration {c.trl!r}" for c in configs
                if c.trl and c.trl not in TRL_CONFIGS]
    with tempfile.TemporaryDirectory(prefix="memlab-techniques-dry-") as tmp:
        data = Path(tmp) / "data.jsonl"
        data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]})
                        + "\n")
        runs = [(c, "memory") for c in configs] + [(configs[0], "speed"),
                                                   (configs[0], "profile")]
        bad = check("techniques", [(f"{c.name} {mode}",
                                    memlab_overrides(s, str(data), c, mode, prof_step))
                                   for c, mode in runs], platform=platform)
    if trl and trl_importable():
        for name in sorted({c.trl for c in configs if c.trl}):
            print(f"  [techniques] {'trl:' + name:44} SFTConfig + {TRL_CONFIGS[name]}")
    elif trl:
        print(f"  [techniques] {TRL_MISSING}")
    return done("techniques", bad, problems)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~3 min: smaller model, 1 round")
    ap.add_argument("--out", default=None, help="JSON output (default "
                    "benchmarks/results/techniques.json, or techniques_quick.json with --quick)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None, help="model vocab (default 4096)")
    ap.add_argument("--memory-steps", choices=("auto", "all"), default="auto")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where both sides train (cuda: benchmarks/gpu_acceptance.py)")
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--trl-python", default=None)
    ap.add_argument("--fresh", action="store_true", help="a fresh process for every run")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--workdir", default=None, help="keep run dirs / logs here")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step of each configuration on both sides "
                         "(torch.profiler; memlab's measure.profile_step): time by phase and "
                         "by kind of work")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="the step to profile (default: the second-last)")
    ap.add_argument("--worker", choices=("memlab", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate every configuration's memlab run; run nothing")
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a.worker)
        return 0

    sys.path.insert(0, str(REPO / "src"))
    s = Settings(**(QUICK if a.quick else {}))
    s.memory_steps = a.memory_steps
    s.device = a.device
    if a.rounds is not None:
        s.rounds = a.rounds
    if a.steps is not None:
        s.steps = a.steps
    if a.max_length is not None:
        s.max_length = a.max_length
    if a.vocab is not None:
        s.vocab = a.vocab
    configs = [c for c in CONFIGS if (c.quick or not a.quick)]
    if a.only:
        names = a.only.split(",")
        configs = [c for c in CONFIGS if c.name in names]
        if "baseline" not in names:
            configs.insert(0, CONFIGS[0])
    prof_step = a.profile_step if a.profile_step is not None else max(2, s.steps - 2)
    if a.dry_run:
        return dry_run(s, configs, prof_step, not a.no_trl)
    out_path = Path(a.out) if a.out else REPO / "benchmarks" / "results" / (
        "techniques_quick.json" if a.quick else "techniques.json")

    trl_py = None if a.no_trl else find_trl_python(a.trl_python)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="memlab-techniques-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    print(f"[techniques] settings {asdict(s)}; TRL: {trl_py or 'not available'}; work {work}",
          flush=True)
    data = prepare_data(s, work)
    print(f"[techniques] data: {data['examples']} examples (dropped "
          f"{data['dropped_no_loss_token']} without loss tokens), BFD rows {data['bfd_rows']}, "
          f"fill {data['bfd_fill']:.3f}", flush=True)

    mw = Worker("memlab", sys.executable, work / "memlab.log", a.fresh)
    tw = Worker("trl", trl_py, work / "trl.log", a.fresh) if trl_py else None
    trl_names = sorted({c.trl for c in configs if c.trl}) if tw else []
    res = Results()

    def run_memlab(c: Config, mode: str, tag: str) -> dict:
        over = memlab_overrides(s, data["path"], c, mode, prof_step)
        r = mw.run({"mode": mode, "overrides": over, "dir": str(work / "runs"),
                    "name": f"{c.name}-{tag}"})
        _log_run("memlab", c.name, mode, r)
        return r

    def run_trl(name: str, mode: str, tag: str) -> dict:
        assert tw is not None
        r = tw.run({"mode": mode, "trl": name, "settings": asdict(s), "data": data["path"],
                    "dir": str(work / "trl" / f"{name}-{tag}"), "profile_step": prof_step})
        _log_run("trl", name, mode, r)
        return r

    try:
        if not a.skip_memory:
            for c in configs:
                res.memory[f"memlab:{c.name}"] = run_memlab(c, "memory", "mem")
            for name in trl_names + (list(TRL_DIAGNOSTICS) if tw and not a.quick else []):
                res.memory[f"trl:{name}"] = run_trl(name, "memory", "mem")
        if not a.skip_speed:
            for rnd in range(s.rounds):
                seq = configs if rnd % 2 == 0 else list(reversed(configs))
                done_trl: set[str] = set()
                for i, c in enumerate(seq):
                    jobs = [("memlab", c.name)]
                    if tw and c.trl and c.trl not in done_trl:
                        jobs.append(("trl", c.trl))
                        done_trl.add(c.trl)
                    if (rnd + i) % 2:
                        jobs.reverse()
                    for side, name in jobs:
                        r = (run_memlab(c, "speed", f"r{rnd}") if side == "memlab"
                             else run_trl(name, "speed", f"r{rnd}"))
                        res.speed.setdefault(f"{side}:{name}", []).append(r)
        if a.profile:
            for c in configs:
                res.profile[f"memlab:{c.name}"] = run_memlab(c, "profile", "prof")
                if tw and c.trl and f"trl:{c.trl}" not in res.profile:
                    res.profile[f"trl:{c.trl}"] = run_trl(c.trl, "profile", "prof")
    finally:
        mw.close()
        if tw:
            tw.close()

    report = build_report(s, data, configs, res, trl_py, time.perf_counter() - t_start)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {out_path} ({report['runtime_s']:.0f} s)")
    return 0


def _log_run(side: str, name: str, mode: str, r: dict) -> None:
    if r.get("status") != "ok":
        print(f"  {side:6s} {name:18s} {mode:6s} FAILED: {r.get('error')}", flush=True)
        return
    bits = [f"{side:6s} {name:18s} {mode:6s}"]
    if r.get("peak_bytes"):
        bits.append(f"peak {r['peak_bytes'] / MIB:8.2f} MiB")
    if r.get("tokens_per_s"):
        bits.append(f"{r['tokens_per_s']:8.1f} tok/s")
    if r.get("losses"):
        bits.append(f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    bits.append(f"({r.get('wall_s', 0):.0f} s)")
    print("  " + "  ".join(bits), flush=True)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _side(res: Results, key: str, rounds: int) -> dict[str, Any] | None:
    mem = res.memory.get(key)
    spd = res.speed.get(key, [])
    if mem is None and not spd:
        return None
    d: dict[str, Any] = {}
    if mem is not None:
        d["memory_status"] = mem.get("status")
        if mem.get("status") == "ok":
            d["peak_mib"] = _mib(mem["peak_bytes"])
            d["peak_bytes"] = mem["peak_bytes"]
            d["by_category_mib"] = {k: _mib(v) for k, v in (mem.get("by_category") or {}).items()}
            if mem.get("by_phase"):
                d["by_phase_mib"] = {k: _mib(v) for k, v in mem["by_phase"].items()}
            d["peak_at"] = mem.get("peak_at")
            d["tracked_steps"] = mem.get("tracked_steps")
        else:
            d["memory_error"] = mem.get("error")
    ok = [r for r in spd if r.get("status") == "ok"]
    if spd:
        d["tokens_per_s_rounds"] = [round(r["tokens_per_s"], 2) if r.get("status") == "ok"
                                    and r.get("tokens_per_s") else None for r in spd]
        d["tokens_per_s"] = _round(_median([r.get("tokens_per_s") for r in ok]))
        d["step_time_s"] = _round(_median([r.get("step_time_s") for r in ok]), 4)
        if len(ok) < len(spd):
            d["speed_errors"] = [r.get("error") for r in spd if r.get("status") != "ok"]
    src = ok[0] if ok else (mem if mem and mem.get("status") == "ok" else None)
    if src:
        d["tokens_trained"] = src.get("tokens")
        d["padding_fraction"] = _round(src.get("padding_fraction"), 4)
        d["rows"] = src.get("rows")
        losses = src.get("losses") or []
        if losses:
            d["loss_first"] = round(losses[0], 4)
            d["loss_final"] = round(losses[-1], 4)
    return d


def _round(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _ratios(num: list[dict], den: list[dict]) -> list[float | None]:
    out = []
    for a, b in zip(num, den, strict=False):
        ta, tb = a.get("tokens_per_s"), b.get("tokens_per_s")
        out.append(round(ta / tb, 4) if ta and tb else None)
    return out


def build_report(s: Settings, data: dict, configs: list[Config], res: Results,
                 trl_py: str | None, runtime: float) -> dict[str, Any]:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
           "machine": platform.machine(), "omp_num_threads": 1, "trl_python": trl_py}
    if trl_py:
        v = subprocess.run([trl_py, "-c", "import trl, peft, accelerate; print(trl.__version__, "
                            "peft.__version__, accelerate.__version__)"],
                           capture_output=True, text=True).stdout.split()
        if len(v) == 3:
            env.update(trl=v[0], peft=v[1], accelerate=v[2])
    base_m = _side(res, "memlab:baseline", s.rounds) or {}
    base_speed = res.speed.get("memlab:baseline", [])
    rows = []
    for c in configs:
        m = _side(res, f"memlab:{c.name}", s.rounds)
        entry: dict[str, Any] = {"name": c.name, "what": c.what, "memlab_overrides": c.memlab,
                                 "memlab": m, "trl_config": c.trl, "trl": None}
        if m is not None:
            if m.get("peak_bytes") and base_m.get("peak_bytes"):
                m["peak_vs_baseline"] = round(m["peak_bytes"] / base_m["peak_bytes"], 4)
            rr = _ratios(res.speed.get(f"memlab:{c.name}", []), base_speed)
            if rr:
                m["tokens_per_s_vs_baseline_rounds"] = rr
                m["tokens_per_s_vs_baseline"] = _round(_median(rr), 4)
        if c.trl:
            t = _side(res, f"trl:{c.trl}", s.rounds)
            entry["trl"] = t
            if t is not None and m is not None:
                cmp: dict[str, Any] = {}
                if m.get("peak_bytes") and t.get("peak_bytes"):
                    cmp["peak"] = round(m["peak_bytes"] / t["peak_bytes"], 4)
                rr = _ratios(res.speed.get(f"memlab:{c.name}", []),
                             res.speed.get(f"trl:{c.trl}", []))
                if rr:
                    cmp["tokens_per_s_rounds"] = rr
                    cmp["tokens_per_s"] = _round(_median(rr), 4)
                cmp["target_memory_met"] = (cmp["peak"] <= 0.8) if "peak" in cmp else None
                cmp["target_speed_met"] = (cmp["tokens_per_s"] >= 1.2
                                           if cmp.get("tokens_per_s") else None)
                if m.get("loss_first") is not None and t.get("loss_first") is not None:
                    cmp["loss_first_diff"] = round(m["loss_first"] - t["loss_first"], 4)
                    cmp["loss_final_diff"] = round(m["loss_final"] - t["loss_final"], 4)
                entry["memlab_over_trl"] = cmp
        rows.append(entry)
    diagnostics = {name: _side(res, f"trl:{name}", s.rounds) for name in TRL_DIAGNOSTICS
                   if f"trl:{name}" in res.memory}
    return {
        "benchmark": "techniques",
        "command": "python benchmarks/techniques.py " + " ".join(sys.argv[1:]),
        "trl_diagnostics": diagnostics,
        "settings": asdict(s),
        "model": f"tiny llama hidden {s.hidden}, intermediate {s.intermediate}, {s.layers} layers,"
                 f" {s.heads} heads / {s.kv_heads} kv, vocab {s.vocab or 4096}, untied",
        "data": {k: v for k, v in data.items() if k not in ("order", "path")},
        "env": env,
        "method": {
            "memory": f"one run per side, MemTracker (memlab's subclass), memory_steps="
                      f"{s.memory_steps} rule on both sides; peak of tracked steps",
            "speed": f"{s.rounds} round(s), tracker off, tokens/s of steps 1..{s.steps - 1} "
                     "(non-padding tokens / time of forward+backward+optimizer); ratios taken "
                     "within a round, median over rounds",
            "target": "memlab peak <= 0.8x TRL and tokens/s >= 1.2x TRL, same settings",
        },
        "configs": rows,
        "profile": {k: r.get("profile") for k, r in res.profile.items()},
        "runtime_s": round(runtime, 1),
    }


def _fmt(x: Any, spec: str = "8.1f", none: str = "-") -> str:
    if x is None:
        return none.rjust(int(spec.split(".")[0]) if spec[0].isdigit() else 0)
    return format(x, spec)


def print_table(rep: dict[str, Any]) -> None:
    s = rep["settings"]
    print(f"\nmemlab techniques ({rep['model']}; max_length {s['max_length']}, batch "
          f"{s['batch_size']}, {s['steps']} steps; speed: median of {s['rounds']} round(s))")
    hdr = (f"{'config':18s} {'peak MiB':>9s} {'params':>7s} {'grads':>7s} {'optim':>7s} "
           f"{'activ':>7s} {'other':>6s} {'x base':>7s} {'tok/s':>8s} {'x base':>7s} "
           f"{'pad%':>5s}")
    print(hdr)
    print("-" * len(hdr))
    for e in rep["configs"]:
        m = e["memlab"] or {}
        cat = m.get("by_category_mib") or {}
        pad = m.get("padding_fraction")
        print(f"{e['name']:18s} {_fmt(m.get('peak_mib'), '9.1f')} "
              + " ".join(_fmt(cat.get(k), "7.1f") for k in CATEGORIES[:4])
              + f" {_fmt(cat.get('other'), '6.1f')} {_fmt(m.get('peak_vs_baseline'), '7.2f')}"
              f" {_fmt(m.get('tokens_per_s'), '8.1f')} "
              f"{_fmt(m.get('tokens_per_s_vs_baseline'), '7.2f')} "
              f"{_fmt(None if pad is None else 100 * pad, '5.1f')}")
    profiles = {k: p for k, p in (rep.get("profile") or {}).items() if p}
    if profiles:
        from memlab.measure.profile import table

        print(f"\nwhere one step's time goes (self time by kind of work; step "
              f"{next(iter(profiles.values()))['step']})")
        print(table(profiles))
    pairs = [e for e in rep["configs"] if e.get("trl")]
    for name, d in (rep.get("trl_diagnostics") or {}).items():
        if d and d.get("peak_mib"):
            print(f"TRL diagnostic {name}: peak {d['peak_mib']:.1f} MiB (activations "
                  f"{d['by_category_mib']['activations']:.1f})")
    if not pairs:
        return
    print(f"\nmemlab vs TRL {rep['env'].get('trl', '')} SFTTrainer (same model, data, batches, "
          "steps, optimizer, schedule; target: peak <= 0.80x, tok/s >= 1.20x)")
    hdr = (f"{'memlab config':18s} {'TRL config':14s} {'TRL MiB':>8s} {'TRL act':>8s} "
           f"{'TRL tok/s':>9s} {'peak m/T':>8s} {'tok/s m/T':>9s} {'mem':>4s} {'speed':>5s} "
           f"{'dloss0':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for e in pairs:
        t = e["trl"] or {}
        c = e.get("memlab_over_trl") or {}

        def yn(v):
            return "-" if v is None else ("yes" if v else "no")

        print(f"{e['name']:18s} {e['trl_config']:14s} {_fmt(t.get('peak_mib'), '8.1f')} "
              f"{_fmt((t.get('by_category_mib') or {}).get('activations'), '8.1f')} "
              f"{_fmt(t.get('tokens_per_s'), '9.1f')} {_fmt(c.get('peak'), '8.2f')} "
              f"{_fmt(c.get('tokens_per_s'), '9.2f')} {yn(c.get('target_memory_met')):>4s} "
              f"{yn(c.get('target_speed_met')):>5s} {_fmt(c.get('loss_first_diff'), '7.4f')}")


if __name__ == "__main__":
    sys.exit(main())
