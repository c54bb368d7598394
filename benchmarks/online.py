"""memlab's online methods against TRL's ``GRPOTrainer`` and ``RLOOTrainer``, side by side in one
invocation: peak memory (exact, the same tracker on both sides), time per step (ratios of runs
made side by side, with their spread) and, on one replayed rollout, the loss and gradients
(memlab's and TRL's must agree: neither side wins by doing different work).

What runs (the same everywhere):

* model: memlab's tiny Qwen2 (``model=tiny model.arch=qwen2``): hidden 256, intermediate 768,
  4 layers, 4 heads, 2 KV heads, vocab 8192 (memlab's 4096-token BPE tokenizer, unused rows
  above it), random init with seed 0 on both sides (``memlab.model.base.seeded``); fp32, sdpa,
  no gradient checkpointing.
* data: two prompt files the benchmark writes (conversational ``prompt`` rows, one user turn of
  synthetic text cut to a drawn token count): ``short`` (median ~45 prompt tokens) and ``long``
  (lognormal lengths, median ~160, p99 ~1,200, the longest ~3,300 prompt tokens; fixed seed).
  Both sides train on the same 20 prompts in the same order (memlab's ``BatchStream``
  permutation; TRL's sampler is replaced by it, each prompt repeated ``num_generations`` times):
  the longest prompt of the long file is placed so that it comes up in step 2. No prompt is
  truncated on either side (TRL 1.16 has no ``max_prompt_length``; memlab runs with
  ``method.max_prompt_length=null``).
* training: 5 steps of 4 prompts x 4 completions (``num_generations=4``), at most 64 new tokens
  at temperature 1, transformers' ``generate`` (no vLLM), a length reward (``reward_chars``:
  ``-|characters - 200| / 200`` of the decoded completion: distinct per completion, so groups
  train), beta 0 (no reference model), GRPO with ``loss_type=dapo`` / RLOO without advantage
  normalisation, AdamW lr 1e-4 cosine without warm-up, max_grad_norm 1, no accumulation.

memlab configurations: ``default`` (the defaults: each prompt prefilled once for its group; in
training one row per prompt, the prompt stored once and its completions after it, each seeing
the prompt and itself only (``share_prompt``, on where the attention can); the output head at
the completion positions only; completions of advantage exactly 0 left out), ``padding_free``
(``method.padding_free=true``: every group in one row, no padding) and ``unshared``
(``method.share_prompt=false``: TRL's layout, one right-padded row per completion, no mask
under sdpa, the head at the completion positions).

Memory: one run each, under memlab's tracker (``measure.memory_steps=auto``: steps 0 and 1 and
every step whose prompt batch is larger than those before, the long prompt's included; TRL under
the same tracker class, ``memlab.measure.memory.MemoryProbe``, around each ``training_step`` of
the same steps: generation, forward, backward and optimizer step, with memlab's phase names).
Byte-exact and deterministic on the CPU; the tracked steps are reported for both sides.

Time: ``--rounds`` rounds, each run a fresh process; per round every memlab configuration and
its TRL run go in alternating order, the configuration order reversed every other round;
seconds per step = steps 1..4 (step 0 is warm-up) with generation, without collation (memlab:
``throughput.step_time_s``; TRL: ``on_step_begin`` to ``on_step_end``). Reported: each
round's memlab / TRL ratio, median and [min-max] over rounds.

Replay: TRL samples and scores one step's rollout (``_generate_and_score_completions``), memlab
builds its training batch from the same prompts, completions and rewards (its own advantages,
layout and loss), both take the loss and its gradients on identical weights: the losses must
agree within 1e-5 (absolute), the advantages and gradients are reported.

Needs TRL in the python that runs it (``pip install trl==1.16.0``; memlab never imports it).
Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/online.py [--rounds 3] [--quick]
        [--methods grpo,rloo] [--data short,long] [--configs default,shared]
        [--before-src /path/to/other/checkout/src]   # + memlab's defaults from another tree
        [--out benchmarks/results/online.json]
    python benchmarks/online.py --dry-run   # any python: every memlab run validated, none run

``--before-src`` adds a configuration ``before``: memlab's defaults run from another checkout
(its ``src``, ``tests`` helpers and configs), interleaved with the others in every round: a
before / after in one invocation. Writes ``benchmarks/results/online.json``; prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
TARGET_CHARS = 200
METHODS = ("grpo", "rloo")
CONFIGS = {
    "default": [],
    "padding_free": ["method.padding_free=true"],
    "unshared": ["method.share_prompt=false"],
}


def reward_chars(completions: list, **_: Any) -> list[float]:
    """``-|characters - 200| / 200`` of each decoded completion (memlab passes text, TRL a
    conversational completion's messages)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [-abs(len(t) - TARGET_CHARS) / TARGET_CHARS for t in texts]


@dataclass
class Settings:
    hidden: int = 256
    intermediate: int = 768
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 8192
    prompts: int = 4
    generations: int = 4
    new_tokens: int = 64
    steps: int = 5
    lr: float = 1e-4
    seed: int = 0
    rounds: int = 3

    def memlab(self, method: str, data: str, extra: list[str], memory: bool) -> list[str]:
        o = [
            "model=tiny", "model.arch=qwen2", f"model.hidden_size={self.hidden}",
            f"model.intermediate_size={self.intermediate}", f"model.num_layers={self.layers}",
            f"model.num_heads={self.heads}", f"model.num_kv_heads={self.kv_heads}",
            f"model.vocab_size={self.vocab}", "attention=sdpa", "precision=fp32",
            f"method={method}", f"method.num_generations={self.generations}",
            "method.max_prompt_length=null", f"method.max_completion_length={self.new_tokens}",
            "method.beta=0.0", "method.temperature=1.0", "method.rewards=[online:reward_chars]",
            "data=local", f"data.path={data}",
            f"train.batch_size={self.prompts}", f"train.steps={self.steps}",
            f"train.lr={self.lr}", f"train.seed={self.seed}", "train.grad_accum=1",
            "optimizer=adamw", "train.scheduler=cosine", "train.warmup_steps=0",
            "train.weight_decay=0.0", "train.max_grad_norm=1.0",
            "train.gradient_checkpointing=false", "train.device=cpu", "train.progress=false",
            "measure.warmup_steps=1",
        ]
        if method == "grpo":
            o.append("method.loss_type=dapo")
        o += (["measure.memory=true", "measure.memory_steps=auto"] if memory
              else ["measure.memory=false"])
        return o + extra


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------

DATA = {  # name -> (rows, median tokens, sigma, longest, seed of the lengths)
    "short": (200, 40, 0.5, 150, 1234),
    "long": (200, 150, 0.87, 3300, 68),
}


def write_data(name: str, s: Settings, workdir: Path) -> dict[str, Any]:
    """The prompt file (module docstring) and the prompt-token statistics of the file and of
    the prompts trained on."""
    from memlab.data.assets import load_tokenizer
    from memlab.data.synthetic import generate_text
    from memlab.trainer.batch import BatchStream

    n, median, sigma, longest, seed = DATA[name]
    tok = load_tokenizer()
    rng = random.Random(seed)
    lengths = [min(longest, max(8, round(rng.lognormvariate(math.log(median), sigma))))
               for _ in range(n)]
    lengths[max(range(n), key=lengths.__getitem__)] = longest
    pool: list[int] = []
    for doc in generate_text(64, seed=7, median_tokens=3000, max_tokens=6000):
        pool += tok(doc["text"] + "\n\n", add_special_tokens=False)["input_ids"]
    texts, at = [], 0
    for k in lengths:
        if at + k > len(pool):
            at = 0
        texts.append(tok.decode(pool[at:at + k]).strip())
        at += k
    order = BatchStream(list(range(n)), s.prompts, s.seed, None)._permutation(0)
    trained = order[: s.steps * s.prompts]
    top = max(range(n), key=lengths.__getitem__)
    slot = trained[2 * s.prompts + 1]  # step 2, second prompt
    texts[top], texts[slot] = texts[slot], texts[top]
    rows = [{"prompt": [{"role": "user", "content": t}]} for t in texts]
    path = workdir / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = [len(tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=True,
                                          add_generation_prompt=True)["input_ids"])
              for r in rows]

    def stats(xs: list[int]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median": statistics.median(xs), "p99": xs[min(len(xs) - 1,
                                                               int(0.99 * len(xs)))],
                "max": xs[-1], "mean": statistics.fmean(xs)}

    keys = [(s.prompts, max(tokens[i] for i in step), sum(tokens[i] for i in step))
            for step in (trained[k: k + s.prompts] for k in range(0, len(trained), s.prompts))]
    return {"path": str(path), "rows": n, "prompt_tokens": stats(tokens),
            "tracked_steps": auto_tracked(keys),
            "trained_prompt_tokens": stats([tokens[i] for i in trained]),
            "trained_order": trained,
            "longest_at": {"step": trained.index(slot) // s.prompts,
                           "tokens": tokens[slot]}}


