"""`data=mixture`: several data sources in one dataset, in fixed shares.

Each source is a data config (``local``, ``hub``, ``embedded``, with all their knobs, its own
``columns`` included) under a label, plus its share: a ``weight`` (a share of the weighted rows)
or a ``count`` (exactly that many rows)::

    memlab data=mixture \\
      '+data.sources.chat={name: local, path: chats.jsonl, weight: 3}' \\
      '+data.sources.code={name: hub, path: org/code-sft, weight: 1}' \\
      '+data.sources.safety={name: local, path: refusals.jsonl, count: 200}'

**How many rows.** Counted sources give their counts. The weighted rows total
``data.max_examples``, split by weight (largest remainders round up); without it, as many as
the weighted sources give without repeating a row: the largest total whose every share its
source can fill. A source asked for more rows than it has repeats its rows (every row once per
pass, in a new order each pass); the summary's ``data.sources`` says so.

**Which rows.** Seeded by ``data.seed``: each source's rows are a random sample (or passes of
random orders) of the rows it loads, converted to memlab's formats by the source's own settings
(:mod:`memlab.data.formats`); the mixture is their concatenation in a seeded random order. A row
names its source: errors say ``mixture source 'chat': <file> line 12``, and the summary's
``data.sources`` counts the rows of each source.

**Which formats mix.** Each source is converted on its own (ShareGPT to ``messages``, Alpaca to
conversational prompt-completion, its own ``columns``), then the sources are brought to one
form (:func:`unify`): sources of one TRL type mix as they are (string prompt-completion rows
mixed with conversational ones become one user and one assistant turn); conversations mixed
with prompt-completion rows (ShareGPT + Alpaca, ``messages`` + prompt-completion) all become
conversations, a prompt-completion row the prompt's turns followed by the completion's (the
loss then trains its assistant turns, as on every conversation). Other mixes are refused
before anything is tokenized, naming two sources and why: preference with language-modelling
rows, unpaired with paired preference, prompt-only with rows that have answers, plain text with
conversations, explicit with implicit preference prompts. Sources whose rows differ in shape (a
``messages`` column of different message keys, a ``tools`` column one lacks) are aligned first:
conversational columns become JSON-typed lists, missing columns empty.

The chat-template settings (``chat_template_kwargs``, ``training_template``,
``on_unsplittable``) and ``max_hollow_fraction`` are the mixture's, for all its rows; ``columns``
is per source.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from memlab.data.base import DataError, DataSource, build_source, register
from memlab.data.formats import (
    ROW_NAMES,
    RowOptions,
    as_conversation,
    as_conversational_prompt_completion,
    row_type,
)
from memlab.registry import PositiveInt, Seed
from memlab.trainer.inputs import Inputs

SHARE_KEYS = ("weight", "count")
SOURCE_COLUMN, ROW_COLUMN = "source", "source_row"
"""Columns of a mixture's rows: the source's label and the row's index in the source as read."""


