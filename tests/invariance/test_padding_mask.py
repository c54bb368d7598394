"""``method.padding_mask=auto`` (SFT's default): right-padded rows go to an eager / sdpa model
without their attention mask. In a causal model no real token attends to a later position, so
the loss and every gradient equal those of the masked batch (``always``); the padding
positions' own outputs differ (they see the padding before them), which is the negative
control: the check would notice a mask that mattered. fp32 CPU: 1e-5 relative on the loss,
1e-5 absolute on gradients."""

from __future__ import annotations

import pytest
import torch

from memlab.method.base import IGNORE


def _ctx(*overrides: str):
    from omegaconf import OmegaConf, open_dict

    from memlab.context import validate
    from memlab_testing import FAST, compose

    cfg = compose([*FAST, *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.to_container(cfg, resolve=True))


def _model(vocab: int, attention: str, lora: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      use_cache=False, attn_implementation=attention)
    model = LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padded_rows_without_their_mask_give_the_same_loss_and_gradients(attention, lora):
    from memlab.data.assets import load_tokenizer
    from memlab.data.embedded import Embedded

    tok = load_tokenizer()
    ctxs = {m: _ctx(f"method.padding_mask={m}", f"attention={attention}",
                    "method.max_length=256", "method.head_on=all")
            for m in ("always", "auto")}
    raw = Embedded(n_examples=4, median_tokens=60, max_tokens=200).load(ctxs["auto"])
    ds, _ = ctxs["auto"].method.prepare(raw, tok, ctxs["auto"])
    rows = [ds[i] for i in range(len(ds))]
    batches = {m: c.method.collate(rows, tok, c) for m, c in ctxs.items()}
    mask = batches["always"].tensors["attention_mask"]
    assert bool((mask == 0).any())  # the rows really are padded
    assert "attention_mask" not in batches["auto"].tensors
    assert torch.equal(batches["auto"].tensors["input_ids"], batches["always"].tensors["input_ids"])

    model = _model(len(tok), attention, lora)
    out = {}
    for m, b in batches.items():
        model.zero_grad(set_to_none=True)
        loss, _ = ctxs[m].method.loss({"policy": model}, b, ctxs[m])
        loss.backward()
        out[m] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.grad is not None}
    torch.testing.assert_close(out["auto"][0], out["always"][0], rtol=1e-5, atol=0)
    assert out["auto"][1].keys() == out["always"][1].keys() and out["auto"][1]
    for name, g in out["always"][1].items():
        torch.testing.assert_close(out["auto"][1][name], g, rtol=0, atol=1e-5, msg=name)

    # negative control: the padding positions' logits do depend on the mask
    with torch.no_grad():
        t = batches["always"].tensors
        masked = model(input_ids=t["input_ids"], attention_mask=mask).logits
        free = model(input_ids=t["input_ids"]).logits
    pad = (mask == 0) & (t["labels"] == IGNORE)
    real = mask == 1
    torch.testing.assert_close(free[real], masked[real], rtol=1e-5, atol=1e-5)
    assert (free[pad] - masked[pad]).abs().max() > 1e-3
