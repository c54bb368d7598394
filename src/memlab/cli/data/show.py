"""What ``memlab data show`` finds and prints: the first rows of the first micro-batches, taken
from the collated batches the trainer receives.

The data goes through the run's own steps (:func:`memlab.pipeline.prepare_rows`, the packing
option, :func:`memlab.pipeline.batch_stream`): the same conversion, chat template, truncation,
packing, shuffle and collator. Each row of a batch is cut into its documents (the batch's
``segments``, else its attention mask, else the prepared row's length) and each token is marked
when it carries a loss: token ``p`` is marked when ``labels[p - 1]`` is not ignored (the label
at ``p - 1`` is the token at ``p``, which the model is trained to predict there), and, in a
shared-prompt layout, the first token of a completion that the prompt's last token predicts
through a fork label. A reward model's batch marks the tokens its head reads (``last_index``);
an online method's batch holds prompts only (its completions are generated in training).

Where a document comes from is traced for methods whose prepared rows are token sequences
(SFT): the data is tokenized a second time without truncation, and a document is matched to the
example whose tokens it starts (``keep_start``) or ends (``keep_end``) with: its file and line,
how many tokens truncation cut, whether memlab's training template rendered it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from memlab.losses import IGNORE
from memlab.measure.console import printable

TRACE_TOKENS = 16
"""Tokens of a document's start (or end) used to find its example."""


@dataclass
class Document:
    """One document of a shown row: ``[start, end)`` of the row."""

    start: int
    end: int
    origin: str | None = None
    """Where its example comes from (file and line...), when traced."""
    notes: list[str] = field(default_factory=list)
    """Truncated, rendered with the training template, a piece of a longer example..."""


@dataclass
class Row:
    """One row of a collated micro-batch, as the trainer receives it."""

    batch: int
    row: int
    ids: list[int]
    documents: list[Document]
    marked: set[int]
    """Positions of tokens that carry a loss (or that a reward head reads)."""
    padding: int


@dataclass
class Report:
    """What ``memlab data show`` prints."""

    header: list[str]
    rows: list[Row]
    marks: str
    """What a marked token is."""


def inspect(ctx, tokenizer, n_rows: int) -> Report:
    """The first ``n_rows`` rows of the run's first micro-batches, traced (module docstring)."""
    from memlab.pipeline import batch_stream, note_hollow, pack, prepare_rows

    raw, prepared, stats, tally = prepare_rows(ctx, tokenizer)
    ds, stats = pack(ctx, prepared, stats)
    note_hollow(ctx, stats)
    if stats.hollow_rows:
        stats.extra.setdefault("hollow_rows", stats.hollow_rows)
    stream = batch_stream(ctx, tokenizer, ds)
    rows: list[Row] = []
    batch_no = 0
    marks = "tokens that carry a loss"
    while len(rows) < n_rows and batch_no < len(ds):
        items = ds[stream.next_indices()]
        batch = next(stream)
        t = batch.tensors
        if "input_ids" not in t:
            marks = "nothing: this method trains on the completions it generates; the prompts"
            rows += _prompt_rows(t, batch_no)
        else:
            if "labels" not in t or not bool((t["labels"] != IGNORE).any()):
                marks = "the tokens the reward head reads"
            rows += _rows_of(t, items, batch_no, tokenizer.pad_token_id)
        batch_no += 1
    rows = rows[:n_rows]
    _trace(ctx, tokenizer, raw, prepared, tally, rows)
    return Report(_header(ctx, stats, len(raw)), rows, marks)


# ----------------------------------------------------------------------------------- batches


def _rows_of(t: dict[str, Any], items: dict[str, list], batch_no: int, pad: int) -> list[Row]:
    ids = t["input_ids"]
    labels = t.get("labels")
    segments = t.get("segments")
    mask = t.get("attention_mask")
    lengths = [len(x) for x in items.get("input_ids", [])]
    n_rows, width = ids.shape
    scored = labels is not None and bool((labels != IGNORE).any())
    out = []
    for r in range(n_rows):
        row_ids = ids[r].tolist()
        forked: set[int] = set()
        if segments is not None:
            docs = [Document(a, b) for a, b, _ in segments.documents(r)]
            if "fork_index" in t and t["fork_index"].numel():
                forked = {a for a, _, prefix in segments.documents(r) if prefix is not None}
            if docs and _is_padding(row_ids[docs[-1].start:], pad, labels, r, docs[-1]):
                docs = docs[:-1]  # the pad tail is a document of its own
        elif mask is not None:
            real = mask[r].nonzero().flatten().tolist()
            docs = [Document(real[0], real[-1] + 1)] if real else []
        elif len(lengths) == n_rows:
            docs = [Document(0, lengths[r])]
        else:
            end = width
            while end and row_ids[end - 1] == pad:
                end -= 1
            docs = [Document(0, end)]
        marked = set(forked)
        if scored and labels is not None:
            row_labels = labels[r].tolist()
            marked |= {p for p in range(1, width) if row_labels[p - 1] != IGNORE}
        elif "last_index" in t:  # a reward model: the tokens its head reads
            read = t["last_index"].tolist()
            if segments is None and len(read) == n_rows:  # padded: a position in each row
                marked.add(int(read[r]))
            else:  # flat indices into the batch
                marked |= {int(i) - r * width for i in read if r * width <= i < (r + 1) * width}
        real = sum(d.end - d.start for d in docs)
        out.append(Row(batch_no, r, row_ids, docs, marked, width - real))
    return out


def _is_padding(ids: list[int], pad: int, labels, r: int, doc: Document) -> bool:
    """Whether the last document of a packed row is its pad tail: pad tokens, no label."""
    if doc.start == 0 or any(i != pad for i in ids):
        return False
    return labels is None or bool((labels[r, doc.start:doc.end] == IGNORE).all())


