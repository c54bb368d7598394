"""``method.head_on=labelled`` (SFT's default) runs the output head only at the positions that
carry a label: the same summed loss and the same gradients as ``head_on=all``, for padded and
padding-free batches, the standard and the chunked loss, with and without a LoRA adapter; the
model's own transforms of its logits (Gemma-2's soft-capping, Granite's divisor) still apply;
and a real run measures less activation memory with the same loss curve. fp32 CPU: 1e-5
relative on the loss, 1e-5 absolute on gradients.
"""

from __future__ import annotations

import pytest
import torch

from memlab.method.base import IGNORE, LOSS_INDEX, head_at, label_positions


def _ctx(*overrides: str):
    from omegaconf import OmegaConf, open_dict

    from memlab.context import validate
    from memlab_testing import FAST, compose

    cfg = compose([*FAST, *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.to_container(cfg, resolve=True))


def _model(vocab: int, lora: bool, head: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      use_cache=False)
    model = LlamaForCausalLM(cfg)
    if lora:  # the head too: the hook must sit on the adapter-wrapped head
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "lm_head"] if head else ["q_proj"]
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets,
                                                 init_lora_weights=False))
    return model


def _loss_and_grads(model, ctx, batch):
    model.zero_grad(set_to_none=True)
    loss, _ = ctx.method.loss({"policy": model}, batch, ctx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


# the chunked loss reads the head's weight directly: LoRA on lm_head is refused with it
# (validated), so its LoRA case adapts q_proj only
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("loss_impl", ["standard", "chunked"])
@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_labelled_head_gives_the_loss_and_gradients_of_the_full_head(layout, loss_impl, lora):
    from memlab.data.assets import load_tokenizer
    from memlab.data.embedded import Embedded

    tok = load_tokenizer()
    flat = str(layout == "padding_free").lower()
    ctxs = {h: _ctx(f"method.head_on={h}", f"method.loss_impl={loss_impl}",
                    f"method.padding_free={flat}", "method.chunk_size=32")
            for h in ("labelled", "all")}
    raw = Embedded(n_examples=4, median_tokens=60, max_tokens=200).load(ctxs["all"])
    ds, _ = ctxs["all"].method.prepare(raw, tok, ctxs["all"])
    rows = [ds[i] for i in range(len(ds))]
    batches = {h: c.method.collate(rows, tok, c) for h, c in ctxs.items()}
    index = batches["labelled"].tensors[LOSS_INDEX]
    labels = batches["all"].tensors["labels"]
    assert LOSS_INDEX not in batches["all"].tensors
    # a real saving: completion-only chat labels few of the positions (padding none at all)
    assert 0 < index.numel() < 0.8 * labels.numel()
    assert batches["labelled"].num_items == batches["all"].num_items == index.numel()
    assert bool((labels.reshape(-1)[index] != IGNORE).all())

    model = _model(len(tok), lora, head=loss_impl == "standard")
    loss_all, grads_all = _loss_and_grads(model, ctxs["all"], batches["all"])
    loss_lab, grads_lab = _loss_and_grads(model, ctxs["labelled"], batches["labelled"])
    torch.testing.assert_close(loss_lab, loss_all, rtol=1e-5, atol=0)
    assert grads_lab.keys() == grads_all.keys() and grads_all
    for name, g in grads_all.items():
        torch.testing.assert_close(grads_lab[name], g, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ["gemma2", "granite"])
def test_the_models_own_logit_transform_still_applies(arch):
    """Gemma-2 soft-caps its logits, Granite divides them: ``head_at`` narrows the head's input,
    so the model's forward applies its transform to the selected rows; the bare head on the
    same rows (the negative control) gives other values, so the check is sensitive."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, final_logit_softcapping=2.0)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        cfg = transformers.GraniteConfig(**common, logits_scaling=4.0)
        model = transformers.GraniteForCausalLM(cfg)
    model.eval()
    ids = torch.randint(3, 300, (2, 9))
    labels = torch.full((2, 9), IGNORE)
    labels[0, 4:8] = 7
    labels[1, 1:3] = 9
    index = label_positions(labels)
    with torch.no_grad():
        full = model(input_ids=ids).logits.reshape(-1, 300)
        with head_at(model, index):
            some = model(input_ids=ids).logits
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state.reshape(-1, 64)
        bare = model.get_output_embeddings()(hidden[index])
    assert some.shape == (6, 300)
    torch.testing.assert_close(some, full[index], rtol=1e-5, atol=1e-5)
    assert (bare - full[index]).abs().max() > 1e-2
    # the hook is gone after the block
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (2, 9, 300)


@pytest.mark.integration
def test_labelled_head_same_loss_curve_less_activation_memory(job):
    """A real run (embedded chat, loss on completions, padded batches), every step tracked:
    the same loss curve and a lower measured activation peak than the head on every position."""
    steps = ["measure.memory_steps=all"]
    every = job([*steps, "method.head_on=all"])
    labelled = job(steps)
    assert labelled["status"] == every["status"] == "ok"
    assert labelled["train"]["loss_curve"] == pytest.approx(every["train"]["loss_curve"],
                                                            rel=1e-5)
    act = {k: s["memory"]["by_category"]["activations"]
           for k, s in (("all", every), ("labelled", labelled))}
    assert act["labelled"] < 0.95 * act["all"], act
    assert labelled["memory"]["peak_bytes"] < every["memory"]["peak_bytes"]



@pytest.mark.integration
def test_auto_tracking_finds_the_peak_of_labelled_batches(job):
    """Under head_on=labelled the peak follows the labelled positions, not only the batch
    shape: the collator's size key carries their count, so ``memory_steps=auto`` tracks the
    step that reaches the peak ``all`` finds (it missed it when the key was the shape only)."""
    common = ["train.steps=8", "method.max_length=256", "data.median_tokens=150",
              "train.batch_size=3", "train.gradient_checkpointing=false"]
    every = job([*common, "measure.memory_steps=all"])
    auto = job(common)
    peaks = every["memory"]["tracked_step_peaks"]
    assert len(set(peaks)) > 2  # the batches differ
    assert auto["memory"]["peak_bytes"] == every["memory"]["peak_bytes"] == max(peaks)
    assert auto["memory"]["tracked_steps"] != every["memory"]["tracked_steps"]  # fewer steps
