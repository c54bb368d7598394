"""``peft.frozen_dtype=auto`` (LoRA's default): under mixed precision the frozen base's linear
layers are kept in the compute dtype, which autocast casts them to at every use anyway. The same
loss curve bit for bit as ``float32`` (the weights as loaded), and the parameters category
lower by exactly 2 bytes per frozen decoder weight (embeddings, norms and the output head stay
fp32). Tiny SFT runs at bf16_mixed, every step tracked (exact on any CPU)."""

from __future__ import annotations

from memlab_testing import run_job

TINY = ["precision=bf16_mixed", "peft=lora", "train.steps=2", "measure.memory_steps=all",
        "model.hidden_size=128", "model.intermediate_size=256", "model.vocab_size=4096",
        "model.num_heads=4", "model.num_kv_heads=2", "method.max_length=256",
        "data.n_examples=8"]
# 2 layers x (q, o: 128 x 128; k, v: 128 x 64 (2 of 4 heads of 32); gate, up, down: 128 x 256)
FROZEN = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256)


def test_frozen_linears_in_the_compute_dtype_train_the_same_in_less_memory(tmp_path):
    runs = {d: run_job(tmp_path, [*TINY, f"peft.frozen_dtype={d}"], name=d)
            for d in ("float32", "auto")}
    kept, cast = runs["float32"], runs["auto"]
    assert kept["status"] == cast["status"] == "ok"
    assert cast["train"]["loss_curve"] == kept["train"]["loss_curve"]  # bit for bit
    params = {d: r["memory"]["by_category"]["parameters"] for d, r in runs.items()}
    assert params["float32"] - params["auto"] == 2 * FROZEN
    assert cast["memory"]["peak_bytes"] < kept["memory"]["peak_bytes"]
