"""Rows in other shapes -> memlab's row formats (the dataset types of TRL's guide), and the
settings every ``data=`` option shares (:class:`RowOptions`).

memlab reads the types of TRL's dataset-formats guide, standard (strings) or conversational
(lists of ``{role, content}`` messages): language modeling (``text`` / ``messages``), prompt-only
(``prompt``), prompt-completion (``prompt`` + ``completion``), preference (``prompt`` +
``chosen`` + ``rejected``, or implicit: ``chosen`` + ``rejected`` sharing their start) and
unpaired preference (``prompt`` + ``completion`` + ``label``). Other shapes are converted:

* **on load, per dataset** (:func:`convert`, row for row, so a row keeps its index):
  ``data.columns`` renames columns; ShareGPT's ``conversations`` column becomes ``messages``
  (and a ``system`` column, when there is one, each conversation's first turn); Alpaca rows (``instruction``, optional ``input`` and ``system``, ``output``) become
  conversational prompt-completion rows: the prompt is the system turn (if any) and one user
  turn, ``instruction`` followed by a blank line and ``input`` when ``input`` is not empty; the
  completion is one assistant turn, ``output``. Only Alpaca and a ShareGPT ``system`` column
  need a pass over the rows (``datasets.map``, written to the dataset's cache when it has one);
  renaming is free.
* **when a row is read, per message** (:func:`memlab.data.base.normalize_messages`, called by
  every check of a conversational field): ShareGPT's ``from`` / ``value`` become ``role`` / ``content`` (human ->
  user, gpt -> assistant, ...); content given as a list of text parts
  (``[{"type": "text", "text": ...}]``) becomes their text, joined; keys whose value is null
  are dropped (columnar storage gives every message every key any message has: a user turn would
  otherwise carry ``tool_calls: null``, which templates read as defined), except ``content``,
  which may be null in an assistant turn that carries OpenAI-style ``tool_calls``. A row's
  ``tools`` (a list of JSON schemas, or one JSON string) gets the same cleaning
  (:func:`memlab.data.base.normalize_tools`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from memlab.data.base import DataError, SplitSource, original_row
from memlab.registry import Fraction, Option, Range
from memlab.trainer.inputs import Inputs, of_data, summary_files

_VERSION = "1"
"""Part of the cache key of converted datasets: bump when a conversion changes."""

ROW_NAMES = ("messages", "text", "prompt", "completion", "chosen", "rejected", "label", "tools",
             "margin", "conversations", "instruction", "input", "output", "system")
"""Column names memlab reads (the TRL dataset types, ShareGPT's and Alpaca's): the targets
``data.columns`` may map onto."""


TEMPLATE_ARGUMENTS = ("messages", "conversation", "tools", "documents", "chat_template",
                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                      "truncation", "max_length", "return_tensors", "return_dict",
                      "return_assistant_tokens_mask", "tokenizer_kwargs",
                      "sanitize_control_tokens")
"""Names ``data.chat_template_kwargs`` may not use (memlab or ``apply_chat_template`` sets
them)."""


@dataclass(kw_only=True)
class RowOptions(Option):
    """How rows are read and rendered: the fields every ``data=`` option shares."""

    columns: dict[str, str] | None = None
    """Columns renamed on load, ``{name in the data: memlab's name}``, e.g.
    ``data.columns={question: prompt, answer: completion}``. memlab's names: messages, text,
    prompt, completion, chosen, rejected, label, tools, margin, and ShareGPT's conversations /
    Alpaca's instruction, input, output, system (converted after the renaming)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (keyword arguments of
    ``apply_chat_template``), e.g. ``data.chat_template_kwargs={enable_thinking: false}``."""
    training_template: Literal["auto", "off"] = "auto"
    """auto: a conversation whose chat template cannot be split into exact assistant turns is
    rendered with memlab's training template for the template's family (Qwen3, Mistral
    v0.3 / Nemo), which carries ``{% generation %}`` markers; the summary's
    ``data.chat_template`` counts those rows. off: such rows stay unsplittable."""
    on_unsplittable: Literal["error", "skip"] = "error"
    """A row the chat template still cannot split into exact prompt / answer tokens. error:
    the run is invalid, naming the row and why; skip: the row is left out and counted
    (``data.unsplittable``, with where the first ones are)."""
    max_hollow_fraction: Fraction = 0.5
    """The share of hollow examples (``data.hollow_rows`` of the summary: rows that carry no
    training signal, such as SFT rows whose every assistant turn is empty or preference pairs
    whose chosen and rejected are the same) above which the run warns, on stderr and in the
    summary (``data.hollow_warning``); online methods count their reward groups of zero
    variance the same way (``data.hollow_groups``). Data in which every example is hollow is
    refused (``invalid``) whatever this is."""
    eval: Annotated[float, Range(gt=0, lt=1)] | str | None = None
    """Held-out data the run evaluates on (``train.eval_every``): a fraction in (0, 1) of the
    rows as read, held out with a fixed seed (the same rows whatever ``train.seed``; never
    trained on), e.g. ``data.eval=0.05``; a file, glob or directory of rows in any format
    ``data=local`` reads (``data.eval=val.jsonl``, with this option's ``columns``); or, for
    ``data=hub``, a split of the same dataset (``data.eval=test``). The rows go through the
    run's own preparation (chat template, truncation, packing). null: no evaluation."""

    def eval_kind(self) -> Literal["fraction", "path", "split"] | None:
        """What ``eval`` names: a fraction, a path (it exists, or looks like one: a ``/``, a
        glob, a data file's suffix), or otherwise a split name."""
        value = self.eval
        if value is None:
            return None
        if not isinstance(value, str):
            return "fraction"
        if (Path(value).expanduser().exists() or any(c in value for c in "/*?[")
                or Path(value).suffix in (".jsonl", ".json", ".parquet", ".csv")):
            return "path"
        return "split"

    def as_split_source(self) -> SplitSource | None:
        """This source, when it has named splits (``data.eval=<split name>``): none here."""
        return None

    def eval_errors(self) -> list[str]:
        """Problems of ``eval`` found before anything is read (each names its fix)."""
        from memlab.data import heldout

        kind = self.eval_kind()
        if kind == "split" and self.as_split_source() is None:
            return [f"data.eval={self.eval}: no such file, and data={self.name} "
                    "has no named splits; give a fraction of the rows (data.eval=0.05) or a "
                    "file (data.eval=val.jsonl)"]
        if kind == "path":
            return heldout.path_errors(str(self.eval))
        return []

    def row_errors(self) -> list[str]:
        """Problems of the shared fields (each names its fix)."""
        errors = self.eval_errors()
        columns = self.columns or {}
        bad = {k: v for k, v in columns.items() if not isinstance(k, str) or v not in ROW_NAMES}
        if bad:
            errors.append(f"data.columns: {bad} maps onto names memlab does not read; map "
                          f"each column onto one of {', '.join(ROW_NAMES)}")
        targets = list(columns.values())
        twice = sorted({t for t in targets if targets.count(t) > 1})
        if twice:
            errors.append(f"data.columns maps several columns onto {', '.join(twice)}; map one "
                          "column onto each name")
        bad_kwargs = [k for k in self.chat_template_kwargs or {}
                      if not str(k).isidentifier() or k in TEMPLATE_ARGUMENTS]
        if bad_kwargs:
            errors.append(f"data.chat_template_kwargs: {bad_kwargs} cannot be template "
                          "variables (a name of letters, digits and _, not one memlab or "
                          f"apply_chat_template sets: {', '.join(TEMPLATE_ARGUMENTS)}); a row's "
                          "tools go in its 'tools' column")
        return errors

    def convert(self, ds: Any) -> tuple[Any, dict[str, int]]:
        return convert(ds, self.columns)

    def place(self, index: int) -> str:
        """Where row ``index`` of the data as read (before any sample or shuffle) comes from."""
        return f"row {index}"

    def locate(self, ds: Any, row: int) -> str:
        return self.place(original_row(ds, row))

    def summary(self, ds: Any) -> dict[str, Any]:
        """``files``: every file the rows and the held-out rows are read from, with its
        SHA-256 (:func:`memlab.trainer.inputs.summary_files`; none for generated data)."""
        files = summary_files(of_data(self))
        return {"files": files} if files else {}

    def inputs(self) -> dict[str, Inputs]:
        """Nothing read from outside (data generated from the config); file and hub sources
        name theirs."""
        return {}


# ----------------------------------------------------------------------------------- datasets


def convert(ds: Any, columns: dict[str, str] | None = None) -> tuple[Any, dict[str, int]]:
    """``ds`` with ``columns`` renamed and ShareGPT / Alpaca rows converted (module docstring),
    and ``{what was converted: rows}`` (empty when nothing was)."""
    done: dict[str, int] = {}
    if columns:
        names = set(ds.column_names)
        missing = sorted(c for c in columns if c not in names)
        if missing:
            raise DataError(f"data.columns renames {missing}, which the data does not have; its "
                            f"columns: {sorted(names)}")
        clash = sorted(t for s, t in columns.items() if t in names and t not in columns)
        if clash:
            raise DataError(f"data.columns maps a column onto {clash}, which the data has "
                            "already; map that column elsewhere too, or drop the mapping")
        ds = ds.rename_columns(dict(columns))
        done["columns"] = len(ds)
    names = set(ds.column_names)
    if "conversations" in names and "messages" not in names:
        ds = ds.rename_column("conversations", "messages")
        done["sharegpt"] = len(ds)
        if "system" in names:
            ds = _system_into_messages(ds)
            done["system"] = len(ds)
    elif {"instruction", "output"} <= names and not names & {"messages", "prompt", "text"}:
        ds = _from_alpaca(ds)
        done["alpaca"] = len(ds)
    return ds, done


def _system_into_messages(ds):
    """A ShareGPT ``system`` column becomes each conversation's first (system) turn, unless the
    conversation has one already."""
    import datasets

    features = datasets.Features({k: v for k, v in ds.features.items() if k != "system"})
    features["messages"] = datasets.List(datasets.Json())

    def fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        out = []
        for j, row in enumerate(idx):
            system, messages = batch["system"][j], batch["messages"][j]
            if system is not None and not isinstance(system, str):
                raise DataError(f"row {row}: field 'system' must be a string (a ShareGPT "
                                f"system prompt), got {type(system).__name__}")
            first = messages[0] if isinstance(messages, list) and messages else {}
            has_one = isinstance(first, dict) and "system" in (first.get("role"),
                                                               first.get("from"))
            if system and not has_one:
                messages = [{"role": "system", "content": system}, *messages]
            out.append(messages)
        return {"messages": out}

    key = hashlib.sha1(repr(("system", _VERSION, ds._fingerprint)).encode()).hexdigest()
    return ds.map(fn, batched=True, batch_size=256, with_indices=True, features=features,
                  remove_columns=["system"], keep_in_memory=not ds.cache_files,
                  new_fingerprint=key, desc="system prompts into conversations")


def _from_alpaca(ds):
    import datasets

    cols = set(ds.column_names)
    message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    features = {k: v for k, v in ds.features.items()
                if k not in ("instruction", "input", "output", "system")}
    features = datasets.Features({**features, "prompt": datasets.List(message),
                                  "completion": datasets.List(message)})

    def fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"prompt": [], "completion": []}
        for j, row in enumerate(idx):
            get = {k: batch[k][j] for k in ("instruction", "input", "output", "system")
                   if k in cols}
            for key, value in get.items():
                if value is not None and not isinstance(value, str):
                    raise DataError(f"row {row}: field '{key}' must be a string (an Alpaca row: "
                                    f"instruction, input, output), got {type(value).__name__}")
            if not get.get("instruction") or get.get("output") is None:
                raise DataError(f"row {row}: an Alpaca row needs a non-empty 'instruction' and "
                                "an 'output'")
            user = get["instruction"] + (f"\n\n{get['input']}" if get.get("input") else "")
            system = [{"role": "system", "content": get["system"]}] if get.get("system") else []
            out["prompt"].append(system + [{"role": "user", "content": user}])
            out["completion"].append([{"role": "assistant", "content": get["output"]}])
        return out

    key = hashlib.sha1(repr(("alpaca", _VERSION, ds._fingerprint)).encode()).hexdigest()
    return ds.map(fn, batched=True, batch_size=256, with_indices=True, features=features,
                  remove_columns=sorted(cols & {"instruction", "input", "output", "system"}),
                  keep_in_memory=not ds.cache_files, new_fingerprint=key,
                  desc="convert Alpaca rows")




