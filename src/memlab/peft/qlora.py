"""`peft=qlora`: LoRA on a 4-bit (NF4/FP4) or 8-bit quantized base via bitsandbytes. CUDA only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from torch import nn

from memlab.peft.lora import Lora
from memlab.registry import register


@register("peft", "qlora")
@dataclass(kw_only=True)
class QLora(Lora):
    """LoRA knobs plus the quantization of the frozen base."""

    quantizes_base: ClassVar[bool] = True
    """The frozen base is stored quantized (bitsandbytes): it cannot be merged with adapters."""

    bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, ctx) -> list[str]:
        errors = super().validate(ctx)
        if not ctx.is_cuda:
            errors.append(
                "peft=qlora quantizes the base with bitsandbytes, which needs a CUDA device; "
                "on CPU use peft=lora"
            )
        else:
            err = ctx.platform.missing("bitsandbytes", "peft=qlora")
            if err:
                errors.append(err)
        return errors

    def load_kwargs(self, ctx) -> dict[str, Any]:
        import torch
        from transformers import BitsAndBytesConfig

        if self.bits == 8:
            q = BitsAndBytesConfig(load_in_8bit=True)
        else:
            q = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=self.quant_type,
                bnb_4bit_use_double_quant=self.double_quant,
                bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
            )
        return {"quantization_config": q}

    def apply(self, model: nn.Module, ctx, task: str) -> nn.Module:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return super().apply(model, ctx, task)
