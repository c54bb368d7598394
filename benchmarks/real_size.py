"""memlab against TRL at real size: real architectures with random weights, side by side.

What runs: the architecture of a shipped config (``src/memlab/assets/model_configs``: Qwen2.5-0.5B;
Qwen2.5-1.5B-Instruct for the LoRA / 8-bit rows) built with random weights on both sides the
same way (memlab's ``model=tiny`` with the config's sizes, ``arch=qwen2``, tied embeddings,
vocab 151,936; TRL gets the very model memlab's loader builds, same seed, same weights; the
parameter count is checked against ``AutoModelForCausalLM.from_config`` of the shipped
config.json), fp32 weights trained in bf16 mixed precision (both defaults: memlab's
``precision=auto``, TRL's ``bf16=True``; the ``fp32_both`` row trains both in fp32), sdpa,
gradient checkpointing, 2 rows of 512 tokens (the ``long_*`` cases: 1 row of 4,096, where
the activations grow and the model states do not) with a
label on every token (plain text, memlab's shipped tokenizer; both sides tokenize each row to
the same first ``--length`` ids, checked), batch = all rows, lr 2e-5 cosine, AdamW's defaults.
TRL 1.16's ``SFTTrainer`` reads memlab's batch order through its sampler.

Each case is one memlab configuration and the TRL configuration it is compared with:

- memory (byte-exact on CPU, one run each, ``--memory-steps`` steps every one tracked): memlab's
  own tracker (``measure.memory_steps=all``) and, for TRL, the same tracker class entered around
  each of its steps (forward, backward, optimizer step), with TRL's model and optimizer watched;
- speed: ``--rounds`` rounds, in each one run of every configuration, memlab and TRL of a case
  one after the other (the order alternating), each in a fresh process (``--speed-steps`` steps,
  the first left out); tokens/s as the memlab / TRL ratio within a round, the median and the
  range over the rounds;
- losses: memlab's exact rows (in-backward) against memlab's standard step with the same
  settings, step for step (``dloss_vs_reference``: must stay within 1e-5);
- the floor: the model states a configuration cannot avoid (its parameters and its optimizer's
  state, from the tracker's categories at the peak), and each peak's distance to it.

``--curves`` adds the loss-curve check of 8-bit AdamW: 50 steps of memlab's default model
(tiny, 4 layers) with fp32 AdamW, 8-bit AdamW (embeddings' states 8-bit, memlab's default; and
32-bit, transformers' default) and TRL's ``optim="adamw_bnb_8bit"``; the largest step-by-step
difference of each curve to its reference.

Usage (TRL 1.16 importable: ``.venv-trl``, benchmarks/README.md says how to make it;
bitsandbytes for the 8-bit rows: ``bash scripts/setup_cpu_kernels.sh``, whose dir goes on the
8-bit runs' PYTHONPATH)::

    .venv-trl/bin/python benchmarks/real_size.py [--only default,lora] [--rounds 2] [--curves]
    .venv-trl/bin/python benchmarks/real_size.py --skip-speed \
        --only long_default,long_no_clip,long_in_backward,long_in_backward_chunk128 \
        --out benchmarks/results/real_size_long.json                   # the 4,096-token rows
    .venv-trl/bin/python benchmarks/real_size.py --only default,fp32_both --skip-memory \
        --rounds 3 --out benchmarks/results/real_size_speed_bf16.json  # speed only
    python benchmarks/real_size.py --dry-run   # no TRL needed: every memlab run validated

One real-size process runs at a time; before each the script waits until the machine has the
memory the run needs (``--need-gib``). ~3 h for everything on 2 shared cores. Writes
``benchmarks/results/real_size.json`` and prints the Markdown table of docs/trl.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
KERNELS = REPO / ".cpu-kernels"
SIZES = {  # memlab's model=tiny knobs for each shipped config (checked against its config.json)
    "Qwen2.5-0.5B": "Qwen2.5-0.5B",
    "Qwen2.5-1.5B": "Qwen2.5-1.5B-Instruct",
}


@dataclass
class Case:
    name: str
    model: str
    memlab: list[str]
    trl: dict[str, Any] | None
    what: str
    reference: str | None = None
    """The memlab case whose loss curve this one must equal (an exact technique)."""
    need_gib: float = 10.0
    """Free memory (GiB) a run of this case needs, memlab's or TRL's."""
    kernels: bool = False
    """bitsandbytes on the path (8-bit rows)."""
    speed: bool = True
    rows: int | None = None
    """Rows of the batch (None: ``Settings.rows``)."""
    length: int | None = None
    """Tokens a row (None: ``Settings.length``)."""
    baseline: str = "default"
    """The case whose TRL run is "TRL's default" for this one (same rows and length)."""


NOCLIP = ["train.max_grad_norm=null"]
EXACT = ["optimizer.in_backward=true", *NOCLIP]
BF16 = "precision=bf16_mixed"
"""What both defaults are on a GPU and on a CPU with bf16 kernels (memlab's ``auto``, TRL's
``bf16=True``), pinned so that the rows do not depend on the machine; the ``*_fp32_both``
rows pin fp32 on both sides."""
CASES = [
    Case("default", "Qwen2.5-0.5B", [BF16], {}, "both defaults (AdamW, clipping at 1.0)"),
    Case("lora", "Qwen2.5-0.5B", [BF16, "peft=lora"], {"lora": True},
         "LoRA r 16, all linear layers; both defaults otherwise", need_gib=6),
    Case("fp32_both", "Qwen2.5-0.5B", ["precision=fp32"], {"bf16": False},
         "both in fp32 (memlab precision=fp32, TRL bf16=False; both defaults are bf16 mixed)"),
    Case("lora_fp32_both", "Qwen2.5-0.5B", ["peft=lora", "precision=fp32"],
         {"lora": True, "bf16": False}, "LoRA, both in fp32 (memlab's default on a CPU without "
         "bf16 kernels; TRL's bf16 default is emulated there)", need_gib=6),
    Case("no_clip", "Qwen2.5-0.5B", [BF16, *NOCLIP], {"max_grad_norm": None},
         "no clipping (the reference of the in-backward rows)"),
    Case("in_backward", "Qwen2.5-0.5B", [BF16, *EXACT], {"max_grad_norm": None},
         "exact options: in-backward step, chunked loss, labelled head; no clipping",
         reference="no_clip"),
    Case("in_backward_fused", "Qwen2.5-0.5B", [BF16, *EXACT],
         {"max_grad_norm": None, "optim": "adamw_torch_fused"},
         "exact options with memlab's default fused AdamW kernel against TRL's "
         "adamw_torch_fused (the same kernel on both sides)", reference="no_clip"),
    Case("default_foreach", "Qwen2.5-0.5B", [BF16, "optimizer.fused=false"], {},
         "memlab's former default optimizer (torch's AdamW loop: a temporary of the largest "
         "parameter in the step; TRL's optim=adamw_torch)"),
    Case("8bit_in_backward", "Qwen2.5-0.5B", [BF16, "optimizer=adamw_8bit", *EXACT],
         {"max_grad_norm": None, "optim": "adamw_bnb_8bit"},
         "+ 8-bit AdamW (TRL: adamw_bnb_8bit, embeddings' states fp32 as transformers keeps "
         "them)", kernels=True),
    Case("1.5b_lora", "Qwen2.5-1.5B", [BF16, "peft=lora"], {"lora": True},
         "Qwen2.5-1.5B, LoRA, both defaults otherwise", need_gib=10),
    Case("1.5b_lora_fp32_both", "Qwen2.5-1.5B", ["peft=lora", "precision=fp32"],
         {"lora": True, "bf16": False}, "Qwen2.5-1.5B, LoRA, both in fp32 (memlab's default "
         "on a CPU without bf16 kernels, where TRL's bf16 default is emulated)", need_gib=10,
         speed=False),
    Case("1.5b_8bit_in_backward", "Qwen2.5-1.5B", [BF16, "optimizer=adamw_8bit", *EXACT], None,
         "Qwen2.5-1.5B, 8-bit AdamW in backward (memlab only: TRL's 8-bit run holds every "
         "gradient, ~17 GiB with the model)", need_gib=13, kernels=True, speed=False),
    # one long row: activations (checkpointed layers' inputs, the recomputed layer, the loss's
    # chunk, attention) grow with the tokens, the model states do not (memory only)
    Case("long_default", "Qwen2.5-0.5B", [BF16], {},
         "1 row of 4,096 tokens: both defaults (AdamW, clipping at 1.0)", rows=1, length=4096,
         need_gib=16, speed=False, baseline="long_default"),
    Case("long_no_clip", "Qwen2.5-0.5B", [BF16, *NOCLIP], None,
         "1 row of 4,096 tokens: memlab's default without clipping (the reference of "
         "long_in_backward's losses)", rows=1, length=4096, need_gib=12, speed=False,
         baseline="long_default"),
    Case("long_in_backward", "Qwen2.5-0.5B", [BF16, *EXACT], None,
         "1 row of 4,096 tokens: memlab's lowest-memory exact options (in-backward step, "
         "no clipping; chunked loss and labelled head are defaults) against TRL's default",
         reference="long_no_clip", rows=1, length=4096, need_gib=12, speed=False,
         baseline="long_default"),
    Case("long_in_backward_chunk128", "Qwen2.5-0.5B", [BF16, *EXACT, "method.chunk_size=128"],
         None, "1 row of 4,096 tokens: the same with the loss's chunk at 128 tokens (a 74 MiB "
         "fp32 block instead of 256; the same sums in other groupings)",
         reference="long_no_clip", rows=1, length=4096, need_gib=12, speed=False,
         baseline="long_default"),
]


def settings_of(s: Settings, case: Case) -> Settings:
    """The settings a case runs with: ``s`` with the case's own rows and length."""
    return replace(s, rows=case.rows or s.rows, length=case.length or s.length)