@register("mixture")
@dataclass(kw_only=True)
class Mixture(RowOptions):
    """Data sources mixed in fixed shares (module docstring)."""

    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    """label -> a data config and its share, e.g. ``{name: local, path: a.jsonl, weight: 2}``
    or ``{name: hub, path: org/set, count: 500}``. ``weight`` (> 0): a share of the weighted
    rows; ``count`` (>= 1): exactly that many rows (repeated when the source has fewer)."""
    max_examples: PositiveInt | None = None
    """Rows of the weighted sources together (counted sources add theirs). None: as many as
    they give without repeating a row."""
    seed: Seed = 0
    """Which rows each source gives and the order of the mixture."""

    # ------------------------------------------------------------------ config
    def source_configs(self) -> tuple[dict[str, tuple[DataSource, str, Any]], list[str]]:
        """``({label: (typed source config, share key, share)}, errors)``."""
        out: dict[str, tuple[DataSource, str, Any]] = {}
        # the rendering settings a source leaves to the mixture: their defaults
        unset = {f.name: f.default for f in dataclasses.fields(RowOptions)}
        errors: list[str] = []
        for label, node in sorted(self.sources.items()):
            where = f"data.sources.{label}"
            if not isinstance(node, dict):
                errors.append(f"{where} must be a data config with a weight or a count, e.g. "
                              "{name: local, path: a.jsonl, weight: 1}")
                continue
            shares = [k for k in SHARE_KEYS if node.get(k) is not None]
            if len(shares) != 1:
                errors.append(f"{where} needs exactly one of weight (a share of the weighted "
                              f"rows) or count (rows), got {shares or 'neither'}")
                continue
            key = shares[0]
            value = node[key]
            if key == "weight" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                    or not value > 0 or not math.isfinite(value)):
                errors.append(f"{where}.weight must be a number > 0 (got {value!r})")
                continue
            if key == "count" and (isinstance(value, bool) or not isinstance(value, int)
                                   or value < 1):
                errors.append(f"{where}.count must be an integer >= 1 (got {value!r})")
                continue
            config = {k: v for k, v in node.items() if k not in SHARE_KEYS}
            if config.get("name") == "mixture":
                errors.append(f"{where}: a mixture cannot be a source of a mixture; list its "
                              "sources here")
                continue
            obj, errs = build_source(config, where)
            errors += errs
            if obj is None:
                continue
            for knob, own in (("chat_template_kwargs", obj.chat_template_kwargs),
                              ("training_template", obj.training_template),
                              ("on_unsplittable", obj.on_unsplittable),
                              ("max_hollow_fraction", obj.max_hollow_fraction)):
                if own != unset[knob]:
                    errors.append(f"{where}.{knob}: this setting is the mixture's, for all its "
                                  f"rows; set data.{knob} instead")
            if obj.eval is not None:
                errors.append(f"{where}.eval: the held-out data is the mixture's; set "
                              "data.eval instead (a fraction of the mixed rows, or a file)")
            out[label] = (obj, key, value)
        return out, errors

    def validate(self, ctx) -> list[str]:
        errors = self.row_errors()
        if self.columns:
            errors.append("data.columns of a mixture: give each source its own "
                          "(data.sources.<label>.columns)")
        if not self.sources:
            errors.append("data=mixture needs sources, e.g. "
                          "'+data.sources.a={name: local, path: a.jsonl, weight: 1}'")
        configs, errs = self.source_configs()
        errors += errs
        for label, (obj, _, _) in configs.items():
            errors += [f"data.sources.{label}: {e}" for e in obj.validate(ctx)]
        return errors

    # ------------------------------------------------------------------ rows
    def load(self, ctx):
        import datasets
        import numpy as np

        configs, errors = self.source_configs()
        if errors:
            raise DataError("; ".join(errors))
        loaded = {label: obj.load(ctx) for label, (obj, _, _) in configs.items()}
        sizes = {label: len(ds) for label, ds in loaded.items()}
        empty = sorted(label for label, n in sizes.items() if n == 0)
        if empty:
            raise DataError(f"mixture sources {empty} have no rows")
        counts = plan(sizes, {k: v for k, (_, key, v) in configs.items() if key == "weight"},
                      {k: v for k, (_, key, v) in configs.items() if key == "count"},
                      self.max_examples)
        converted, where = {}, {}
        for i, (label, (obj, _, _)) in enumerate(configs.items()):
            if counts[label] == 0:
                continue
            ds = loaded[label]
            rng = np.random.default_rng([self.seed, i])
            picked = take(len(ds), counts[label], rng)
            where[label] = source_rows(ds, picked)
            converted[label], _ = obj.convert(ds.select(picked))
        if not converted:
            raise DataError("the mixture's shares give no rows; raise data.max_examples or a "
                            "count")
        parts = []
        for label, part in unify(converted).items():
            part = part.add_column(SOURCE_COLUMN, [label] * len(part))
            parts.append(part.add_column(ROW_COLUMN, where[label]))
        mixed = datasets.concatenate_datasets(align(parts))
        return mixed.shuffle(seed=self.seed)

    def inputs(self) -> dict[str, Inputs]:
        """Each source's inputs, as ``data.<label>``."""
        configs, _ = self.source_configs()
        return {f"data.{label}": inp for label, (obj, _, _) in configs.items()
                for inp in obj.inputs().values()}

    def locate(self, ds, row: int) -> str:
        item = ds[row]
        label, index = item[SOURCE_COLUMN], int(item[ROW_COLUMN])
        configs, _ = self.source_configs()
        obj = configs[label][0] if label in configs else None
        return f"mixture source {label!r}: {obj.place(index) if obj else f'row {index}'}"

    def convert(self, ds) -> tuple[Any, dict[str, int]]:
        return ds, {}  # each source converted its own rows in load()

    def summary(self, ds) -> dict[str, Any]:
        import pyarrow.compute as pc

        column = ds.with_format("arrow")[SOURCE_COLUMN]
        counted = pc.value_counts(column).to_pylist()
        rows = {c["values"]: c["counts"] for c in counted}
        configs, _ = self.source_configs()
        out = {}
        for label, (_, key, value) in configs.items():
            out[label] = {"rows": int(rows.get(label, 0)), key: value}
        return {"sources": out, **super().summary(ds)}


