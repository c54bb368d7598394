"""The TRL side of ``benchmarks/real_size.py``: one ``SFTTrainer`` run in this process (the
orchestrator's ``--job``), on the model memlab's loader builds (same seed, same weights), the
rows in memlab's order, with memlab's tracker entered around each step (memory) or the steps
timed (speed)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def trl_job(req: dict[str, Any]) -> dict[str, Any]:
    """One TRL run in this process (``--job``): memory (the tracker around every step) or
    speed (the time of steps 1..)."""
    import datasets
    import torch
    from _trl_probe import watch_trainer
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from memlab.data.assets import load_tokenizer
    from memlab.measure.memory import MemoryProbe
    from memlab.model.base import finish_load, seeded
    from memlab.model.tiny import Tiny
    from memlab.peft.lora import Lora
    from memlab.trainer.batch import BatchStream

    s, spec, mode = SimpleNamespace(**req["settings"]), req["trl"], req["mode"]
    torch.set_num_threads(s.threads)
    tok = load_tokenizer()
    rows = [json.loads(line) for line in Path(req["data"]).read_text().splitlines()]
    with seeded(s.seed):
        model = AutoModelForCausalLM.from_config(
            Tiny(**req["knobs"]).hf_config(tok), attn_implementation="sdpa",
            dtype=torch.float32)
    finish_load(model, tok, "causal_lm")
    probe = MemoryProbe("cpu") if mode == "memory" else None
    rec: dict[str, Any] = {"dt": [], "tokens": [], "losses": [], "first_ids": None, "t0": 0.0,
                           "stack": None}

    class Bench(SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):  # memlab's order
            n = len(train_dataset if train_dataset is not None else self.train_dataset)
            return BatchStream(list(range(n)), s.rows, s.seed, None)._permutation(0)

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs["input_ids"]
            rec["tokens"].append(int(inputs["attention_mask"].sum()))
            if rec["first_ids"] is None:
                rec["first_ids"] = ids[:, :8].tolist()
            if probe is not None:
                watch_trainer(probe, self, model)
                stack = contextlib.ExitStack()
                stack.enter_context(probe.step(len(rec["tokens"]) - 1, True,
                                               [v for v in inputs.values()
                                                if isinstance(v, torch.Tensor)]))
                rec["stack"] = stack
            loss = super().training_step(model, inputs, num_items_in_batch)
            if probe is not None:
                rec["stack"].enter_context(probe.phase("optimizer"))
            return loss

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            phase = probe.phase("forward") if probe is not None else contextlib.nullcontext()
            with phase:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            rec["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            rec["dt"].append(time.perf_counter() - rec["t0"])
            if rec["stack"] is not None:
                rec["stack"].close()
                rec["stack"] = None

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                rec["losses"].append(float(logs["loss"]))

    args = SFTConfig(
        output_dir=req["dir"], max_steps=req["steps"], per_device_train_batch_size=s.rows,
        gradient_accumulation_steps=1, learning_rate=s.lr, lr_scheduler_type="cosine",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=spec.get("max_grad_norm", 1.0) or 0.0,
        **({"optim": spec["optim"]} if "optim" in spec else {}),  # else TRL's default
        seed=s.seed, data_seed=s.seed, use_cpu=True,
        bf16=spec.get("bf16"),  # None: TRL's default, True (bf16 autocast, on a CPU too)
        gradient_checkpointing=True, max_length=s.length, truncation_mode="keep_start",
        packing=False, dataset_text_field="text", logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    peft_config = Lora().lora_config("causal_lm") if spec.get("lora") else None
    t0 = time.perf_counter()
    trainer = Bench(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                    processing_class=tok, peft_config=peft_config, callbacks=[Timer()])
    trainer.train()
    timed = sum(rec["dt"][1:])
    out: dict[str, Any] = {
        "status": "ok", "wall_s": time.perf_counter() - t0, "losses": rec["losses"],
        "tokens_per_s": sum(rec["tokens"][1:]) / timed if timed > 0 else None,
        "first_ids": rec["first_ids"],
    }
    if probe is not None:
        mem = probe.result()
        out.update(peak_bytes=mem["peak_bytes"], by_category=mem["by_category"],
                   by_phase=mem["by_phase"], peak_at=mem["peak_at"])
    return out
