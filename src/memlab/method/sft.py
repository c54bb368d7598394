"""`method=sft`: supervised fine-tuning with next-token cross-entropy.

Rows: conversations (``messages``, with the row's ``tools``) through the tokenizer's chat
template, plain ``text``, or ``prompt`` + ``completion`` (strings or messages); plain text starts
with the tokenizer's BOS when it adds one and ends with its EOS (:mod:`memlab.data.text`). Loss
on completion / assistant tokens only by default (``loss_on=all`` for every token). A row the
chat template cannot split is left out under ``data.on_unsplittable=skip``. Order: format -> tokenize -> truncate
(``max_length``, keep_start | keep_end; skipped when the packing strategy keeps overflow
tokens itself) -> shifted labels per document -> (packing, by the pipeline) -> collate
(padded, or padding-free: one flat row with restarting position_ids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from memlab.data import chat, chat_cut, chat_cut_masks, cut, text
from memlab.data.base import DataError, check_text
from memlab.data.cut import Keep
from memlab.losses import chunked_linear_cross_entropy
from memlab.method import _rows
from memlab.method._knobs import HeadOn, PaddingFree, PadMultiple
from memlab.method._liger import LIGER_LOSS, LigerKnobs
from memlab.method.base import (
    IGNORE,
    LOSS_INDEX,
    Batch,
    DataStats,
    LigerUser,
    Offline,
    Pinnable,
    RowLayout,
    batch_key,
    decoder_hidden,
    drops_padding_mask,
    flatten_batch,
    head_at,
    label_positions,
    model_inputs,
    pad_batch,
    register,
    shifted_labels,
    tied_head_grad,
)
from memlab.model.base import Head
from memlab.registry import PositiveInt, Range
from memlab.trainer.routing import call_inside, unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("sft")
@dataclass(kw_only=True)
class SFT(Offline, HeadOn, PadMultiple, PaddingFree, LigerKnobs):
    """SFT knobs, named as in TRL's SFTConfig where one exists."""

    max_length: Annotated[int, Range(ge=2)] | None = 1024
    """Longest sequence (padded runs) or row capacity (packed runs). None = no limit."""
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    loss_on: Literal["completion", "all"] = "completion"
    """completion: assistant tokens of conversations / the completion of prompt-completion rows;
    all: every token. Plain text always trains on all tokens."""
    padding_free: bool | None = None  # type: ignore[assignment]  # None: as packing
    loss_impl: Literal["auto", "standard", "chunked"] = "auto"
    """chunked: fused linear + cross-entropy over token chunks; the full [tokens, vocab] logits
    never exist (pure PyTorch, any device), with the same loss and gradients as standard (the
    model's logits, then cross-entropy). auto (the default): chunked, except where a PEFT
    adapter sits on the output head (``peft.target_modules`` with ``lm_head``), whose weight
    the chunked loss reads directly, and in a distributed run (DDP, FSDP2, DeepSpeed: the
    chunked loss makes the head's gradient in forward, whole, and it stays so until backward
    reduces it; under FSDP2 that is an unsharded head-sized gradient, and memlab's estimates of
    DDP / FSDP2 runs with it are off by up to 7%): standard there. Measured at real size
    (Qwen2.5-0.5B, ``benchmarks/real_size.py``): the logits are ~600 MiB a copy at vocab
    151,936."""
    chunk_size: PositiveInt | None = None
    """Tokens per chunk for loss_impl=chunked. None (the default): 1024, fewer where a chunk's
    fp32 ``[chunk, vocab]`` block would pass 2**26 elements (256 MiB): 441 tokens at Qwen2.5's
    vocabulary (151,936), 523 at Llama 3's (vocabularies up to 65,536 keep 1024). A chunk's
    logits and their gradient are the loss's working memory; at Qwen2.5's vocabulary 1024
    tokens cost 593 MiB (measured at real size)."""
    data_kinds: ClassVar[tuple[str, ...]] = ("chat", "text")
    head: ClassVar[Head] = "causal_lm"
    items_name: ClassVar[str] = "loss tokens"

    # ------------------------------------------------------------------ capabilities
    def flat(self, ctx: BuildContext) -> bool:
        """Whether batches are collated padding-free."""
        if self.padding_free is None:
            return ctx.packing.packs
        return self.padding_free

    def row_layout(self, ctx: BuildContext) -> RowLayout:
        return RowLayout(supports_packing=True, supports_padding_free=True,
                         packs_rows=self.flat(ctx) or ctx.packing.packs,
                         row_length=self.max_length, pad_to_multiple_of=self.pad_to_multiple_of,
                         keeps_row_end=self.truncation_mode == "keep_end")

    def as_liger(self) -> LigerUser | None:
        return self

    def as_pinnable(self) -> Pinnable | None:
        return self

    def reads_head_weight(self, ctx: BuildContext) -> str | None:
        if self.liger_loss():
            return LIGER_LOSS
        return "method.loss_impl=chunked" if self.chunked(ctx) else None

    def pinned(self, ctx: BuildContext) -> SFT:
        if self.loss_impl != "auto":
            return self
        return dataclasses.replace(self, loss_impl="chunked" if self.chunked(ctx) else "standard")

    def chunked(self, ctx: BuildContext) -> bool:
        """Whether the loss is the chunked one (``loss_impl``; auto: unless the output head
        carries an adapter, or the run is distributed: DDP, FSDP2, DeepSpeed)."""
        if self.loss_impl == "auto":  # (a distributed option declares what it splits)
            dist = ctx.distributed
            return (not ctx.peft.adapts_head() and dist.sharding() is None
                    and dist.as_step_owner() is None)
        return self.loss_impl == "chunked"

    # ------------------------------------------------------------------ validation

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        if self.max_length is not None and self.max_length < 2:
            errors.append(f"method.max_length must be >= 2 or null (got {self.max_length})")
        if ctx.packing.packs and self.max_length is None:
            errors.append(
                f"packing={ctx.packing.name} needs a row capacity: set method.max_length "
                "(e.g. method.max_length=2048)"
            )
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of <= 0:
            errors.append("method.pad_to_multiple_of must be a positive integer or null")
        errors += self.liger_errors(ctx)
        if self.chunked(ctx) and self.chunk_size is not None and self.chunk_size <= 0:
            errors.append("method.chunk_size must be positive or null")
        return errors

    # ------------------------------------------------------------------ data
    def prepare(self, ds, tokenizer, ctx: BuildContext) -> tuple[Any, DataStats]:
        """format + tokenize + truncate + shifted labels, as one batched ``datasets.map``."""
        cols = set(ds.column_names)
        if "messages" in cols:
            fmt = "messages"
        elif "prompt" in cols and "completion" in cols:
            fmt = "prompt_completion"
        elif "text" in cols:
            fmt = "text"
        else:
            raise DataError(
                f"method=sft needs rows with 'messages', 'text', or 'prompt'+'completion'; "
                f"this dataset has columns {sorted(cols)}"
            )
        truncate = self.max_length is not None and not ctx.packing.keeps_overflow
        limit = self.max_length if truncate else None
        why = (f"packing={ctx.packing.name} keeps every token" if self.max_length is not None
               else "method.max_length=null keeps every token")

        def fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
            out: dict[str, list] = {"input_ids": [], "labels": [], "n_in": [], "n_train": [],
                                    "hollow": [], "n_cut": []}
            for j, row in enumerate(idx):
                item = {k: v[j] for k, v in batch.items()}
                try:
                    ids, mask, n_cut = self._encode(fmt, item, row, tokenizer, limit, why)
                except chat.SkippedRow:
                    continue
                out["n_cut"].append(n_cut)
                out["n_in"].append(len(ids))
                if limit is not None and len(ids) > limit:
                    if self.truncation_mode == "keep_start":
                        ids, mask = ids[:limit], mask[:limit]
                    else:
                        ids, mask = ids[-limit:], mask[-limit:]
                labels = shifted_labels(ids, mask)
                out["input_ids"].append(ids)
                out["labels"].append(labels)
                out["n_train"].append(len(labels) - labels.count(IGNORE))
                out["hollow"].append(self._hollow(fmt, item))
            return out

        key = hashlib.sha1(repr((ds._fingerprint, fmt, limit, cut.WHOLE_LIMIT, cut.SEARCH,
                                  self.truncation_mode, self.loss_on, tokenizer.name_or_path,
                                  len(tokenizer))).encode())
        out = ds.map(
            fn, batched=True, batch_size=256, with_indices=True, remove_columns=ds.column_names,
            keep_in_memory=True, new_fingerprint=key.hexdigest(), desc="tokenize",
        )
        n_in, n_train, hollow = out["n_in"], out["n_train"], out["hollow"]
        n_cut = out["n_cut"]
        lens = [len(x) for x in out["input_ids"]]
        out = out.remove_columns(["n_in", "n_train", "hollow", "n_cut"])
        stats = DataStats(
            examples=len(out), rows=len(out), tokens_in=int(sum(n_in)),
            tokens_dropped=int(sum(n_in) - sum(lens)), trainable_tokens=int(sum(n_train)),
            hollow_rows=int(sum(hollow)), hollow_what=(
                "every part the loss trains on is empty: a blank text"
                if self.loss_on == "all" else "every assistant turn / completion is empty, so "
                "only the end-of-turn token would be trained"),
        )
        if any(n_cut):  # tokens_in counts what was tokenized (memlab.data.cut)
            stats.extra["cut_before_tokenizing"] = {
                "rows": sum(1 for n in n_cut if n), "characters": int(sum(n_cut))}
        return out, stats

    def _hollow(self, fmt: str, row: dict) -> bool:
        """Whether every part of ``row`` the loss trains on is empty (nothing but the template's
        end-of-turn or EOS token would be trained); ``row`` as :meth:`_encode` read it (its
        messages normalized: roles, contents)."""
        if fmt == "text":
            return _rows.is_empty(row["text"])
        if fmt == "messages":
            turns = row["messages"] if self.loss_on == "all" else [
                m for m in row["messages"] if m.get("role") == "assistant"]
            return _rows.is_empty(turns)
        parts = [row["completion"]] + ([row["prompt"]] if self.loss_on == "all" else [])
        return all(_rows.is_empty(p) for p in parts)

    def _encode(self, fmt: str, row: dict, idx: int, tok, limit: int | None, why: str
                ) -> tuple[list[int], list[int], int]:
        """Ids, loss mask and characters cut off before tokenizing of one row. A string or
        conversation far longer than ``limit`` tokens is cut first, to the same kept ids and
        mask (:mod:`memlab.data.cut`, :mod:`memlab.data.chat_cut`); a field tokenized whole over
        ``cut.WHOLE_LIMIT`` characters is refused (``why``: why it is kept whole)."""
        train_completion = self.loss_on == "completion"
        tools = row.get("tools")
        keep = self.truncation_mode
        if fmt == "messages":
            if not train_completion:
                ids, n_cut = chat_cut.rendered_ids(tok, row["messages"], limit, keep, idx,
                                                   "messages", tools, kept_whole=why)
                return ids, [1] * len(ids), n_cut
            return chat_cut_masks.assistant_mask(tok, row["messages"], limit, keep, idx,
                                                 tools=tools, kept_whole=why)
        if fmt == "text":
            check_text(row["text"], idx, "text")
            ids, n_cut = cut.encode(tok, row["text"], limit, keep,
                                    lambda t: text.document_ids(tok, t), idx, "text",
                                    kept_whole=why)
            return ids, [1] * len(ids), n_cut
        prompt, completion = row["prompt"], row["completion"]
        n_cut = 0
        if isinstance(prompt, list):
            p, c, n_cut = _chat_pair(tok, prompt, completion, idx, tools, limit, keep, why)
            full = p + c
        else:
            check_text(prompt, idx, "prompt")
            if isinstance(completion, list):
                raise DataError(f"row {idx}: 'prompt' is a string but 'completion' is a list of "
                                "messages; use the same format (both strings or both messages)")
            check_text(completion, idx, "completion")
            # each part cut keeps >= limit tokens on the kept side: the kept window of
            # prompt + completion lies inside what is tokenized
            p, n_p = cut.encode(tok, prompt, limit, keep, lambda t: text.start_ids(tok, t), idx,
                                "prompt", kept_whole=why)
            c, n_c = cut.encode(tok, completion, limit, keep, lambda t: text.end_ids(tok, t),
                                idx, "completion", kept_whole=why)
            full, n_cut = p + c, n_p + n_c
        mask = [0] * len(p) + [1] * (len(full) - len(p)) if train_completion else [1] * len(full)
        return full, mask, n_cut

    # ------------------------------------------------------------------ batches
    def collate(self, rows: list[dict], tokenizer, ctx: BuildContext) -> Batch:
        columns = {"input_ids": tokenizer.pad_token_id, "labels": IGNORE}
        flat = self.flat(ctx)
        if flat:
            t, real, total = flatten_batch(rows, tokenizer.pad_token_id, self.pad_to_multiple_of,
                                           columns)
        else:
            packed = "seq_lengths" in rows[0]
            t, real, total = pad_batch(rows, tokenizer.pad_token_id, self.pad_to_multiple_of,
                                       columns, with_positions=packed)
            if not packed and self.causal_padding(ctx):
                del t["attention_mask"]  # positions: the model's own 0..T-1, shared by the rows
        if self.head_on == "labelled":
            t[LOSS_INDEX] = label_positions(t["labels"])
            n_items = t[LOSS_INDEX].numel()
        else:
            n_items = int((t["labels"] != IGNORE).sum())
        # a mask with padding in it takes the (larger) mask path; the head's logits grow with
        # the labelled positions
        return Batch(t, num_items=n_items, real_tokens=real, total_tokens=total,
                     size_key=batch_key(t, real, total, flat), meta={"samples": len(rows)})

    def causal_padding(self, ctx: BuildContext) -> bool:
        """Whether padded rows go without their attention mask (``padding_mask``)."""
        return drops_padding_mask(self.padding_mask, ctx)

    # ------------------------------------------------------------------ model
    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        model = models["policy"]
        t = batch.tensors
        inputs = model_inputs(t)
        index = t.get(LOSS_INDEX)  # head_on=labelled: the positions with a label
        labels = t["labels"].reshape(-1)
        if index is not None:
            labels = labels.index_select(0, index)
        if self.reads_head_weight(ctx) is not None:
            # decoder + head + loss in one call inside the wrapper's forward: under FSDP2 the
            # head's weight is gathered only there
            loss_sum = call_inside(model, self._fused_head_loss, labels, index, **inputs)
        else:
            with head_at(model, index):
                logits = model(**inputs, use_cache=False).logits
            loss_sum = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), labels,
                ignore_index=IGNORE, reduction="sum",
            )
        return loss_sum, {}

    def _fused_head_loss(self, model, labels: torch.Tensor, index: torch.Tensor | None,
                         **inputs: Any) -> torch.Tensor:
        """Summed token loss from the decoder's hidden states (at ``index`` only, when given)
        and the output head, never building the [tokens, vocab] logits (Liger's fused kernel,
        or memlab's chunked one)."""
        head = model.get_output_embeddings()
        # a tied weight (memlab's loss): the head's gradient of it goes to the embedding
        # lookup's backward, which adds its rows in place: one weight-sized gradient alive
        tying = contextlib.nullcontext() if self.liger_loss() else tied_head_grad(model,
                                                                                 head.weight)
        with tying as tied:
            hidden = decoder_hidden(model, **inputs)
            hidden = hidden.reshape(-1, hidden.shape[-1])
            if index is not None:
                hidden = hidden.index_select(0, index)
            bias = getattr(head, "bias", None)
            scale, softcap = head_post(model)
            if scale != 1.0:  # (s h) W^T = s (h W^T): the model's logit scale, before any cap
                hidden = hidden * scale
            if self.liger_loss():
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

                loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
                return loss_fn(head.weight, hidden, labels, bias)
            return chunked_linear_cross_entropy(hidden, head.weight, labels, bias=bias,
                                                chunk_size=self.chunk_size, reduction="sum",
                                                logit_softcap=softcap, weight_grad_to=tied)


