"""Preference rows -> token ids, and the length limits that cut them (``dpo``, ``kto``,
``reward``, and the prompts of the online methods and ``gkd``).

Not an option of its own (the registry skips modules whose name starts with ``_``).

* **Rows -> tokens.** Conversational rows (``prompt`` a list of messages, completions lists of
  assistant messages): the prompt is rendered with the chat template and
  ``add_generation_prompt=True``; a completion is the suffix of the rendering of prompt +
  completion, after checking that this rendering starts with the prompt's (``DataError``
  naming the row otherwise); a row's ``tools`` go to the template. Plain-string rows
  (:mod:`memlab.data.text`): the ``prompt`` starts with the tokenizer's BOS when it adds one, the
  completion ends with its EOS (as SFT does). Rows without a ``prompt`` column (implicit prompt)
  get the longest common start of chosen and rejected as prompt: their common message prefix
  (conversational), or their common text up to the last whitespace before they differ (strings;
  the whitespace goes to the completions, as a tokenizer attaches it to the next word). A field
  far longer than the limits below keep is cut before tokenizing, to the same kept ids
  (:func:`encode_example`, :func:`encode_full`, :data:`WHOLE`).
* **Truncation** (all limits optional): the prompt is cut from the LEFT to
  ``max_prompt_length`` (its end, next to the answer, is kept), each completion from the RIGHT to
  ``max_completion_length``, then prompt + completion to ``max_length`` by cutting the
  completion further (keep_start on the completion side: the prompt is never cut by
  ``max_length``). An example whose prompt alone fills ``max_length`` is dropped and counted.
* **A unit in one row** (``packing=bfd``: a pair's sequences must fit one row of
  ``max_length`` tokens, the prompt counted once with ``share_prompt``, else once per
  sequence): :func:`fit_row` cuts the completions from the right to a common length ``k``, the
  largest that fits (the shorter ones are cut only if longer than ``k``); the prompt is never
  cut by it; a unit with no room for one token of each completion is dropped and counted.
* **Datasets.** :func:`map_rows` runs a row function (0, 1 or more output rows per input row) as
  one batched ``datasets.map`` (a row the chat template cannot split is left out there under
  ``data.on_unsplittable=skip``: :class:`memlab.data.chat.SkippedRow`); :func:`keep_rows` drops
  the rows a method flagged; :func:`kept` also counts what a preference method's row function
  tallied (:data:`TALLY`) into the dataset's :class:`~memlab.method.base.DataStats`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memlab.data import chat, chat_cut, cut, text
from memlab.data.base import DataError, check_messages, check_text
from memlab.method.base import DataStats


def length_errors(limits: Mapping[str, int | None]) -> list[str]:
    """Each length limit (``method.<name>``: its value) must be null or positive (>= 2 for
    max_length)."""
    errors = []
    for name, value in limits.items():
        low = 2 if name == "max_length" else 1
        if value is not None and value < low:
            errors.append(f"method.{name} must be >= {low} or null (got {value})")
    return errors


# ----------------------------------------------------------------------------------- rows


def split_implicit_prompt(chosen: Any, rejected: Any, idx: int) -> tuple[Any, Any, Any]:
    """Chosen / rejected without a prompt column: their common start is the prompt, the rest
    are the completions (module docstring)."""
    if isinstance(chosen, str) or isinstance(rejected, str):
        return _split_text(chosen, rejected, idx)
    check_messages(chosen, idx, "chosen")
    check_messages(rejected, idx, "rejected")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise DataError(
            f"row {idx}: without a 'prompt' field, 'chosen' and 'rejected' must share a message "
            "prefix (the prompt) and differ after it; add a 'prompt' field"
        )
    return chosen[:n], chosen[n:], rejected[n:]


def _split_text(chosen: Any, rejected: Any, idx: int) -> tuple[str, str, str]:
    check_text(chosen, idx, "chosen")
    check_text(rejected, idx, "rejected")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and not chosen[n - 1].isspace():  # back to a word start
        n -= 1
    while n > 0 and chosen[n - 1].isspace():  # the whitespace goes with the completions
        n -= 1
    if n == 0 or chosen == rejected:
        raise DataError(f"row {idx}: without a 'prompt' field, 'chosen' and 'rejected' must "
                        "start with the same words (the prompt) and differ after them; add a "
                        "'prompt' field")
    return chosen[:n], chosen[n:], rejected[n:]


WHOLE = "the prompt of an eval sample is tokenized whole"
"""Why :func:`encode_prompt` and :func:`encode_completion`, which tokenize whole, refuse a field
over :data:`memlab.data.cut.WHOLE_LIMIT` characters (an eval sample's prompt; the fields a cut
falls back to whole are checked first, with the reason they are not cut, :data:`KEPT` or
:mod:`memlab.data.chat_cut`'s). Where a method truncates, :func:`encode_example` and
:func:`encode_full` cut a field far longer than it keeps before tokenizing
(:mod:`memlab.data.cut`, :mod:`memlab.data.chat_cut`): the prompt kept at its end, completions
at their start (reward sequences at their end), to the same kept ids; so the limits (prompt
from the left, completions from the right, the example dropped when the prompt fills
max_length) decide the same as on whole tokenizations. The tokens counted in
(``data.tokens_in``) are those tokenized; the characters cut off before, in the ``data``
section's ``cut_before_tokenizing`` (:func:`kept`)."""
KEPT = ("the method keeps every token of it (its length limits are null: max_prompt_length, "
        "max_completion_length, max_length)")
"""Why a field is tokenized whole where no limit of the method cuts it."""


def keeps(*limits: int | None) -> int | None:
    """The fewest tokens any of ``limits`` keeps (None: no limit)."""
    set_ = [n for n in limits if n is not None]
    return min(set_) if set_ else None


def encode_example(tok, prompt: Any, completions: Sequence[tuple[Any, str]], idx: int,
                   tools: Any, prompt_keeps: int | None, completion_keeps: int | None
                   ) -> tuple[list[int], list[list[int]], int]:
    """Prompt ids and each completion's (``(value, field)``) ids that follow them, as
    :func:`encode_prompt` / :func:`encode_completion` make them; a field far longer than the
    method keeps (the prompt's last ``prompt_keeps`` tokens, a completion's first
    ``completion_keeps``) is cut before tokenizing to the same kept ids (:data:`WHOLE`). Also
    returns the characters cut off."""
    if not isinstance(prompt, list):
        check_text(prompt, idx, "prompt")
        p, n_cut = cut.encode(tok, prompt, prompt_keeps, "keep_end",
                              lambda t: text.start_ids(tok, t), idx, "prompt", kept_whole=KEPT)
        out = []
        for value, field in completions:
            _check_string_completion(value, idx, field)
            c, n = cut.encode(tok, value, completion_keeps, "keep_start",
                              lambda t: text.end_ids(tok, t), idx, field, kept_whole=KEPT)
            out.append(c)
            n_cut += n
        return p, out, n_cut
    try:
        pr = chat_cut.prompt(tok, prompt, prompt_keeps, "keep_end", idx, tools, kept_whole=KEPT)
        pairs = [chat_cut.completion_ids(tok, pr, value, completion_keeps, "keep_start", idx,
                                         field, tools, kept_whole=KEPT)
                 for value, field in completions]
        return pr.ids, [c for c, _ in pairs], pr.n_cut + sum(n for _, n in pairs)
    except chat_cut.NotCut as e:  # tokenized whole, refused above the limit
        for value, field in [(prompt, "prompt"), *completions]:
            cut.check_size(value, idx, field, str(e))
        p = encode_prompt(tok, prompt, idx, tools)
        return p, [encode_completion(tok, prompt, p, value, idx, field, tools)
                   for value, field in completions], 0


def encode_prompt(tok, prompt: Any, idx: int, tools: Any = None) -> list[int]:
    """Prompt tokens: the chat template with the generation prompt, or plain text (with the
    tokenizer's BOS when it adds one)."""
    cut.check_size(prompt, idx, "prompt", WHOLE)
    if isinstance(prompt, list):
        return chat.prompt_ids(tok, prompt, idx, "prompt", tools=tools)
    check_text(prompt, idx, "prompt")
    return text.start_ids(tok, prompt)


def prompt_ids(tok, prompt: Any, idx: int, tools: Any, keeps: int | None
               ) -> tuple[list[int], int]:
    """:func:`encode_prompt`, a prompt far longer than its last ``keeps`` tokens cut before
    tokenizing to the same last ``keeps`` ids; and the characters cut off."""
    if isinstance(prompt, list):
        pr = chat_cut.prompt(tok, prompt, keeps, "keep_end", idx, tools, kept_whole=KEPT)
        return pr.ids, pr.n_cut
    check_text(prompt, idx, "prompt")
    return cut.encode(tok, prompt, keeps, "keep_end", lambda t: text.start_ids(tok, t), idx,
                      "prompt", kept_whole=KEPT)


SAMPLE_TEXT_TOKENS = 32
"""Tokens of a plain-text row that prompt its eval sample (``train.eval_samples``)."""


def sample_prompt_ids(tok, row: dict, idx: int) -> list[int]:
    """The prompt of held-out row ``row`` for a greedy sample (``train.eval_samples``): a
    conversation (``messages``, or an implicit-prompt preference row's ``chosen``) up to its last
    user turn, with the generation prompt; a row's ``prompt``; plain text's first
    :data:`SAMPLE_TEXT_TOKENS` tokens."""
    tools = row.get("tools")
    conversation = row.get("messages") or (row.get("chosen") if row.get("prompt") is None
                                           and isinstance(row.get("chosen"), list) else None)
    if conversation:
        check_messages(conversation, idx, "messages")
        last = max((i for i, m in enumerate(conversation) if m["role"] == "user"), default=None)
        if last is None:
            raise DataError(f"row {idx}: the conversation has no user turn to prompt a sample "
                            "with")
        return chat.prompt_ids(tok, conversation[:last + 1], idx, "messages", tools=tools)
    if row.get("prompt") is not None:
        return encode_prompt(tok, row["prompt"], idx, tools)
    if isinstance(row.get("text"), str):
        return text.start_ids(tok, row["text"])[:SAMPLE_TEXT_TOKENS]
    raise DataError(f"row {idx}: no prompt, conversation or text to prompt a sample with "
                    f"(columns {sorted(row)})")


def encode_completion(tok, prompt: Any, prompt_ids: list[int], completion: Any, idx: int,
                      field: str, tools: Any = None) -> list[int]:
    """Completion tokens that follow ``prompt_ids`` (see the module docstring)."""
    cut.check_size(completion, idx, field, WHOLE)
    if isinstance(prompt, list):
        return chat.completion_ids(tok, prompt, prompt_ids, completion, idx, field, tools=tools)
    _check_string_completion(completion, idx, field)
    return text.end_ids(tok, completion)


def _check_string_completion(completion: Any, idx: int, field: str) -> None:
    if isinstance(completion, list):
        raise DataError(f"row {idx}: 'prompt' is a string but '{field}' is a list of messages; "
                        "use the same format (both strings or both messages)")
    check_text(completion, idx, field)


def encode_full(tok, prompt: Any | None, completion: Any, idx: int, field: str,
                tools: Any = None, keeps: int | None = None) -> tuple[list[int], int]:
    """One whole sequence (reward models): prompt + completion, or the completion alone when it
    is a full conversation / text; a field far longer than the sequence's last ``keeps`` tokens
    is cut before tokenizing to the same last ``keeps`` ids. Also returns the characters cut."""
    if prompt is None:
        if isinstance(completion, list):
            return chat_cut.rendered_ids(tok, completion, keeps, "keep_end", idx, field, tools,
                                         kept_whole=KEPT)
        check_text(completion, idx, field)
        return cut.encode(tok, completion, keeps, "keep_end",
                          lambda t: text.document_ids(tok, t), idx, field, kept_whole=KEPT)
    if not isinstance(prompt, list):
        p, n_p = prompt_ids(tok, prompt, idx, tools, keeps)
        _check_string_completion(completion, idx, field)
        c, n_c = cut.encode(tok, completion, keeps, "keep_end",
                            lambda t: text.end_ids(tok, t), idx, field, kept_whole=KEPT)
        return p + c, n_p + n_c
    try:
        pr = chat_cut.prompt(tok, prompt, keeps, "keep_end", idx, tools, kept_whole=KEPT)
        c, n_c = chat_cut.completion_ids(tok, pr, completion, keeps, "keep_end", idx, field,
                                         tools, kept_whole=KEPT)
        return pr.ids + c, pr.n_cut + n_c
    except chat_cut.NotCut as e:  # tokenized whole, refused above the limit
        for value, name in [(prompt, "prompt"), (completion, field)]:
            cut.check_size(value, idx, name, str(e))
        p = encode_prompt(tok, prompt, idx, tools)
        return p + encode_completion(tok, prompt, p, completion, idx, field, tools), 0


# ----------------------------------------------------------------------------------- truncation


def truncate(prompt: list[int], completions: list[list[int]], max_prompt_length: int | None,
             max_completion_length: int | None, max_length: int | None
             ) -> tuple[list[int], list[list[int]], int] | None:
    """Apply the three limits (module docstring). Returns ``(prompt, completions, dropped)``
    where ``dropped`` counts removed tokens over all ``prompt + completion`` sequences, or None
    when the prompt alone fills ``max_length`` (the example cannot be trained on)."""
    n_in = sum(len(prompt) + len(c) for c in completions)
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        prompt = prompt[len(prompt) - max_prompt_length:]
    if max_completion_length is not None:
        completions = [c[:max_completion_length] for c in completions]
    if max_length is not None:
        room = max_length - len(prompt)
        if room <= 0:
            return None
        completions = [c[:room] for c in completions]
    kept = sum(len(prompt) + len(c) for c in completions)
    return prompt, completions, n_in - kept


def fit_row(prompt_len: int, completions: list[list[int]], capacity: int, shared: bool
            ) -> tuple[list[list[int]], int] | None:
    """A unit of ``prompt + completion`` sequences cut to fit one row of ``capacity`` tokens
    (module docstring). Returns ``(completions, tokens cut)``, or None (drop the unit)."""
    lengths = [len(c) for c in completions]
    room = capacity - (prompt_len if shared else prompt_len * len(completions))
    if sum(lengths) <= room:
        return completions, 0
    if room < sum(1 for n in lengths if n):
        return None
    low, high = 1, max(lengths)  # the largest common length k that fits
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(n, mid) for n in lengths) <= room:
            low = mid
        else:
            high = mid - 1
    cut = [c[:low] for c in completions]
    return cut, sum(lengths) - sum(len(c) for c in cut)


