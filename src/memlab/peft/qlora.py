"""`peft=qlora`: LoRA on a 4-bit (NF4/FP4) or 8-bit quantized base via bitsandbytes.

CUDA, or the CPU: bitsandbytes' layers run on CPU tensors (dequantized in the compute dtype,
float32 where the CPU has no fast bf16). On CPU memlab keeps 4-bit weights in bitsandbytes'
training layout (:func:`memlab.measure.patches.keep_4bit_training_layout`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from memlab.peft.base import QuantizedBase, register
from memlab.peft.lora import Lora

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("qlora")
@dataclass(kw_only=True)
class QLora(Lora):
    """LoRA knobs plus the quantization of the frozen base."""

    bits: Literal[4, 8] = 4
    """4: bitsandbytes' Linear4bit (QLoRA's NF4 / FP4); 8: Linear8bitLt (LLM.int8)."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """The 4-bit data type (``bnb_4bit_quant_type``)."""
    double_quant: bool = True
    """Quantize the per-block scales too (``bnb_4bit_use_double_quant``)."""
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """The dtype 4-bit weights are dequantized to for each matmul (``bnb_4bit_compute_dtype``);
    float32 on a CPU without fast bf16."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_quantized_base(self) -> QuantizedBase | None:
        return self

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if ctx.is_cuda:
            err = ctx.platform.missing("bitsandbytes", "peft=qlora")
        elif not ctx.platform.has("bitsandbytes"):
            err = ("peft=qlora quantizes the base with bitsandbytes, which is not installed: "
                   "pip install bitsandbytes (its 4- and 8-bit layers run on CPU tensors too; "
                   "on a CUDA machine: pip install 'memlab[gpu]'), or use peft=lora")
        else:
            err = None
        if err:
            errors.append(err)
        return errors

    def load_kwargs(self, ctx: BuildContext) -> dict[str, Any]:
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
        kw: dict[str, Any] = {"quantization_config": q}
        if not ctx.is_cuda:
            kw["device_map"] = {"": "cpu"}  # bitsandbytes' CPU layers (CUDA: the current device)
        return kw

    def apply(self, model: nn.Module, ctx: BuildContext, task: str) -> nn.Module:
        from peft import prepare_model_for_kbit_training

        from memlab.measure.patches import keep_4bit_training_layout

        if not ctx.is_cuda:
            keep_4bit_training_layout(model)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return super().apply(model, ctx, task)