@dataclass
class Settings:
    rows: int = 2
    length: int = 512
    memory_steps: int = 2
    speed_steps: int = 3
    rounds: int = 2
    lr: float = 2e-5
    seed: int = 0
    threads: int = 2


# --------------------------------------------------------------------------------------------
# the model, the data
# --------------------------------------------------------------------------------------------


def tiny_knobs(model: str) -> dict[str, Any]:
    """memlab's ``model=tiny`` knobs that build the shipped config's architecture."""
    cfg = json.loads((REPO / "src/memlab/assets/model_configs" / SIZES[model]
                      / "config.json").read_text())
    assert cfg["model_type"] == "qwen2", cfg["model_type"]
    return {"arch": "qwen2", "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg["intermediate_size"],
            "num_layers": cfg["num_hidden_layers"], "num_heads": cfg["num_attention_heads"],
            "num_kv_heads": cfg["num_key_value_heads"], "vocab_size": cfg["vocab_size"],
            "tie_word_embeddings": cfg["tie_word_embeddings"],
            "max_position_embeddings": cfg["max_position_embeddings"]}


def check_architecture(model: str) -> int:
    """The parameter count of memlab's build equals the shipped config.json's (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    path = REPO / "src/memlab/assets/model_configs" / SIZES[model]
    with torch.device("meta"):
        ours = AutoModelForCausalLM.from_config(Tiny(**tiny_knobs(model)).hf_config(
            load_tokenizer()))
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    n = sum(p.numel() for p in ours.parameters())
    m = sum(p.numel() for p in theirs.parameters())
    assert n == m, f"{model}: memlab's build has {n} parameters, the config {m}"
    return n


def prepare_data(s: Settings, work: Path) -> dict[str, Any]:
    """Text rows of at least ``length + 8`` tokens (every position labelled after truncation);
    memlab's order over them."""
    from memlab.data.assets import load_tokenizer
    from memlab.data.synthetic.text import generate_text
    from memlab.data.text import document_ids

    tok = load_tokenizer()
    need = s.rows * max(s.memory_steps, s.speed_steps, 50)
    rows = [r for r in generate_text(4 * need, seed=s.seed, median_tokens=4 * s.length,
                                     max_tokens=8 * s.length)
            if len(document_ids(tok, r["text"])) >= s.length + 8][:need]
    if len(rows) < need:
        raise RuntimeError("not enough long rows; raise the pool")
    default = Settings()
    path = work / ("text.jsonl" if (s.rows, s.length) == (default.rows, default.length)
                   else f"text-{s.rows}x{s.length}.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"path": str(path), "rows": len(rows)}


# --------------------------------------------------------------------------------------------
# one run (a fresh process each)
# --------------------------------------------------------------------------------------------


DEFAULT_MODEL = {"arch": "llama", "hidden_size": 128, "intermediate_size": 384,
                 "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "vocab_size": None,
                 "tie_word_embeddings": False}
"""memlab's default model (conf/model/tiny.yaml), for the loss curves."""


def memlab_overrides(s: Settings, case: Case, data: str, mode: str, steps: int,
                     knobs: dict[str, Any]) -> list[str]:
    def value(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return [
        "model=tiny", *(f"model.{k}={value(v)}" for k, v in knobs.items()),
        "data=local", f"data.path={data}", "method=sft", "method.loss_on=all",
        f"method.max_length={s.length}", f"train.batch_size={s.rows}", f"train.steps={steps}",
        f"train.lr={s.lr}", f"train.seed={s.seed}", "train.scheduler=cosine",
        "train.warmup_steps=0", "train.progress=false", "measure.warmup_steps=1",
        *(["measure.memory=true", "measure.memory_steps=all"] if mode == "memory"
          else ["measure.memory=false"]),
        *case.memlab,
    ]


def memlab_run(req: dict[str, Any]) -> dict[str, Any]:
    out = Path(req["dir"])
    cmd = [sys.executable, "-m", "memlab", *req["overrides"], f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=req["env"], cwd=REPO)
    if not (out / "summary.json").exists():
        return {"status": "failed", "error": proc.stderr[-3000:]}
    return memlab_result(out, req["mode"])


def memlab_result(out: Path, mode: str) -> dict[str, Any]:
    """What the report keeps of a memlab run's ``summary.json``."""
    s = json.loads((out / "summary.json").read_text())
    mem, thr = s.get("memory") or {}, s.get("throughput") or {}
    return {"status": s["status"], "error": s.get("error"),
            "peak_bytes": mem.get("peak_bytes") if mode == "memory" else None,
            "by_category": mem.get("by_category"), "by_phase": mem.get("by_phase"),
            "peak_at": mem.get("peak_at"), "tokens_per_s": thr.get("tokens_per_s"),
            "by_phase_category": mem.get("by_phase_category"),
            "losses": (s.get("train") or {}).get("loss_curve")}


def free_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(need: float, log) -> None:
    waited = 0
    while free_gib() < need:
        if waited % 300 == 0:
            log(f"  waiting: {free_gib():.1f} GiB free, this run needs {need:.0f} GiB")
        time.sleep(30)
        waited += 30


def run(side: str, s: Settings, case: Case, data: str, mode: str, work: Path, tag: str,
        log, steps: int | None = None, knobs: dict[str, Any] | None = None,
        reuse: bool = False, sides: tuple[str, ...] = ("memlab", "trl")) -> dict[str, Any]:
    """One run of ``case`` on ``side`` in a fresh process (``knobs``: the model's, default
    the case's architecture); ``reuse``: the result of a finished run in ``work`` instead;
    a side not in ``sides`` (and not reused) is skipped."""
    s = settings_of(s, case)
    steps = steps or (s.memory_steps if mode == "memory" else s.speed_steps)
    knobs = knobs or tiny_knobs(case.model)
    env = dict(os.environ, OMP_NUM_THREADS=str(s.threads), MKL_NUM_THREADS=str(s.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", WANDB_DISABLED="true")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), *([str(KERNELS)] if case.kernels else [])])
    d = work / f"{side}-{case.name}-{tag}"
    done = d / ("summary.json" if side == "memlab" else "result.json")
    if reuse and done.exists():  # --reuse: a run an earlier invocation finished in --workdir
        r = (memlab_result(d, mode) if side == "memlab" else json.loads(done.read_text()))
        if r.get("status") == "ok":  # not one that failed or was interrupted
            log(f"  {side:6s} {case.name:22s} {mode:6s} {tag:4s}  reused {d}")
            return r
    if side not in sides:
        return {"status": "skipped"}
    wait_for_memory(case.need_gib, log)
    t0 = time.perf_counter()
    if side == "memlab":
        over = memlab_overrides(s, case, data, mode, steps, knobs)
        r = memlab_run({"dir": str(d), "overrides": over, "mode": mode, "env": env})
    else:
        assert case.trl is not None
        req = {"settings": asdict(s), "trl": case.trl, "knobs": knobs, "data": data,
               "dir": str(d), "mode": mode, "steps": steps}
        job = d.with_suffix(".json")
        d.mkdir(parents=True, exist_ok=True)
        job.write_text(json.dumps(req))
        proc = subprocess.run([sys.executable, __file__, "--job", str(job)], env=env,
                              cwd=REPO, capture_output=True, text=True)
        res = d / "result.json"
        r = (json.loads(res.read_text()) if res.exists()
             else {"status": "failed", "error": proc.stderr[-3000:]})
    r["wall_s"] = time.perf_counter() - t0
    bits = [f"{side:6s} {case.name:22s} {mode:6s} {tag:4s}"]
    if r.get("status") != "ok":
        bits.append(f"FAILED: {str(r.get('error'))[-400:]}")
    if r.get("peak_bytes"):
        bits.append(f"peak {r['peak_bytes'] / MIB:9.1f} MiB")
    if r.get("tokens_per_s") and mode == "speed":
        bits.append(f"{r['tokens_per_s']:7.2f} tok/s")
    if r.get("losses"):
        bits.append("loss " + " ".join(f"{x:.6f}" for x in r["losses"]))
    bits.append(f"({r['wall_s']:.0f} s)")
    log("  " + "  ".join(bits))
    return r


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------


@dataclass
class Results:
    memory: dict[str, dict] = field(default_factory=dict)   # "memlab:<case>" / "trl:<case>"
    speed: dict[str, list[dict]] = field(default_factory=dict)
    curves: dict[str, list[float]] = field(default_factory=dict)


def _mib(x: float | None) -> float | None:
    return None if x is None else round(x / MIB, 1)


def report(s: Settings, cases: list[Case], res: Results, params: dict[str, int]
           ) -> dict[str, Any]:
    rows = []
    for c in cases:
        trl_default = (res.memory.get(f"trl:{c.baseline}") or {}).get("peak_bytes")
        cs = settings_of(s, c)
        m, t = res.memory.get(f"memlab:{c.name}") or {}, res.memory.get(f"trl:{c.name}") or {}
        cat = m.get("by_category") or {}
        # the floor: parameters and optimizer states as a forward holds them (step 1 on: no
        # gradient, no step's temporaries), the model states the configuration cannot avoid
        held = (m.get("by_phase_category") or {}).get("forward") or {}
        floor = (held.get("parameters", 0) + held.get("optimizer", 0)) if held else None
        row: dict[str, Any] = {
            "case": c.name, "model": c.model, "rows": cs.rows, "length": cs.length,
            "baseline": c.baseline, "what": c.what, "memlab": c.memlab,
            "trl": c.trl, "memlab_peak_mib": _mib(m.get("peak_bytes")),
            "memlab_by_category_mib": {k: _mib(v) for k, v in cat.items()},
            "memlab_peak_at": m.get("peak_at"),
            "trl_peak_mib": _mib(t.get("peak_bytes")),
            "trl_by_category_mib": {k: _mib(v) for k, v in (t.get("by_category") or {}).items()},
            "floor_mib": _mib(floor),
            "memlab_over_floor_mib": _mib(m["peak_bytes"] - floor) if floor else None,
            "memlab_losses": m.get("losses"), "trl_losses": t.get("losses"),
        }
        if m.get("peak_bytes") and t.get("peak_bytes"):
            row["peak_ratio"] = round(m["peak_bytes"] / t["peak_bytes"], 3)
            row["trl_over_floor_mib"] = _mib(t["peak_bytes"] - floor) if floor else None
        if m.get("peak_bytes") and trl_default and c.model == "Qwen2.5-0.5B":
            row["peak_ratio_vs_trl_default"] = round(m["peak_bytes"] / trl_default, 3)
        if m.get("losses") and t.get("losses"):
            row["dloss0"] = round(abs(m["losses"][0] - t["losses"][0]), 5)
        ref = res.memory.get(f"memlab:{c.reference}") if c.reference else None
        if ref and ref.get("losses") and m.get("losses"):
            row["dloss_vs_reference"] = max(abs(a - b) for a, b in
                                            zip(m["losses"], ref["losses"], strict=True))
        ms, ts = res.speed.get(f"memlab:{c.name}", []), res.speed.get(f"trl:{c.name}", [])
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ms, ts, strict=False)
                  if a.get("tokens_per_s") and b.get("tokens_per_s")]
        if ratios:
            row["speed_ratio_median"] = round(statistics.median(ratios), 3)
            row["speed_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
            row["memlab_tokens_per_s"] = [round(a["tokens_per_s"], 2) for a in ms
                                          if a.get("tokens_per_s")]
            row["trl_tokens_per_s"] = [round(b["tokens_per_s"], 2) for b in ts
                                       if b.get("tokens_per_s")]
        spd_ref = res.speed.get(f"memlab:{c.reference}") if c.reference else None
        if spd_ref and ms:
            diffs = [max(abs(a - b) for a, b in zip(x["losses"], y["losses"], strict=True))
                     for x, y in zip(ms, spd_ref, strict=False)
                     if x.get("losses") and y.get("losses")]
            if diffs:
                row["dloss_vs_reference_speed_runs"] = max(diffs)
        rows.append(row)
    return {"settings": asdict(s), "parameters": params, "rows": rows, "curves": res.curves,
            "trl": _version("trl"), "torch": _version("torch"),
            "transformers": _version("transformers"), "bitsandbytes": _version("bitsandbytes")}


def trl_from(rep: dict[str, Any], path: Path) -> None:
    """Fill each row without a TRL memory run from ``path``'s row with the same model, rows,
    length and TRL configuration (TRL's side does not change with memlab's code), marked
    ``trl_memory_from``; the ratios are recomputed."""
    old = json.loads(path.read_text())
    shape = old.get("settings") or asdict(Settings())  # rows written before rows / length

    def key(r: dict[str, Any], trl: Any = None) -> str:
        return json.dumps([r["model"], r.get("rows", shape["rows"]),
                           r.get("length", shape["length"]), r["trl"] if trl is None else trl],
                          sort_keys=True)

    before = {key(r): r for r in old.get("rows", []) if r.get("trl_peak_mib") is not None}
    for row in rep["rows"]:
        default = (before.get(key({**row, "model": "Qwen2.5-0.5B"}, {})) or {}).get(
            "trl_peak_mib")
        prev = before.get(key(row)) if row.get("trl") is not None else None
        if row.get("trl_peak_mib") is None and prev:
            for k in ("trl_peak_mib", "trl_by_category_mib", "trl_losses"):
                row[k] = prev.get(k)
            row["trl_memory_from"] = prev.get("trl_memory_from") or (  # (the run's origin)
                f"{path.name} ({prev['case']}): TRL {old.get('trl')}, torch {old.get('torch')}")
        if row.get("memlab_peak_mib") and row.get("trl_peak_mib"):
            row["peak_ratio"] = round(row["memlab_peak_mib"] / row["trl_peak_mib"], 3)
        if row.get("memlab_peak_mib") and default and row["model"] == "Qwen2.5-0.5B":
            row["peak_ratio_vs_trl_default"] = round(row["memlab_peak_mib"] / default, 3)
        if row.get("floor_mib") and row.get("trl_peak_mib"):
            row["trl_over_floor_mib"] = round(row["trl_peak_mib"] - row["floor_mib"], 1)
        if row.get("memlab_losses") and row.get("trl_losses"):
            row["dloss0"] = round(abs(row["memlab_losses"][0] - row["trl_losses"][0]), 5)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def markdown(rep: dict[str, Any]) -> str:
    out = ["| case | memlab peak MiB | TRL peak MiB | memlab / TRL peak | memlab / TRL tokens/s "
           "| floor MiB | memlab over floor |",
           "|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        def f(x, fmt="{:.1f}"):
            return "-" if x is None else fmt.format(x)
        spd = "-"
        if r.get("speed_ratio_median") is not None:
            lo, hi = r["speed_ratio_range"]
            spd = f"{r['speed_ratio_median']:.2f} [{lo:.2f}-{hi:.2f}]"
        ratio = f(r.get("peak_ratio"), "{:.2f}")
        if r.get("peak_ratio_vs_trl_default") is not None and r["case"] != r.get(
                "baseline", "default"):
            ratio += f" ({r['peak_ratio_vs_trl_default']:.2f} of TRL's default)"
        shape = f", {r['rows']} x {r['length']}" if r.get("length") else ""
        out.append(f"| {r['case']} ({r['model']}{shape}) | {f(r['memlab_peak_mib'])} | "
                   f"{f(r['trl_peak_mib'])} | {ratio} | {spd} | {f(r['floor_mib'])} | "
                   f"{f(r['memlab_over_floor_mib'])} |")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# 8-bit AdamW's loss curve
# --------------------------------------------------------------------------------------------


FP32 = ["precision=fp32"]  # both sides in fp32: the curves differ by the optimizer only
CURVES = [Case(name, "tiny", memlab or [], trl, "", need_gib=2, kernels=True)
          for name, memlab, trl in (
              ("memlab_adamw", FP32, None),
              ("memlab_adamw_8bit", [*FP32, "optimizer=adamw_8bit"], None),
              ("memlab_adamw_8bit_emb32", [*FP32, "optimizer=adamw_8bit",
                                           "optimizer.embedding_states_32bit=true"], None),
              ("trl_adamw", None, {"bf16": False}),
              ("trl_adamw_8bit", None, {"optim": "adamw_bnb_8bit", "bf16": False}))]
"""``--curves``: memlab's default model, 50 steps of 4 rows, each optimizer on each side."""


def curves(s: Settings, work: Path, log) -> dict[str, Any]:
    """50 steps of memlab's default model (tiny) with fp32 and 8-bit AdamW, and TRL's
    adamw_torch and adamw_bnb_8bit, on the same rows (4 a step), every run in fp32; the largest
    step-by-step loss differences."""
    tiny = Settings(**{**asdict(s), "rows": 4})
    # rows for 50 steps of 4 in one epoch (TRL's sampler repeats memlab's first permutation)
    (work / "curves").mkdir(exist_ok=True)
    data = prepare_data(tiny, work / "curves")["path"]
    got: dict[str, list[float]] = {}
    for case in CURVES:
        r = run("memlab" if case.trl is None else "trl", tiny, case, data, "speed", work, "c50",
                log, steps=50, knobs=DEFAULT_MODEL)
        got[case.name] = r.get("losses") or []

    def gap(a: str, b: str) -> float | None:
        if not got.get(a) or not got.get(b):
            return None
        return round(max(abs(x - y) for x, y in zip(got[a], got[b], strict=True)), 5)

    return {"losses": got, "max_abs_diff": {
        "memlab 8-bit vs memlab fp32": gap("memlab_adamw_8bit", "memlab_adamw"),
        "memlab 8-bit (embeddings fp32) vs memlab fp32": gap("memlab_adamw_8bit_emb32",
                                                              "memlab_adamw"),
        "memlab 8-bit (embeddings fp32) vs TRL adamw_bnb_8bit": gap("memlab_adamw_8bit_emb32",
                                                                     "trl_adamw_8bit"),
        "TRL adamw_bnb_8bit vs TRL adamw_torch": gap("trl_adamw_8bit", "trl_adamw"),
        "memlab fp32 vs TRL adamw_torch": gap("memlab_adamw", "trl_adamw")}}


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def dry_run(s: Settings, cases: list[Case], sides: tuple[str, ...], with_curves: bool) -> int:
    """Every case's memlab run composed and validated (memory mode; the speed runs differ only
    in ``measure.*``: the first case's), with bitsandbytes assumed where a case puts
    ``.cpu-kernels`` on the path, on a one-row file in place of the generated data; TRL's
    side listed (TRL itself is imported only by its job); nothing run."""
    import dataclasses

    from _dry_run import TRL_MISSING, check, done, show, trl_importable

    from memlab.config import Platform

    here = Platform.detect()
    kernels = dataclasses.replace(here, assume_installed=here.assume_installed
                                  | {"bitsandbytes"})
    bad = 0
    with tempfile.TemporaryDirectory(prefix="memlab-real-size-dry-") as tmp:
        data = Path(tmp) / "text.jsonl"
        data.write_text(json.dumps({"text": "hello"}) + "\n")
        for c in cases:
            knobs = tiny_knobs(c.model)
            runs = [("memory", s.memory_steps)] + ([("speed", s.speed_steps)] if c is cases[0]
                                                    and c.speed else [])
            for mode, steps in runs:
                overrides = memlab_overrides(settings_of(s, c), c, str(data), mode, steps,
                                             knobs)
                if "memlab" in sides:
                    bad += check("real_size", [(f"{c.name} {mode}", overrides)],
                                 platform=kernels if c.kernels else here)
            if c.trl is not None and "trl" in sides:
                print(f"  [real_size] {c.name + ' trl':44} SFTConfig from {c.trl or 'defaults'}")
        tiny = Settings(**{**asdict(s), "rows": 4})
        for c in CURVES if with_curves and "memlab" in sides else ():
            if c.trl is None:
                bad += check("real_size", [(f"curves {c.name}", memlab_overrides(
                    tiny, c, str(data), "speed", 50, DEFAULT_MODEL))], platform=kernels)
        show("real_size", f"{cases[0].name} memory",
             ["memlab", *memlab_overrides(settings_of(s, cases[0]), cases[0], "<data>",
                                          "memory", s.memory_steps,
                                          tiny_knobs(cases[0].model))])
    if "trl" in sides and not trl_importable():
        print(f"  [real_size] {TRL_MISSING}")
    return done("real_size", bad)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-memory", action="store_true",
                    help="only the speed rounds (no tracked run; the rows get no peaks)")
    ap.add_argument("--speed-steps", type=int, default=None,
                    help="steps of each speed run, the first left out (default 3)")
    ap.add_argument("--speed", default=None,
                    help="comma-separated cases to time (default: every case run)")
    ap.add_argument("--curves", action="store_true", help="8-bit AdamW's 50-step loss curves")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/real_size.json"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--reuse", action="store_true",
                    help="take the runs an earlier invocation finished in --workdir")
    ap.add_argument("--sides", default="memlab,trl",
                    help="the sides to run (runs reused with --reuse are kept either way)")
    ap.add_argument("--trl-from", default=None,
                    help="an earlier results file: TRL's memory numbers of the cases not run "
                         "on TRL's side now (the same TRL configuration) are taken from it, "
                         "and the row says so")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate every case's memlab run; run nothing")
    a = ap.parse_args(argv)
    if a.job:
        req = json.loads(Path(a.job).read_text())
        from real_size_trl import trl_job

        try:
            r = trl_job(req)
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator
            import traceback

            r = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()}
        (Path(req["dir"]) / "result.json").write_text(json.dumps(r))
        return 0
    sys.path.insert(0, str(REPO / "src"))
    s = Settings()
    if a.rounds is not None:
        s.rounds = a.rounds
    if a.speed_steps is not None:
        if a.speed_steps < 2:
            ap.error("--speed-steps: at least 2 (the first step is left out of tokens/s)")
        s.speed_steps = a.speed_steps
    cases = [c for c in CASES if not a.only or c.name in a.only.split(",")]
    unknown = sorted(set(a.only.split(",") if a.only else ()) - {c.name for c in CASES})
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {[c.name for c in CASES]}")
    if a.dry_run:
        return dry_run(s, cases, tuple(a.sides.split(",")), a.curves)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="memlab-real-size-"))
    work.mkdir(parents=True, exist_ok=True)
    logf = (work / "log.txt").open("a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    sides = tuple(a.sides.split(","))
    params = {m: check_architecture(m) for m in {c.model for c in cases}}
    shapes = {}  # (rows, length) -> the data file of the cases with that shape
    for c in cases:
        cs = settings_of(s, c)
        if (cs.rows, cs.length) not in shapes:
            shapes[cs.rows, cs.length] = prepare_data(cs, work)["path"]

    def data_of(c: Case) -> str:
        cs = settings_of(s, c)
        return shapes[cs.rows, cs.length]

    log(f"[real_size] {asdict(s)}; parameters {params}; work {work}")
    res = Results()
    out = Path(a.out)
    previous = json.loads(out.read_text()) if out.exists() and a.only else None
    for c in cases if not a.skip_memory else ():
        for side in ("memlab", "trl"):
            if side == "trl" and c.trl is None:
                continue
            res.memory[f"{side}:{c.name}"] = run(side, s, c, data_of(c), "memory", work,
                                                 "mem", log, reuse=a.reuse, sides=sides)
    if not a.skip_speed:
        fast = [c for c in cases if c.speed and c.trl is not None
                and (not a.speed or c.name in a.speed.split(","))]
        for rnd in range(s.rounds):
            for i, c in enumerate(fast if rnd % 2 == 0 else list(reversed(fast))):
                sides = ["memlab", "trl"] if (rnd + i) % 2 == 0 else ["trl", "memlab"]
                for side in sides:
                    res.speed.setdefault(f"{side}:{c.name}", []).append(
                        run(side, s, c, data_of(c), "speed", work, f"r{rnd}", log))
    if a.curves:
        res.curves = curves(s, work, log)
    rep = report(s, cases, res, params)
    if a.trl_from:
        trl_from(rep, Path(a.trl_from))
    if previous:  # --only: the other cases' rows stay as they were measured
        names = {r["case"] for r in rep["rows"]}
        rep["rows"] = [r for r in previous.get("rows", []) if r["case"] not in names] + \
            rep["rows"]
        rep["curves"] = rep["curves"] or previous.get("curves", {})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    log(markdown(rep))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