# ----------------------------------------------------------------------------------- datasets


def is_empty(completion: Any) -> bool:
    """A completion with nothing in it: a blank string, or messages whose contents are all
    blank (its tokens are then only the EOS or the template's end-of-turn: nothing to learn)."""
    if isinstance(completion, str):
        return not completion.strip()
    if isinstance(completion, list):
        return all(isinstance(m, dict) and not str(m.get("content") or "").strip()
                   and not m.get("tool_calls") for m in completion)
    return False


SAME_PAIRS = ("pairs whose chosen and rejected tokens are the same (after truncation), so "
              "the loss cannot prefer one")
"""What a hollow preference pair is (:func:`same_pairs`)."""
EMPTY_COMPLETIONS = "examples whose completion is empty"
"""What a hollow unpaired example is (KTO)."""


def same_pairs(ds: Any) -> int:
    """Prepared pairs (``chosen_ids`` / ``rejected_ids`` columns) whose two sequences are the
    same tokens: the loss of such a pair is a constant (DPO's ``log 2``), its gradient zero."""
    return sum(c == r for c, r in zip(ds["chosen_ids"], ds["rejected_ids"], strict=True))


def content_tokens(completion: Any, ids: list[int]) -> tuple[int, int]:
    """``(trainable tokens, 1 if empty else 0)`` of one completion and its kept token ids."""
    return (0, 1) if is_empty(completion) else (len(ids), 0)