def source_rows(ds, picked: list[int]):
    """The indices, in the source as read, of rows ``picked`` of its loaded dataset (which may
    be a sample or a shuffle: :func:`memlab.data.base.original_row`)."""
    import numpy as np

    picked_array = np.asarray(picked, dtype=np.int64)
    mapping = getattr(ds, "_indices", None)
    if mapping is None:
        return picked_array
    return mapping.column(0).to_numpy()[picked_array].astype(np.int64)


def plan(sizes: dict[str, int], weights: dict[str, float], counts: dict[str, int],
         total: int | None) -> dict[str, int]:
    """Rows per source (module docstring): counted sources their counts; the weighted ones
    ``total`` split by weight, largest remainders rounding up (ties: label order), or without
    ``total`` the largest total whose every share its source can fill."""
    out = dict(counts)
    if not weights:
        return out
    whole = sum(weights.values())
    if total is None:
        total = min(math.floor(sizes[k] * whole / w + 1e-9) for k, w in weights.items())
    exact = {k: total * w / whole for k, w in weights.items()}
    shares = {k: math.floor(x + 1e-9) for k, x in exact.items()}
    left = total - sum(shares.values())
    for k in sorted(exact, key=lambda k: (-(exact[k] - shares[k]), k))[:left]:
        shares[k] += 1
    out.update(shares)
    return out


def take(n: int, k: int, rng) -> list[int]:
    """``k`` row indices out of ``n``: a random sample, or (``k > n``) whole random orders
    of the ``n`` rows one after the other, the last one cut."""
    out: list[int] = []
    while len(out) < k:
        out.extend(int(i) for i in rng.permutation(n)[: k - len(out)])
    return out


CONVERSATIONAL_LM = ("language modeling", "prompt-completion")
"""Row types that mix as conversations (:func:`unify`)."""

WHY = {
    "preference": ("a preference row trains its chosen answer against its rejected one, "
                   "{other} rows one answer or text alone; no method takes both in one "
                   "dataset (sft reads no pairs; dpo, kto and reward read nothing else)"),
    "unpaired preference": ("an unpaired preference row is a completion labelled desirable or "
                            "not, {other} rows carry no label; only kto reads it, and only "
                            "with rows like it"),
    "prompt-only": ("a prompt-only row has no answer to train on (the online methods generate "
                    "it), {other} rows do; no method takes both in one dataset"),
    "language modeling": ("plain text rows ('text') are trained whole, with no turns or "
                          "prompt, {other} rows on their answers; write the text source as "
                          "conversations ('messages'), or train them in separate runs"),
}
"""Why a source of the key's type cannot mix with a source of another type (:func:`unify`)."""


def describe(kind: tuple[str, bool], ds) -> str:
    """``conversational prompt-completion (prompt, completion)``, for messages."""
    style = "conversational" if kind[1] else "standard"
    columns = ", ".join(c for c in ds.column_names if c in ROW_NAMES)
    return f"{style} {kind[0]} rows ({columns})"


