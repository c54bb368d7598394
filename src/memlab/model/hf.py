"""`model=hf`: any Hugging Face model by hub name or local path (``from_pretrained``).

Offline use: a local directory, or ``local_files_only: true`` (or ``HF_HUB_OFFLINE=1``) with a
warm HF cache. Before anything loads: a local directory that does not exist or has no
``config.json`` is a config error (``validate``); missing weight / tokenizer files are named when
that part loads; a hub name is checked against the cache (offline) or with one short request
(online), so an unreachable hub fails in seconds instead of after a minute of retries
(:mod:`memlab.model._files`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memlab.model import _files
from memlab.model.base import Head, auto_class, finish_load, load_kwargs, register
from memlab.registry import Option
from memlab.trainer.inputs import Inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from memlab.context import BuildContext


@register("hf")
@dataclass(kw_only=True)
class HubModel(Option):
    """Where to load weights and tokenizer from."""

    name_or_path: str = "Qwen/Qwen2.5-0.5B"
    """A hub model id or a local directory holding config.json and the weights (``memlab
    estimate`` needs no weights)."""
    revision: str | None = None
    """Hub branch, tag or commit of the model (None: the default branch)."""
    tokenizer: str | None = None
    """Tokenizer name or path; None = same as name_or_path."""
    chat_template: str | None = None
    """A chat template that replaces the tokenizer's own: a name memlab ships (chatml, qwen2.5,
    qwen3, llama3, mistral, mistral-tekken, gemma; docs/config/model.md) or a Jinja file (e.g.
    one with ``{% generation %}`` markers); None = the tokenizer's."""
    trust_remote_code: bool = False
    """Run the model repository's own Python code (transformers' trust_remote_code): only for
    repositories you trust."""
    local_files_only: bool = False
    """Never touch the network (a local directory, or a model in the HF cache)."""

    def validate(self, ctx: BuildContext) -> list[str]:
        if not self.name_or_path:
            return ["model.name_or_path must name a hub model or a local directory"]
        errors = []
        if _files.looks_like_path(self.name_or_path):
            errors += _files.path_errors("model.name_or_path", self.name_or_path, ("config",))
        if self.tokenizer and _files.looks_like_path(self.tokenizer):
            errors += _files.path_errors("model.tokenizer", self.tokenizer, ("tokenizer",))
        errors += _files.chat_template_errors("model.chat_template", self.chat_template)
        return errors

    def inputs(self) -> dict[str, Inputs]:
        model, tokenizer = _files.directory_inputs(self.name_or_path, self.revision)
        if self.tokenizer:
            tokenizer = _files.directory_inputs(self.tokenizer, self.revision)[1]
        return {"model": model, "tokenizer": tokenizer,
                "chat_template": _files.template_inputs(self.chat_template)}

    def _local_only(self, key: str, name: str, need: tuple[str, ...], probe_file: str) -> bool:
        """Check where ``name`` loads from (module docstring); True = from files on disk only."""
        if _files.looks_like_path(name):
            _files.check_local(key, name, need)
            return self.local_files_only
        return _files.hub_local_only(key, name, self.revision, self.local_files_only,
                                     probe_file)

    def load_tokenizer(self, ctx: BuildContext):
        from transformers import AutoTokenizer

        key, name = ("model.tokenizer", self.tokenizer) if self.tokenizer else (
            "model.name_or_path", self.name_or_path)
        local_only = self._local_only(key, name, ("tokenizer",), "tokenizer_config.json")
        tok = AutoTokenizer.from_pretrained(
            name,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
            local_files_only=local_only,
        )
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return _files.apply_chat_template_file(tok, self.chat_template)

    def hf_config(self, tokenizer):
        """The model's transformers config (no weights; a directory needs only config.json)."""
        from transformers import AutoConfig

        local_only = self._local_only("model.name_or_path", self.name_or_path, ("config",),
                                      "config.json")
        return AutoConfig.from_pretrained(self.name_or_path, revision=self.revision,
                                          trust_remote_code=self.trust_remote_code,
                                          local_files_only=local_only)

    def load(self, ctx: BuildContext, tokenizer: Any, head: Head, extra: dict[str, Any]
             ) -> PreTrainedModel:
        local_only = self._local_only("model.name_or_path", self.name_or_path,
                                      ("config", "weights"), "config.json")
        kw = load_kwargs(ctx, extra)
        if head == "seq_cls":
            kw.setdefault("num_labels", 1)
        try:
            model = auto_class(head).from_pretrained(
                self.name_or_path,
                revision=self.revision,
                trust_remote_code=self.trust_remote_code,
                local_files_only=local_only,
                **kw,
            )
        except RuntimeError as e:  # transformers: "look at the above report" (console only)
            if "ignore_mismatched_sizes" not in str(e):
                raise
            config = self.hf_config(tokenizer)
            if head == "seq_cls":
                config.num_labels = kw["num_labels"]
            raise _files.ModelFilesError(_files.shape_mismatches(
                "model.name_or_path", self.name_or_path, auto_class(head), config)) from e
        if "quantization_config" not in extra:
            model = model.to(ctx.device)
        return finish_load(model, tokenizer, head)