def map_rows(ds, fn: Callable[[dict, int], list[dict]], columns: Sequence[str], key: Any,
             desc: str):
    """``fn(row, idx) -> output rows`` over the dataset (0, 1 or more rows per input row) as one
    batched ``datasets.map``; output columns ``columns``."""

    def batch_fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        out: dict[str, list] = {c: [] for c in columns}
        for j, i in enumerate(idx):
            try:
                rows = fn({k: v[j] for k, v in batch.items()}, i)
            except chat.SkippedRow:
                continue
            for row in rows:
                for c in columns:
                    out[c].append(row[c])
        return out

    fp = hashlib.sha1(repr((ds._fingerprint, key, cut.WHOLE_LIMIT, cut.SEARCH)).encode()
                      ).hexdigest()
    return ds.map(batch_fn, batched=True, batch_size=256, with_indices=True,
                  remove_columns=ds.column_names, keep_in_memory=True, new_fingerprint=fp,
                  desc=desc)


def keep_rows(ds, keep_column: str = "keep", drop: Sequence[str] = ()):
    """Rows whose ``keep`` flag is set, without the bookkeeping columns."""
    keep = ds[keep_column]
    if not all(keep):
        ds = ds.select([i for i, k in enumerate(keep) if k], keep_in_memory=True)
    return ds.remove_columns([keep_column, *drop])


