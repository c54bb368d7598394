"""What an attention backend declares (:class:`Attention`, in :mod:`memlab.protocols` and
re-exported here), and the checks every backend shares (:class:`Backend`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from memlab import registry
from memlab.protocols import Attention
from memlab.registry import Option

if TYPE_CHECKING:
    import torch

    from memlab.protocols import BuildContext
    from memlab.trainer.batch import Segments


AttentionClass = TypeVar("AttentionClass", bound=Attention)


def register(name: str) -> Callable[[type[AttentionClass]], type[AttentionClass]]:
    """Register an ``attention=`` option (mypy checks it against :class:`Attention`)."""
    return registry.register("attention", name)


@dataclass(kw_only=True)
class Backend(Option):
    """What the backends share: the checks, from the class-level capability flags that each
    backend sets."""

    isolates_packed: ClassVar[bool] = True
    """Keeps documents apart in a packed / padding-free row (restarting position_ids)."""
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    trains_on_cpu: ClassVar[bool] = True
    package: ClassVar[str | None] = None
    skips_padding: ClassVar[bool] = True
    """Given a padding mask, the backend leaves padded positions out of its work
    (flash-attention unpads the rows, flex skips masked blocks), so a padded batch is worth its
    mask. False (eager, sdpa): padded positions cost as much with the mask as without, so a
    method may send right-padded rows of a causal LM without it (``method.padding_mask``)."""

    def implementation(self) -> str:
        """The string passed to transformers as ``attn_implementation``."""
        return self.name

    def shares_prefix(self) -> bool:
        """Whether a document can also see a prefix stored before it in its row (a preference
        pair's shared prompt: :class:`memlab.trainer.batch.Segments` entries ``(n, a, b)``)."""
        return False

    def document_mask(self, segments: Segments, width: int, device: torch.device | str
                      ) -> Any:
        """The ``attention_mask`` to pass for rows described by ``segments`` (``width`` tokens
        each), or None when the backend keeps documents apart by itself (position ids, or
        memlab's per-document attention reading the segments)."""
        return None

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        name = self.name
        dev = "cuda" if ctx.is_cuda else "cpu"
        if dev not in self.devices:
            errors.append(
                f"attention={name} runs only on {'/'.join(self.devices)}, and this run is on "
                f"{dev}; use attention=sdpa or attention=eager here"
            )
        elif dev == "cpu" and not self.trains_on_cpu:
            errors.append(
                f"attention={name} has no backward pass on CPU in this torch build; "
                "use attention=sdpa or attention=eager for CPU training"
            )
        dtype = ctx.precision.compute_dtype_name()
        if dtype not in self.dtypes:
            errors.append(
                f"attention={name} supports {'/'.join(self.dtypes)} but precision="
                f"{ctx.precision.name} computes in {dtype}; use precision=bf16 or bf16_mixed"
            )
        if self.package and dev in self.devices:
            err = ctx.platform.missing(self.package, f"attention={name}")
            if err:
                errors.append(err)
        if ctx.method.row_layout(ctx).packs_rows and not self.isolates_packed:
            why = (f"packing={ctx.packing.name}" if ctx.packing.packs
                   else "method.padding_free=true")
            errors.append(
                f"{why} puts several sequences in one row, which attention={name} cannot keep "
                "apart; use attention=sdpa, eager or flash_attention_2"
                + ("" if ctx.packing.packs else ", or set method.padding_free=false"))
        return errors


@dataclass(kw_only=True)
class VarlenBackend(Backend):
    """eager / sdpa: transformers' kernels, plus memlab's per-document attention for rows that
    hold several documents (memlab/attention/_varlen.py)."""

    skips_padding: ClassVar[bool] = False

    varlen: bool = True
    """Per-document attention in packed / padding-free rows (cost sum(L_i^2)); false:
    transformers' one block-diagonal [N, N] mask for the whole row (cost N^2)."""

    def shares_prefix(self) -> bool:
        return self.varlen

    def implementation(self) -> str:
        name = self.name
        if not self.varlen:
            return name
        from memlab.attention._varlen import register

        register()
        return f"memlab_{name}_varlen"
