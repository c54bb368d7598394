"""`model=tiny`: a small Llama- or Qwen2-style causal LM built from a config with a seeded random
init and the tokenizer memlab ships. Needs no network; the default for tests and smoke runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from memlab.model import _files
from memlab.model.base import Head, auto_class, finish_load, load_kwargs, register, seeded
from memlab.registry import Option, PositiveInt, Seed
from memlab.trainer.inputs import Inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from memlab.context import BuildContext


@register("tiny")
@dataclass(kw_only=True)
class Tiny(Option):
    """Architecture sizes of the randomly initialised model."""

    arch: Literal["llama", "qwen2"] = "llama"
    hidden_size: PositiveInt = 128
    """Width of the residual stream."""
    intermediate_size: PositiveInt = 384
    """Width of the MLP's hidden layer."""
    num_layers: PositiveInt = 4
    """Decoder layers."""
    num_heads: PositiveInt = 4
    """Attention (query) heads; must divide hidden_size."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    vocab_size: PositiveInt | None = None
    """None = the tokenizer's size; larger values add unused rows (to study large vocabularies)."""
    max_position_embeddings: PositiveInt = 16384
    """Longest sequence the rotary embedding covers."""
    tie_word_embeddings: bool = False
    """The output head shares the input embedding's weight."""
    tokenizer: str | None = None
    """Tokenizer dir; None = the BPE tokenizer shipped in memlab/assets/tokenizer."""
    chat_template: str | None = None
    """A chat template that replaces the tokenizer's own: a name memlab ships (chatml, qwen2.5,
    qwen3, llama3, mistral, mistral-tekken, gemma; docs/config/model.md) or a Jinja file; None =
    the tokenizer's."""
    seed: Seed | None = None
    """Init seed; None = train.seed."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        if self.hidden_size % self.num_heads:
            errors.append(
                f"model.hidden_size={self.hidden_size} must be divisible by "
                f"model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            errors.append(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.num_kv_heads}"
            )
        if self.tokenizer is not None:
            errors += _files.path_errors("model.tokenizer", self.tokenizer, ("tokenizer",))
        errors += _files.chat_template_errors("model.chat_template", self.chat_template)
        return errors

    def inputs(self) -> dict[str, Inputs]:
        """The tokenizer's files (memlab's shipped one by default) and the chat template file;
        the weights are a seeded random init (the configuration says all about them)."""
        from memlab.data.assets import tokenizer_path

        return {"tokenizer": Inputs.of_paths([self.tokenizer or tokenizer_path()]),
                "chat_template": _files.template_inputs(self.chat_template)}

    def load_tokenizer(self, ctx: BuildContext):
        from memlab.data.assets import load_tokenizer

        if self.tokenizer is not None:
            _files.check_local("model.tokenizer", self.tokenizer, ("tokenizer",))
        return _files.apply_chat_template_file(load_tokenizer(self.tokenizer), self.chat_template)

    def hf_config(self, tokenizer):
        from transformers import LlamaConfig, Qwen2Config

        vocab = self.vocab_size or len(tokenizer)
        common: dict[str, Any] = dict(
            vocab_size=vocab,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=False,
            num_labels=1,
        )
        if self.arch == "llama":
            return LlamaConfig(**common)
        return Qwen2Config(**common)

    def load(self, ctx: BuildContext, tokenizer: Any, head: Head, extra: dict[str, Any]
             ) -> PreTrainedModel:
        """Build the model with the run's attention backend and parameter dtype. A quantized
        load (peft=qlora) builds it in float32, saves it and loads it back the way
        ``from_pretrained`` quantizes a checkpoint (transformers' bitsandbytes path)."""
        kw = load_kwargs(ctx, extra)
        quantized = extra.get("quantization_config") is not None
        with seeded(self.seed if self.seed is not None else ctx.train.seed):
            model = auto_class(head).from_config(
                self.hf_config(tokenizer), **({} if quantized else kw))
        if quantized:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="memlab-tiny-") as tmp:
                model.save_pretrained(tmp)
                del model
                model = auto_class(head).from_pretrained(tmp, **kw)
            model.name_or_path = model.config.name_or_path = ""  # as if built from a config
            return finish_load(model, tokenizer, head)
        return finish_load(model.to(ctx.device), tokenizer, head)