def auto_tracked(keys: list[tuple[int, ...]]) -> list[int]:
    """The steps ``measure.memory_steps=auto`` tracks for prompt batches of size keys ``keys``
    (memlab's rule, ``Trainer._tracked``: steps 0 and 1, then any step whose key grows past
    the largest tracked from step 1 on), applied to TRL's steps too."""
    out, top = [], ()
    for step, key in enumerate(keys):
        if step < 2 or not top or any(k > m for k, m in zip(key, top, strict=False)):
            out.append(step)
            if step >= 1:
                top = tuple(max(a, b) for a, b in zip(key, top or key, strict=False))
    return out


# --------------------------------------------------------------------------------------------
# workers (each run is a fresh process)
# --------------------------------------------------------------------------------------------


def _worker_env() -> None:
    for k, v in {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                 "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                 "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true",
                 "TRANSFORMERS_VERBOSITY": "error"}.items():
        os.environ.setdefault(k, v)
    import torch

    torch.set_num_threads(1)


def memlab_job(req: dict[str, Any]) -> dict[str, Any]:
    """One memlab run in this process (``run_job`` of the tests' helpers)."""
    from memlab_testing import run_job

    s = Settings(**req["settings"])
    overrides = s.memlab(req["method"], req["data"], req["extra"], req["mode"] == "memory")
    summary = run_job(Path(req["dir"]), overrides, fast=False, name="run")
    out: dict[str, Any] = {"status": summary["status"], "error": summary.get("error")}
    if summary["status"] != "ok":
        return out
    thr, tr = summary.get("throughput") or {}, summary.get("train") or {}
    out.update(step_time_s=thr.get("step_time_s"), losses=tr.get("loss_curve"),
               skipped=(tr.get("curves") or {}).get("completions/skipped"))
    mem = summary.get("memory") or {}
    if req["mode"] == "memory" and mem:
        out.update(peak_bytes=mem["peak_bytes"], by_category=mem["by_category"],
                   by_phase=mem["by_phase"], peak_at=mem["peak_at"],
                   tracked_steps=mem["tracked_steps"])
    return out