def _prompt_rows(t: dict[str, Any], batch_no: int) -> list[Row]:
    ids, mask = t["prompt_ids"], t["prompt_mask"]
    out = []
    for r in range(ids.shape[0]):
        real = mask[r].nonzero().flatten().tolist()
        docs = [Document(real[0], real[-1] + 1)] if real else []
        out.append(Row(batch_no, r, ids[r].tolist(), docs, set(), ids.shape[1] - len(real)))
    return out


# ----------------------------------------------------------------------------------- tracing


def _trace(ctx, tokenizer, raw, prepared, tally, rows: list[Row]) -> None:
    """Each shown document's example: where it comes from, what truncation and the chat
    template did to it (SFT-style prepared rows only)."""
    if "input_ids" not in prepared.column_names or not rows:
        return
    from memlab.cli.lengths.data import untruncated
    from memlab.data import chat

    ctx_full = untruncated(ctx)
    rows_in, _ = ctx.data.convert(raw)
    with chat.rendering(tokenizer, ctx.data):
        whole, _ = ctx_full.method.prepare(rows_in, tokenizer, ctx_full)
    keep_end = ctx.method.row_layout(ctx).keeps_row_end
    wanted: dict[tuple[int, ...], list[Document]] = {}
    pieces: dict[int, list[int]] = {}
    for row in rows:
        for doc in row.documents:
            ids = row.ids[doc.start:doc.end]
            pieces[id(doc)] = ids
            key = tuple(ids[-TRACE_TOKENS:] if keep_end else ids[:TRACE_TOKENS])
            wanted.setdefault(key, []).append(doc)
    skipped = set(tally.skipped_rows)
    source = [i for i in range(len(rows_in)) if i not in skipped]  # prepared row -> row read
    template_rows = set(tally.template_rows)
    found: set[int] = set()
    j = 0
    for batch in whole.iter(batch_size=512):
        for full in batch["input_ids"]:
            key = tuple(full[-TRACE_TOKENS:] if keep_end else full[:TRACE_TOKENS])
            for doc in wanted.get(key, []):
                kept = pieces[id(doc)]
                match = full[-len(kept):] == kept if keep_end else full[:len(kept)] == kept
                if id(doc) in found or not match:
                    continue
                found.add(id(doc))
                at = source[j]
                doc.origin = ctx.data.locate(raw, at)
                if len(full) > len(kept):
                    doc.notes.append(f"truncated from {len(full)} tokens")
                if at in template_rows:
                    doc.notes.append(f"rendered with memlab's {tally.template} training template")
            j += 1
    for row in rows:
        for doc in row.documents:
            if id(doc) not in found:
                doc.notes.append("not traced to an example (a piece of a longer one?)")


# ----------------------------------------------------------------------------------- text


def _header(ctx, stats, n_read: int) -> list[str]:
    from memlab.measure.summary import data_notes

    choices = ctx.choices or {}
    lines = [f"method={ctx.method.name} packing={ctx.packing.name} "
             f"data={choices.get('data', ctx.data.name)}: {n_read} rows read, "
             f"{stats.examples} examples prepared into {stats.rows} rows, "
             f"{stats.tokens_in} tokens ({stats.tokens_dropped} cut by truncation / packing, "
             f"{stats.examples_dropped} examples dropped)"]
    return lines + data_notes(stats.extra)


def format_report(report: Report, tokenizer, color: bool, max_chars: int | None) -> str:
    """The report as text: marked tokens in colour, or between ``[[`` and ``]]``."""
    open_, close = ("\x1b[1;32m", "\x1b[0m") if color else ("[[", "]]")
    legend = "green" if color else "[[...]]"
    out = [*map(printable, report.header), f"marked ({legend}): {report.marks}", ""]
    for row in report.rows:
        n_docs = len(row.documents)
        out.append(f"--- micro-batch {row.batch}, row {row.row}: {len(row.ids)} tokens, "
                   f"{n_docs} document{'s' if n_docs != 1 else ''}, {len(row.marked)} marked, "
                   f"{row.padding} padding")
        for k, doc in enumerate(row.documents):
            n_marked = sum(1 for p in row.marked if doc.start <= p < doc.end)
            where = f": {doc.origin}" if doc.origin else ""
            notes = f" ({'; '.join(doc.notes)})" if doc.notes else ""
            out.append(printable(f"document {k + 1}, tokens {doc.start}-{doc.end - 1} "
                                 f"({doc.end - doc.start} tokens, {n_marked} marked){where}"
                                 f"{notes}"))
            out.append(marked_text(tokenizer, row.ids[doc.start:doc.end],
                                   {p - doc.start for p in row.marked}, open_, close,
                                   max_chars))
        out.append("")
    return "\n".join(out)


def marked_text(tokenizer, ids: list[int], marked: set[int], open_: str, close: str,
                max_chars: int | None = None) -> str:
    """``ids`` decoded (special tokens shown), each run of marked positions between ``open_``
    and ``close``."""
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and (j in marked) == (i in marked):
            j += 1
        # the data's own control characters shown as escapes (never sent to the terminal)
        piece = printable(tokenizer.decode(ids[i:j], skip_special_tokens=False),
                          keep_newlines=True)
        parts.append(f"{open_}{piece}{close}" if i in marked else piece)
        i = j
    text = "".join(parts)
    if max_chars and len(text) > max_chars:
        text = text[:max_chars] + f"... ({len(text) - max_chars} more characters)"
    return text


def as_dict(report: Report) -> dict[str, Any]:
    """The report as plain data (``--json``)."""
    return {"header": report.header, "marks": report.marks,
            "rows": [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "marked"},
                      "marked": sorted(r.marked)} for r in report.rows]}
