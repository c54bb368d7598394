"""`attention=kernels`: an attention kernel from the Hugging Face kernels hub (e.g.
`kernels-community/flash-attn2`), loaded by transformers through the `kernels` package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from memlab.attention.base import Backend, register

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("kernels")
@dataclass(kw_only=True)
class Kernels(Backend):
    """A kernels-hub repository name, passed as ``attn_implementation``."""

    repo: str = "kernels-community/flash-attn2"
    """Hub repository of the kernel, e.g. kernels-community/flash-attn2 or .../vllm-flash-attn3."""

    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")
    package: ClassVar[str | None] = "kernels"

    def implementation(self) -> str:
        return self.repo

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if "/" not in self.repo:
            errors.append(
                f"attention.repo={self.repo!r} must be a hub repo 'owner/name', "
                "e.g. kernels-community/flash-attn2"
            )
        return errors