def _trl_model(s: Settings, tok, attention: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    from memlab.model.base import finish_load, seeded
    from memlab.model.tiny import Tiny

    tiny = Tiny(arch="qwen2", hidden_size=s.hidden, intermediate_size=s.intermediate,
                num_layers=s.layers, num_heads=s.heads, num_kv_heads=s.kv_heads,
                vocab_size=s.vocab)
    with seeded(s.seed):
        model = AutoModelForCausalLM.from_config(tiny.hf_config(tok), dtype=torch.float32,
                                                 attn_implementation=attention)
    model = finish_load(model, tok, "causal_lm")
    # memlab's tiny config turns the KV cache off for training (memlab's generate asks for it);
    # TRL's generate reads the model's setting: give it the cache, as any pretrained model has
    model.config.use_cache = True
    model.generation_config.use_cache = True
    return model


def _trl_trainer(method: str, s: Settings, model, tok, ds, order: list[int], out_dir: str,
                 callbacks: list, probe=None, state: dict | None = None,
                 tracked: list[int] | None = None):
    """TRL's GRPOTrainer / RLOOTrainer with the benchmark's settings, reading the prompts in
    ``order`` (each ``num_generations`` times in a row); with ``probe``, every training step
    runs under memlab's tracker with memlab's phases."""
    import torch
    from _trl_probe import watch_trainer
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    common = dict(
        output_dir=out_dir, max_steps=s.steps, per_device_train_batch_size=s.prompts *
        s.generations, gradient_accumulation_steps=1, num_generations=s.generations,
        max_completion_length=s.new_tokens, temperature=1.0, top_p=1.0, beta=0.0,
        learning_rate=s.lr, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        optim="adamw_torch", seed=s.seed, data_seed=s.seed, use_cpu=True, bf16=False,
        fp16=False, gradient_checkpointing=False, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    if method == "grpo":
        cfg_cls, trainer_cls, extra = GRPOConfig, GRPOTrainer, {"loss_type": "dapo"}
    else:
        cfg_cls, trainer_cls, extra = RLOOConfig, RLOOTrainer, {"normalize_advantages": False}
    args = cfg_cls(**common, **extra)
    g = s.generations
    state = state if state is not None else {}

    class Bench(trainer_cls):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, dataset=None):
            return [i for i in order for _ in range(g)]

        def _generate_and_score_completions(self, inputs):
            with probe.phase("generate") if probe else contextlib.nullcontext():
                return super()._generate_and_score_completions(inputs)

        def training_step(self, model, inputs, num_items_in_batch=None):
            if probe is None:
                return super().training_step(model, inputs, num_items_in_batch)
            watch_trainer(probe, self, model)
            stack = contextlib.ExitStack()
            step = state.setdefault("step", 0)
            state["step"] = step + 1
            tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)] \
                if isinstance(inputs, dict) else []
            stack.enter_context(probe.step(step, tracked is None or step in tracked, tensors))
            state["stack"] = stack
            loss = super().training_step(model, inputs, num_items_in_batch)
            stack.enter_context(probe.phase("optimizer"))  # clip + step + zero_grad
            return loss

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            with probe.phase("forward") if probe else contextlib.nullcontext():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return Bench(model=model, args=args, train_dataset=ds, processing_class=tok,
                 reward_funcs=reward_chars, callbacks=callbacks)