def _chat_pair(tok, prompt: list[dict], completion: Any, idx: int, tools: Any,
               limit: int | None, keep: Keep, why: str) -> tuple[list[int], list[int], int]:
    """Prompt and completion ids of a conversational prompt-completion row, a field far longer
    than the ``limit`` tokens kept (at the start or end of prompt + completion) cut before
    tokenizing to the same kept ids (:mod:`memlab.data.chat_cut`); and the characters cut."""
    try:
        pr = chat_cut.prompt(tok, prompt, limit, keep, idx, tools, kept_whole=why)
        c, n_c = chat_cut.completion_ids(tok, pr, completion, limit, keep, idx, "completion",
                                         tools, fix=chat.SFT_FIX, kept_whole=why)
        return pr.ids, c, pr.n_cut + n_c
    except chat_cut.NotCut as e:  # tokenized whole, refused above the limit
        for name, value in (("prompt", prompt), ("completion", completion)):
            cut.check_size(value, idx, name, str(e))
        p = chat.prompt_ids(tok, prompt, idx, "prompt", tools=tools)
        return p, chat.completion_ids(tok, prompt, p, completion, idx, "completion",
                                      fix=chat.SFT_FIX, tools=tools), 0


def head_post(model) -> tuple[float, float | None]:
    """What the model's forward applies to the output head's logits, which a loss that reads
    the head's weight must apply too: ``(scale, softcap)``, logits = ``softcap * tanh(scale *
    head(h) / softcap)``. transformers' models do it by config: Cohere multiplies by
    ``logit_scale``, Granite divides by ``logits_scaling``, Gemma 2 / 3 soft-cap at
    ``final_logit_softcapping``; any other model: ``(1.0, None)``."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    scale = 1.0
    if config is not None and getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if config is not None and getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    cap = getattr(config, "final_logit_softcapping", None) if config is not None else None
    return scale, (float(cap) if cap is not None else None)