def unify(parts: dict) -> dict:
    """Each source's converted rows in one form the method can read together (module
    docstring): sources of one type as they are (string prompt-completion rows mixed with
    conversational ones become turns); conversations mixed with prompt-completion rows all
    become conversations (``messages``: the prompt's turns, then the completion's). Other mixes
    are refused, naming two sources that cannot mix and why."""
    kinds = {label: row_type(p) for label, p in parts.items()}
    types = {k[0] for k in kinds.values()}
    styles = {k[1] for k in kinds.values()}
    if types == {"prompt-completion"}:
        return {label: p if kinds[label][1] else as_conversational_prompt_completion(p)
                for label, p in parts.items()}
    if "unknown" in types or (len(types) == 1 and len(styles) == 1
                              and not _explicit_and_implicit(parts, types)):
        return parts  # one type (or one the method names as unreadable)
    text = [label for label, k in kinds.items() if k == ("language modeling", False)]
    if types <= set(CONVERSATIONAL_LM) and not text:
        return {label: as_conversation(p) if kinds[label][0] == "prompt-completion" else p
                for label, p in parts.items()}
    a, b = _clash(parts, kinds)
    ka, kb = kinds[a], kinds[b]
    if ka[0] == kb[0] == "preference":
        why = ("one gives each pair's prompt in a 'prompt' column, the other inside 'chosen' "
               "and 'rejected' (an implicit prompt)" if ka[1] == kb[1] else
               "one gives strings, the other lists of messages")
        why += "; give both sources the same columns and style"
    elif ka[0] == kb[0]:
        why = ("one gives strings, the other lists of messages; give both the same style "
               "(conversations: lists of {role, content} messages)")
    else:
        first = min((a, b), key=lambda x: list(WHY).index(kinds[x][0]) if kinds[x][0] in WHY
                    else len(WHY))
        other = kinds[b if first == a else a]
        why = WHY[kinds[first][0]].format(
            other=f"{'conversational' if other[1] else 'standard'} {other[0]}")
    raise DataError(f"mixture sources {a!r} and {b!r} cannot be mixed: {a!r} has "
                    f"{describe(ka, parts[a])}, {b!r} has {describe(kb, parts[b])}: {why}. "
                    "Mixes that work: conversations ('messages'), Alpaca, ShareGPT and "
                    "prompt-completion rows together (all trained as conversations), or "
                    "sources of one type (docs/config/data.md)")


def _explicit_and_implicit(parts: dict, types: set) -> bool:
    return types == {"preference"} and len({"prompt" in p.column_names
                                            for p in parts.values()}) > 1


def _clash(parts: dict, kinds: dict) -> tuple[str, str]:
    """Two sources that cannot mix: a preference source and another kind first, then any two
    of different types, styles or shapes."""
    labels = sorted(parts)
    pairs = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]
             if kinds[a] != kinds[b] or ("prompt" in parts[a].column_names)
             != ("prompt" in parts[b].column_names)]
    ranked = sorted(pairs, key=lambda ab: (not ({kinds[ab[0]][0], kinds[ab[1]][0]}
                                                & {"preference", "unpaired preference"}),
                                           kinds[ab[0]][0] == kinds[ab[1]][0]))
    return ranked[0]


def align(parts: list) -> list:
    """The parts with the same columns and features: a missing column added empty,
    conversational columns of different shapes cast to JSON-typed lists (each row keeps its
    own keys)."""
    import datasets

    names = sorted({c for p in parts for c in p.column_names})
    out = []
    for p in parts:
        for name in names:
            if name not in p.column_names:
                p = p.add_column(name, [None] * len(p))
        out.append(p.select_columns(names))
    for name in names:
        kinds = {repr(p.features[name]) for p in out}
        if len(kinds) == 1:
            continue
        typed = [p.features[name] for p in out if not _is_null(p.features[name])]
        if all(isinstance(f, (datasets.List, datasets.LargeList)) for f in typed):
            target = datasets.List(datasets.Json())
        elif len({repr(f) for f in typed}) == 1:
            target = typed[0]
        else:
            raise DataError(f"mixture sources disagree on column {name!r}: "
                            f"{sorted({repr(f) for f in typed})}; give it one format in every "
                            "source (data.sources.<label>.columns can rename columns)")
        out = [p.cast_column(name, target) for p in out]
    return out


def _is_null(feature) -> bool:
    return getattr(feature, "dtype", None) == "null"