def trl_job(req: dict[str, Any]) -> dict[str, Any]:
    """One TRL run in this process."""
    import datasets
    from transformers import TrainerCallback

    from memlab.data.assets import load_tokenizer
    from memlab.measure.memory import MemoryProbe

    s = Settings(**req["settings"])
    tok = load_tokenizer()
    rows = [json.loads(line) for line in Path(req["data"]).read_text().splitlines()]
    ds = datasets.Dataset.from_list(rows)
    model = _trl_model(s, tok)
    probe = MemoryProbe("cpu") if req["mode"] == "memory" else None
    rec: dict[str, Any] = {"dt": [], "losses": [], "t0": 0.0}
    state: dict[str, Any] = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            rec["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            rec["dt"].append(time.perf_counter() - rec["t0"])
            if state.get("stack") is not None:
                state["stack"].close()
                state["stack"] = None

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                rec["losses"].append(float(logs["loss"]))

    trainer = _trl_trainer(req["method"], s, model, tok, ds, req["order"], req["dir"],
                           [Timer()], probe, state, req.get("tracked"))
    trainer.train()
    timed = rec["dt"][1:]
    out: dict[str, Any] = {"status": "ok", "step_time_s": sum(timed) / max(1, len(timed)),
                           "losses": rec["losses"]}
    if probe is not None:
        mem = probe.result()
        out.update(peak_bytes=mem["peak_bytes"], by_category=mem["by_category"],
                   by_phase=mem["by_phase"], peak_at=mem["peak_at"],
                   tracked_steps=mem["tracked_steps"])
    return out


def replay_job(req: dict[str, Any]) -> dict[str, Any]:
    """TRL samples and scores one step's rollout; memlab trains on the same completions and
    rewards; both take the loss and gradients on identical weights (module docstring)."""
    import types

    import datasets
    import torch

    from memlab.attention._varlen import register
    from memlab.data.assets import load_tokenizer
    from memlab.generation.base import samples_from
    from memlab.method.base import Batch
    from memlab.registry import lookup

    s = Settings(**req["settings"])
    tok = load_tokenizer()
    rows = [json.loads(line) for line in Path(req["data"]).read_text().splitlines()]
    ds = datasets.Dataset.from_list(rows)
    model = _trl_model(s, tok)
    trainer = _trl_trainer(req["method"], s, model, tok, ds, req["order"], req["dir"], [])
    g = s.generations
    prompts = [ds[i] for i in req["order"][: s.prompts] for _ in range(g)]
    torch.manual_seed(s.seed)
    inputs = trainer._generate_and_score_completions(prompts)
    trl_model = trainer.model
    register()  # memlab's model: built the same way (TRL patches the forward of its own)
    ours = _trl_model(s, tok, "memlab_sdpa_varlen")
    ours.train()
    same = all(torch.equal(a, b) for a, b in zip(trl_model.state_dict().values(),
                                                  ours.state_dict().values(), strict=True))

    def grads(m) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}

    trl_model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # what train() sets
    trl_loss = trainer.compute_loss(trl_model, inputs)
    trl_loss.backward()
    trl_grads = grads(trl_model)

    pid, pmask = inputs["prompt_ids"], inputs["prompt_mask"]
    comp = inputs["completion_ids"] * inputs["completion_mask"]
    samples = samples_from(comp.masked_fill(inputs["completion_mask"] == 0, tok.pad_token_id),
                           tok.eos_token_id, tok.pad_token_id)
    texts = tok.batch_decode(samples.token_ids, skip_special_tokens=True)
    rewards = torch.tensor(reward_chars(texts), dtype=torch.float32)
    prompt_lists = [[t for t, m in zip(r, mr, strict=True) if m]
                    for r, mr in zip(pid[::g].tolist(), pmask[::g].tolist(), strict=True)]
    out: dict[str, Any] = {"status": "ok", "same_weights": same,
                           "trl_loss": float(trl_loss.detach()),
                           "completion_tokens": int(inputs["completion_mask"].sum()),
                           "configs": {}}
    attention = lookup("attention", "sdpa")()
    ctx = types.SimpleNamespace(attention=attention)
    method_cls = lookup("method", req["method"])
    for name, extra in CONFIGS.items():
        if name == "before":  # another tree's code: not importable here
            continue
        knobs = dict(x.removeprefix("method.").split("=") for x in extra)
        kw = {k: v == "true" for k, v in knobs.items()}
        m = method_cls(num_generations=g, max_completion_length=s.new_tokens, beta=0.0,
                       max_prompt_length=None, **kw,
                       **({"loss_type": "dapo"} if req["method"] == "grpo" else {}))
        batch = Batch({"prompt_ids": pid[::g]}, num_items=0, real_tokens=0, total_tokens=0,
                      meta={"prompt_ids": prompt_lists, "pad": tok.pad_token_id})
        train = m.training_batch({"policy": ours}, batch, samples, rewards.clone(), {}, ctx)
        ours.zero_grad()
        loss_sum, _ = m.loss({"policy": ours}, train, ctx)
        loss = loss_sum / train.num_items
        loss.backward()
        mine = grads(ours)
        diff = max(float((mine[n] - gt).abs().max()) for n, gt in trl_grads.items())
        scale = max(float(gt.abs().max()) for gt in trl_grads.values())
        out["configs"][name] = {
            "loss": float(loss.detach()),
            "loss_diff": abs(float(loss.detach()) - out["trl_loss"]),
            "advantages_max_diff": float((train.tensors["advantages"].float()
                                          - inputs["advantages"].float()).abs().max()),
            "grad_max_abs_diff": diff, "grad_max_abs": scale,
            "num_items": train.num_items}
    return out