# ----------------------------------------------------------------------------------- row types


def row_type(ds: Any) -> tuple[str, bool]:
    """The TRL dataset type of ``ds``'s rows (after :func:`convert`), by its columns, and whether
    they are conversational (lists of messages) rather than standard (strings): ``language
    modeling`` (text / messages), ``prompt-only``, ``prompt-completion``, ``preference``
    (explicit or implicit prompt), ``unpaired preference``; ``unknown`` for anything else."""
    cols = set(ds.column_names)
    if {"chosen", "rejected"} <= cols:
        kind, column = "preference", "chosen"
    elif {"prompt", "completion", "label"} <= cols:
        kind, column = "unpaired preference", "completion"
    elif {"prompt", "completion"} <= cols:
        kind, column = "prompt-completion", "completion"
    elif "messages" in cols:
        kind, column = "language modeling", "messages"
    elif "text" in cols:
        kind, column = "language modeling", "text"
    elif "prompt" in cols:
        kind, column = "prompt-only", "prompt"
    else:
        return "unknown", False
    return kind, _is_list(ds.features.get(column))


def _is_list(feature: Any) -> bool:
    import datasets

    return isinstance(feature, (datasets.List, datasets.LargeList, list)) or (
        isinstance(feature, datasets.Json))


def as_conversation(ds: Any) -> Any:
    """Prompt-completion rows as conversations (``messages``): the prompt's turns, then the
    completion's; a standard (string) prompt becomes one user turn and its completion one
    assistant turn. Other columns (``tools``) are kept."""
    import datasets

    features = datasets.Features({k: v for k, v in ds.features.items()
                                  if k not in ("prompt", "completion")})
    features["messages"] = datasets.List(datasets.Json())

    def turns(value: Any, role: str) -> list:
        return [{"role": role, "content": value}] if isinstance(value, str) else list(value or [])

    def fn(batch: dict[str, list]) -> dict[str, list]:
        return {"messages": [turns(p, "user") + turns(c, "assistant")
                             for p, c in zip(batch["prompt"], batch["completion"], strict=True)]}

    key = hashlib.sha1(repr(("messages", _VERSION, ds._fingerprint)).encode()).hexdigest()
    return ds.map(fn, batched=True, batch_size=256, features=features,
                  remove_columns=["prompt", "completion"], keep_in_memory=not ds.cache_files,
                  new_fingerprint=key, desc="prompt-completion rows into conversations")


def as_conversational_prompt_completion(ds: Any) -> Any:
    """Standard (string) prompt-completion rows as conversational ones: the prompt one user
    turn, the completion one assistant turn."""
    import datasets

    message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    features = datasets.Features({**ds.features, "prompt": datasets.List(message),
                                  "completion": datasets.List(message)})

    def fn(batch: dict[str, list]) -> dict[str, list]:
        return {"prompt": [[{"role": "user", "content": p}] for p in batch["prompt"]],
                "completion": [[{"role": "assistant", "content": c}]
                               for c in batch["completion"]]}

    key = hashlib.sha1(repr(("conversational", _VERSION, ds._fingerprint)).encode()).hexdigest()
    return ds.map(fn, batched=True, batch_size=256, features=features,
                  keep_in_memory=not ds.cache_files, new_fingerprint=key,
                  desc="string prompt-completion rows into turns")
