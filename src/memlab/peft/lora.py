"""`peft=lora`: low-rank adapters on a frozen base (Hugging Face PEFT)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

from torch import nn

from memlab.peft.base import QuantizedBase, register
from memlab.registry import Option, PositiveInt, Range

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from memlab.context import BuildContext


@register("lora")
@dataclass(kw_only=True)
class Lora(Option):
    """LoRA knobs, named as in ``peft.LoraConfig``."""

    r: PositiveInt = 16
    """Rank of the adapter's low-rank update."""
    alpha: PositiveInt = 32
    """Scale of the update: alpha / r (alpha / sqrt(r) with use_rslora)."""
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input."""
    target_modules: str | list[str] = "all-linear"
    """'all-linear' (every linear layer but the output head) or a list of module names."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter (e.g. ['score'] for a reward head)."""
    autocast_adapter_dtype: bool = True
    """PEFT's default keeps adapter weights in fp32 even on a bf16 base; that makes activations
    larger than full fine-tuning. false keeps adapters in the base dtype."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(r)."""
    frozen_dtype: Literal["auto", "float32"] = "auto"
    """The dtype the frozen base's linear layers are kept in. auto: under mixed precision
    (bf16_mixed, fp16_mixed) the compute dtype, since autocast casts them to it at every use
    anyway (bit for bit the same numbers, half the bytes of those weights); otherwise as
    loaded. float32: as loaded (the embeddings, norms and output head always are)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other LoraConfig keyword (e.g. use_dora: true)."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        if self.r <= 0:
            errors.append(f"peft.r must be positive (got {self.r})")
        if not 0.0 <= self.dropout < 1.0:
            errors.append(f"peft.dropout must be in [0, 1) (got {self.dropout})")
        liger = ctx.method.as_liger() if self.adapts_head() else None
        reader = None if liger is None else liger.reads_head_weight(ctx)
        if reader is not None:
            errors.append(
                f"{reader}: method={ctx.method.name}'s loss reads the output head's weight "
                "directly, so it cannot train a LoRA adapter on lm_head; drop lm_head from "
                f"peft.target_modules or change {reader}")
        return errors

    def adapts_head(self) -> bool:
        """Whether ``target_modules`` puts an adapter on the output head (``lm_head``;
        'all-linear' leaves the head out)."""
        return isinstance(self.target_modules, list) and "lm_head" in self.target_modules

    def load_kwargs(self, ctx: BuildContext) -> dict[str, Any]:
        return {}

    def as_quantized_base(self) -> QuantizedBase | None:
        return None

    def has_adapter(self) -> bool:
        return True

    def lora_config(self, task: str):
        from peft import LoraConfig, TaskType

        modules_to_save = self.modules_to_save
        if task == "seq_cls" and modules_to_save is None:
            modules_to_save = ["score"]
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            modules_to_save=modules_to_save,
            use_rslora=self.use_rslora,
            task_type=TaskType.SEQ_CLS if task == "seq_cls" else TaskType.CAUSAL_LM,
            **self.extra,
        )

    def apply(self, model: nn.Module, ctx: BuildContext, task: str) -> nn.Module:
        from peft import get_peft_model

        model = get_peft_model(
            model, self.lora_config(task), autocast_adapter_dtype=self.autocast_adapter_dtype
        )
        if self.frozen_dtype == "auto" and ctx.precision.autocast_dtype is not None:
            frozen_linears_to(model, ctx.precision.autocast_dtype)
        return model


def frozen_linears_to(model: nn.Module, dtype_name: str) -> None:
    """Keep the frozen fp32 weights (and biases) of ``model``'s linear layers in ``dtype_name``
    (autocast's compute dtype): what autocast would cast them to at each use. Left alone: a
    trained parameter, a quantized layer's (not fp32), the output head and any weight shared
    with an embedding (read outside autocast)."""
    import torch

    dtype = getattr(torch, dtype_name)
    # (a PeftModel answers for its base model, a transformers PreTrainedModel)
    head = cast("PreTrainedModel", model).get_output_embeddings()
    keep = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False)}
    if head is not None:
        keep |= {id(p) for p in head.parameters()}
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad or p.dtype != torch.float32 or id(p) in keep:
                continue
            with torch.no_grad():
                setattr(module, name, nn.Parameter(p.to(dtype), requires_grad=False))