def worker_main(kind: str, req_path: str) -> None:
    _worker_env()
    req = json.loads(Path(req_path).read_text())
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # reward_chars as online:...
    tests = req.get("tests")
    if tests:
        sys.path.insert(0, tests)
    job = {"memlab": memlab_job, "trl": trl_job, "replay": replay_job}[kind]
    try:
        out = job(req)
    except Exception as e:  # noqa: BLE001 - reported in the results
        import traceback

        out = {"status": "error", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-3000:]}
    Path(req["out"]).write_text(json.dumps(out))


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def run_fresh(kind: str, req: dict[str, Any], workdir: Path, memlab_src: str | None
              ) -> dict[str, Any]:
    """One run in a fresh python process (memlab from ``memlab_src``: another checkout's
    ``src``, with its ``tests`` helpers and configs; None: this one)."""
    d = Path(tempfile.mkdtemp(dir=workdir))
    req = {**req, "dir": str(d), "out": str(d / "out.json")}
    env = dict(os.environ)
    src = memlab_src or str(REPO / "src")
    req["tests"] = str(Path(src).resolve().parent / "tests")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    (d / "req.json").write_text(json.dumps(req))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, str(d / "req.json")],
                          env=env, capture_output=True, text=True)
    if not (d / "out.json").exists():
        return {"status": "crashed", "error": proc.stderr[-3000:]}
    out = json.loads((d / "out.json").read_text())
    out["wall_s"] = time.perf_counter() - t0
    if out.get("status") != "ok":
        print(f"  !! {kind} {req.get('method')} {req.get('extra', '')}: {out.get('error')}\n"
              f"{out.get('traceback', '')}", flush=True)
    return out