TALLY = ("n_in", "n_dropped", "n_train", "n_empty", "n_cut")
"""The columns a preference method's row function tallies per row (``dpo``, ``kto``,
``reward``): tokens in (a shared prompt once), tokens dropped by truncation (all of them for a
dropped row), tokens trained on, empty completions, characters cut off before tokenizing."""


def kept(ds, drop: Sequence[str] = ()) -> tuple[Any, DataStats]:
    """The rows flagged ``keep``, without the :data:`TALLY` columns (nor ``drop``), and the
    counts those columns and flags give: tokens in and dropped, examples dropped, trainable
    tokens, ``empty_completions``. One example per row; the method adds what else it counts
    (hollow rows, ...)."""
    n_in, n_dropped, keep = ds["n_in"], ds["n_dropped"], ds["keep"]
    n_train, n_empty, n_cut = ds["n_train"], ds["n_empty"], ds["n_cut"]
    out = keep_rows(ds, drop=(*TALLY, *drop))
    return out, DataStats(examples=len(out), rows=len(out), tokens_in=int(sum(n_in)),
                          tokens_dropped=int(sum(n_dropped)),
                          examples_dropped=int(len(keep) - sum(keep)),
                          trainable_tokens=int(sum(n_train)),
                          extra={"empty_completions": int(sum(n_empty)), **cut_extra(n_cut)})


def cut_extra(n_cut: Sequence[int]) -> dict[str, Any]:
    """The ``data`` section's ``cut_before_tokenizing`` entry (none when nothing was cut): the
    rows cut and the characters cut off; ``tokens_in`` counts what was tokenized."""
    if not any(n_cut):
        return {}
    return {"cut_before_tokenizing": {"rows": sum(1 for n in n_cut if n),
                                      "characters": int(sum(n_cut))}}
