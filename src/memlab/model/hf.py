"""`model=hf`: any Hugging Face model by hub name or local path (``from_pretrained``).

Offline use: a local directory, or ``local_files_only: true`` with a warm HF cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from memlab.model.base import Head, auto_class, finish_load, load_kwargs
from memlab.registry import register


@register("model", "hf")
@dataclass(kw_only=True)
class HubModel:
    """Where to load weights and tokenizer from."""

    name_or_path: str = "Qwen/Qwen2.5-0.5B"
    revision: str | None = None
    tokenizer: str | None = None
    """Tokenizer name or path; None = same as name_or_path."""
    trust_remote_code: bool = False
    local_files_only: bool = False

    def validate(self, ctx) -> list[str]:
        if not self.name_or_path:
            return ["model.name_or_path must name a hub model or a local directory"]
        return []

    def load_tokenizer(self, ctx):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            self.tokenizer or self.name_or_path,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
            local_files_only=self.local_files_only,
        )
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok

    def hf_config(self, tokenizer):
        """The model's transformers config (no weights)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.name_or_path, revision=self.revision,
                                          trust_remote_code=self.trust_remote_code,
                                          local_files_only=self.local_files_only)

    def load(self, ctx, tokenizer, head: Head, extra: dict[str, Any]) -> nn.Module:
        kw = load_kwargs(ctx, extra)
        if head == "seq_cls":
            kw.setdefault("num_labels", 1)
        model = auto_class(head).from_pretrained(
            self.name_or_path,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
            local_files_only=self.local_files_only,
            **kw,
        )
        if "quantization_config" not in extra:
            model = model.to(ctx.device)
        return finish_load(model, tokenizer, head)