def dry_run(methods: list[str], datas: list[str], configs: list[str], s: Settings) -> int:
    """Every kind of memlab run (each method with each config; memory and speed) composed and
    validated, on a one-prompt file in place of the generated ones; nothing run."""
    from _dry_run import TRL_MISSING, check, done, show, trl_importable

    bad, problems = 0, [f"unknown data {d!r}" for d in datas if d not in DATA]
    problems += [f"unknown config {c!r}" for c in configs if c not in CONFIGS]
    problems += [f"unknown method {m!r}" for m in methods if m not in METHODS]
    if problems:
        return done("online", 0, problems)
    with tempfile.TemporaryDirectory(prefix="memlab-online-dry-") as tmp:
        # the data files differ only in their prompts, memory and speed runs only in measure.*:
        # each method with each config (memory) and with the first (speed)
        path = Path(tmp) / "prompts.jsonl"
        path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
        cases = [(f"{m} {c} {mode}", s.memlab(m, str(path), CONFIGS[c], mode == "memory"))
                 for m in methods for c, mode in [*((c, "memory") for c in configs),
                                                  (configs[0], "speed")]]
        bad = check("online", cases)
    for name, overrides in cases[:1]:
        show("online", name, ["memlab", *overrides])
    if trl_importable():
        import trl  # noqa: F401  (TRL's trainers are built per run, in the worker)
        print(f"  [online] trl {trl.__version__}: GRPO / RLOO sides built in the workers")
    else:
        print(f"  [online] {TRL_MISSING}")
    return done("online", bad)


