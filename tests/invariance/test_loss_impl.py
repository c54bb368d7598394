"""``method.loss_impl=auto`` (SFT's default) is the chunked loss, which never builds the
[tokens, vocab] logits, except where a LoRA adapter sits on the output head (the chunked loss
reads the head's weight directly, so it would leave the adapter out; an explicit ``chunked`` is
refused there) and in a distributed run (DDP, FSDP2, DeepSpeed): the standard loss there. The
chunked loss applies the model's own transform of its logits (Gemma-2's soft-capping,
Granite's divisor, Cohere's scale), so it gives the standard loss and gradients on those models
too (fp32 CPU: 1e-5 relative on the loss, 1e-5 absolute on the gradients)."""

from __future__ import annotations

import pytest
import torch

from unit.optimizer.steps import ctx_of, problems

HEAD_LORA = "peft.target_modules=[q_proj,lm_head]"


def test_auto_is_chunked_unless_an_adapter_sits_on_the_head():
    auto = ctx_of("method.loss_impl=auto")
    assert auto.method.reads_head_weight(auto) == "method.loss_impl=chunked"
    plain = ctx_of()  # the default: auto
    assert plain.method.loss_impl == "auto"
    assert plain.method.reads_head_weight(plain) == "method.loss_impl=chunked"
    for dist in (("distributed=ddp", "distributed.nproc=2"),
                 ("distributed=fsdp2", "distributed.nproc=2"),
                 ("distributed=deepspeed", "distributed.zero_stage=2")):
        c = ctx_of(*dist)  # the head's gradient would be whole from forward to backward
        assert c.method.reads_head_weight(c) is None, dist
    forced = ctx_of("distributed=fsdp2", "distributed.nproc=2", "method.loss_impl=chunked")
    assert forced.method.reads_head_weight(forced) == "method.loss_impl=chunked"
    lora = ctx_of("peft=lora", "method.loss_impl=auto")  # all-linear leaves the head out
    assert lora.method.reads_head_weight(lora) == "method.loss_impl=chunked"
    head = ctx_of("peft=lora", HEAD_LORA, "method.loss_impl=auto")  # auto falls back to standard
    assert head.method.reads_head_weight(head) is None
    text = problems("peft=lora", HEAD_LORA, "method.loss_impl=chunked")
    assert "lm_head" in text and "method.loss_impl=chunked" in text
    std = ctx_of("method.loss_impl=standard")
    assert std.method.reads_head_weight(std) is None


def _model(arch: str, vocab: int):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    if arch == "gemma2":
        return transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**common, final_logit_softcapping=2.0))
    if arch == "granite":
        return transformers.GraniteForCausalLM(
            transformers.GraniteConfig(**common, logits_scaling=4.0))
    return transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.5))


@pytest.mark.parametrize("arch", ["gemma2", "granite", "cohere"])
def test_chunked_loss_applies_the_models_logit_transform(arch):
    from memlab.data.assets import load_tokenizer
    from memlab.data.embedded import Embedded

    tok = load_tokenizer()
    ctxs = {impl: ctx_of(f"method.loss_impl={impl}", "method.chunk_size=32")
            for impl in ("standard", "chunked")}
    raw = Embedded(n_examples=3, median_tokens=40, max_tokens=120).load(ctxs["standard"])
    ds, _ = ctxs["standard"].method.prepare(raw, tok, ctxs["standard"])
    batch = ctxs["standard"].method.collate([ds[i] for i in range(len(ds))], tok,
                                            ctxs["standard"])
    model = _model(arch, len(tok))
    out = {}
    for impl, ctx in ctxs.items():
        model.zero_grad(set_to_none=True)
        loss, _ = ctx.method.loss({"policy": model}, batch, ctx)
        loss.backward()
        out[impl] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None})
    (l_std, g_std), (l_chk, g_chk) = out["standard"], out["chunked"]
    torch.testing.assert_close(l_chk, l_std, rtol=1e-5, atol=0)
    assert g_chk.keys() == g_std.keys() and g_std
    for name, g in g_std.items():
        torch.testing.assert_close(g_chk[name], g, rtol=0, atol=1e-5, msg=name)