def ratio_stats(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "REQ"), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--data", default="short,long")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="1 round, long data, grpo only")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--before-src", default=None,
                    help="also run memlab's defaults from this checkout's src ('before')")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "online.json"))
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate every memlab run; run nothing")
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(*a.worker)
        return 0
    s = Settings(rounds=1 if a.quick else a.rounds)
    methods = ["grpo"] if a.quick else a.methods.split(",")
    datas = ["long"] if a.quick else a.data.split(",")
    configs = a.configs.split(",")
    if a.dry_run:
        return dry_run(methods, datas, configs, s)
    srcs = {c: None for c in configs}
    if a.before_src:  # the defaults of another tree (it may not know the new knobs)
        configs.append("before")
        srcs["before"] = a.before_src
        CONFIGS["before"] = []
    workdir = Path(tempfile.mkdtemp(prefix="memlab-online-"))
    _worker_env()
    t_start = time.perf_counter()
    data = {d: write_data(d, s, workdir) for d in datas}
    for d, info in data.items():
        print(f"[{d}] prompt tokens: file {info['prompt_tokens']}, trained "
              f"{info['trained_prompt_tokens']}, longest at step "
              f"{info['longest_at']['step']}", flush=True)
    base = {"settings": asdict(s)}
    results: dict[str, Any] = {"memory": {}, "speed": {}, "replay": {}}
    cases = [(m, d) for d in datas for m in methods]
    if not a.no_replay:
        for m, d in cases:
            r = run_fresh("replay", {**base, "method": m, "data": data[d]["path"],
                                     "order": data[d]["trained_order"]}, workdir, None)
            results["replay"][f"{m}/{d}"] = r
            print(f"[replay {m}/{d}] {json.dumps({k: v for k, v in r.items() if k != 'traceback'})}",
                  flush=True)
    if not a.no_memory:
        for m, d in cases:
            req = {**base, "method": m, "data": data[d]["path"], "mode": "memory",
                   "order": data[d]["trained_order"], "tracked": data[d]["tracked_steps"]}
            row = {"trl": run_fresh("trl", req, workdir, None)}
            for c in configs:
                row[c] = run_fresh("memlab", {**req, "extra": CONFIGS[c]}, workdir, srcs[c])
            results["memory"][f"{m}/{d}"] = row
            print(f"[memory {m}/{d}] " + ", ".join(
                f"{k}: {v.get('peak_bytes', 0) / MIB:.1f} MiB" for k, v in row.items()),
                flush=True)
    for rnd in range(s.rounds):
        order = cases if rnd % 2 == 0 else cases[::-1]
        for m, d in order:
            req = {**base, "method": m, "data": data[d]["path"], "mode": "speed",
                   "order": data[d]["trained_order"]}
            runs: dict[str, Any] = {}
            sides = [("trl", None), *((c, c) for c in configs)]
            if rnd % 2:
                sides = sides[::-1]
            for name, c in sides:
                runs[name] = (run_fresh("trl", req, workdir, None) if c is None else
                              run_fresh("memlab", {**req, "extra": CONFIGS[c]}, workdir,
                                        srcs[c]))
            results["speed"].setdefault(f"{m}/{d}", []).append(runs)
            print(f"[speed round {rnd} {m}/{d}] " + ", ".join(
                f"{k}: {v.get('step_time_s') or float('nan'):.2f} s/step"
                for k, v in runs.items()), flush=True)
    table = summarize(results, configs)
    out = {"settings": asdict(s), "data": {k: {x: y for x, y in v.items() if x != "path"}
                                            for k, v in data.items()},
           "before_src": a.before_src, "machine": machine(),
           "wall_s": time.perf_counter() - t_start, "table": table, "runs": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(markdown(table, configs))
    print(f"wrote {a.out}")
    return 0


def machine() -> dict[str, Any]:
    import torch
    import transformers

    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl_version,
            "cpus": os.cpu_count(), "loadavg_at_end": load}


def summarize(results: dict[str, Any], configs: list[str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for case in sorted(set(results["memory"]) | set(results["speed"])):
        row: dict[str, Any] = {}
        mem = results["memory"].get(case, {})
        trl_peak = mem.get("trl", {}).get("peak_bytes")
        if trl_peak:
            row["trl_peak_mib"] = trl_peak / MIB
        rounds = results["speed"].get(case, [])
        trl_times = [r["trl"].get("step_time_s") for r in rounds]
        if trl_times:
            row["trl_step_s"] = ratio_stats(trl_times)
        for c in configs:
            peak = mem.get(c, {}).get("peak_bytes")
            times = [r[c].get("step_time_s") for r in rounds]
            ratios = [m / t for m, t in zip(times, trl_times, strict=True) if m and t]
            row[c] = {"peak_mib": None if peak is None else peak / MIB,
                      "peak_ratio": None if not (peak and trl_peak) else peak / trl_peak,
                      "step_s": ratio_stats(times), "time_ratio": ratio_stats(ratios)}
        rep = results["replay"].get(case)
        if rep and rep.get("status") == "ok":
            row["replay_loss_diff"] = {c: v["loss_diff"] for c, v in rep["configs"].items()}
        table[case] = row
    return table


def markdown(table: dict[str, Any], configs: list[str]) -> str:
    lines = ["| method / prompts | TRL peak | TRL s/step | " + " | ".join(
        f"memlab {c}: peak (x TRL) | {c}: s/step x TRL [min-max]" for c in configs) + " |",
        "|---|---|---|" + "---|---|" * len(configs)]
    for case, row in table.items():
        cells = [case, f"{row.get('trl_peak_mib', float('nan')):.0f} MiB",
                 f"{(row.get('trl_step_s') or {}).get('median', float('nan')):.2f}"]
        for c in configs:
            r = row[c]
            peak = (f"{r['peak_mib']:.0f} MiB ({r['peak_ratio']:.2f}x)"
                    if r["peak_mib"] is not None and r["peak_ratio"] is not None else "-")
            tr = r["time_ratio"]
            cells += [peak, f"{tr['median']:.2f}x [{tr['min']:.2f}-{tr['max']:.2f}]"
                      if tr else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
