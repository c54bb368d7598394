"""Rows far longer than a method keeps, cut before tokenizing, to the same kept tokens; rows that
cannot be cut, refused above :data:`WHOLE_LIMIT` characters (issue 43, item 6).

Tokenizing one 200 MB JSONL line whole passed 6 GB (the tokenizer's encoding keeps strings,
offsets and alignments for every token and byte: ~230 bytes of memory a character, measured in
``method=sft``'s prepare), and the method truncated to ``max_length`` only afterwards.

**The cut.** Where a method truncates a string to ``n`` tokens (``keep_start``: the first ``n``;
``keep_end``: the last ``n``), a string far longer than ``n`` tokens is cut at a *word boundary*:
a position ``p`` with ``text[p] == " "`` and ``text[p - 1]`` a letter, digit, punctuation or
symbol (Unicode categories L, N, P, S), no added token's text within reach of ``p``.
``keep_start`` tokenizes ``text[:p + 1]`` (the space kept), ``keep_end`` ``text[p - 1:]`` (the
character before it kept), so the boundary has the same two characters on either side in the
cut text and in the whole one.

**Why the kept tokens are the same.** A fast (Rust) tokenizer splits added tokens out first,
normalizes, splits the text into pre-tokens, and runs its model (BPE, WordPiece, Unigram) on each
pre-token alone: no merge crosses a pre-token boundary. So tokens on one side of a position that
is a pre-token boundary in both texts, with the same characters on that side, are the same.
``p`` is such a boundary for the pre-tokenizers :func:`why_not` admits:

* byte-level BPE's GPT-2 regex (memlab's own tokenizer, GPT-2, RoBERTa) and the Llama 3 / Qwen2
  regexes: every alternative that matches a non-space character continues only with non-space
  characters (or, in the Llama 3 / Qwen2 ones, with ``\\r`` / ``\\n``: never a space), so no
  pre-token holds both ``text[p - 1]`` and ``text[p]``; the patterns have no look-behind and
  look ahead at most one character, so the matches left of ``p`` read only ``text[:p + 1]`` and
  those from ``p`` on only ``text[p:]``;
* Metaspace (SentencePiece-style) splits before every space; Whitespace, WhitespaceSplit and
  BERT's split at every space; the splitters allowed after them (Digits, Punctuation, a
  regex-free ByteLevel) only split further, inside pieces;
* the normalizers admitted map characters one by one (lowercase, accents, a one-character
  replace), prepend at the start only, or are Unicode normalization forms, which never compose
  across a space (no composed character has a space as its base).

The margin is checked, not assumed: the cut is tried at ``n`` x :data:`GUESS` characters and
moved further (doubling) until the kept side alone has at least ``n`` tokens (tokens of a piece
of text are at most its UTF-8 bytes, which bounds what the far side adds); at most ``n`` x the
tokenizer's longest vocabulary entry in characters (:func:`longest_entry`) is ever needed,
since no token covers more characters than its entry has. A tokenizer outside that list (a slow
one, Llama 2's without pre-tokenizer, a Precompiled normalizer) is never cut.

**Refused** (``DataError`` naming the row, hence file and line, the field and its size): a field
over :data:`WHOLE_LIMIT` characters that is tokenized whole: no boundary within
:data:`SEARCH` characters of the margin (one run of a single character class), a tokenizer the
argument does not cover, a method or packing that keeps every token (``packing=bfd_split`` /
``wrapped``, ``max_length=null``, the preference methods: their tokens are all kept or counted).
"""

from __future__ import annotations

import json
import unicodedata
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from memlab.data.base import DataError

Keep = Literal["keep_start", "keep_end"]

WHOLE_LIMIT = 4 * 2**20
"""Characters of one field tokenized whole at most (4 Mi): ~1 GB at the ~230 bytes a character
tokenizing whole costs (measured: a 5 MB ``text`` row took 1.1 GB in ``method=sft``'s prepare).
Longer fields are cut (where the method truncates) or refused."""
GUESS = 4
"""Characters a token the first cut assumes (typical of English text)."""
SEARCH = 2**16
"""Characters searched past the margin for a word boundary."""
FIX = ("split it into several rows (packing=wrapped or bfd_split joins them into full rows "
       "again), or shorten it")

_SPLITTERS = {"Digits", "Punctuation", "UnicodeScripts"}
_SPLIT_AT_SPACES = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Prepend",
                "BertNormalizer", "Strip"}
_REGEXES = {  # byte-level BPE's pre-token patterns (GPT-2; Llama 3; Qwen2)
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@dataclass(frozen=True)
class _Info:
    why_not: str | None
    longest: int
    added: tuple[str, ...]


_INFO: weakref.WeakKeyDictionary[Any, _Info] = weakref.WeakKeyDictionary()


def _info(tok) -> _Info:
    info = _INFO.get(tok)
    if info is None:
        added = tuple(str(t) for t in getattr(tok, "added_tokens_decoder", {}).values())
        entries = [*tok.get_vocab(), *added]
        info = _Info(_why_not(tok), max((len(e) for e in entries), default=1), added)
        _INFO[tok] = info
    return info


def longest_entry(tok) -> int:
    """Characters of the tokenizer's longest vocabulary entry (added tokens included)."""
    return _info(tok).longest


def why_not(tok) -> str | None:
    """None when the module docstring's argument covers ``tok``; else why it does not."""
    return _info(tok).why_not


def _why_not(tok) -> str | None:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return "a slow (Python) tokenizer"
    spec = json.loads(backend.to_str())
    pre, norm = spec.get("pre_tokenizer"), spec.get("normalizer")
    stages = (pre or {}).get("pretokenizers", [pre] if pre else [])
    if not any(_splits_at_spaces(s) for s in stages):
        return f"its pre-tokenizer ({(pre or {}).get('type')}) does not split at spaces"
    if not all(_splits_at_spaces(s) or _splits_only(s) for s in stages):
        return f"its pre-tokenizer ({pre.get('type')}) has a stage memlab does not know"
    norms = (norm or {}).get("normalizers", [norm] if norm else [])
    for n in norms:
        if n["type"] == "Replace" and len(n.get("pattern", {}).get("String") or "") == 1:
            continue
        if n["type"] not in _NORMALIZERS:
            return f"its normalizer ({n['type']}) may join characters across a space"
    return None


def _splits_at_spaces(stage: dict) -> bool:
    kind = stage.get("type")
    if kind == "ByteLevel":
        return bool(stage.get("use_regex", True))
    if kind == "Split":
        return (stage.get("pattern", {}).get("Regex") in _REGEXES
                and stage.get("behavior") == "Isolated" and not stage.get("invert"))
    if kind == "Metaspace":
        return bool(stage.get("split", True))
    return kind in _SPLIT_AT_SPACES


def _splits_only(stage: dict) -> bool:
    return stage.get("type") in _SPLITTERS or (stage.get("type") == "ByteLevel"
                                               and not stage.get("use_regex", True))


def boundary(text: str, start: int, keep: Keep, added: tuple[str, ...] = ()) -> int | None:
    """The first word boundary (module docstring) at or after ``start`` (keep_start) or at or
    before it (keep_end), within :data:`SEARCH` characters; None when there is none."""
    reach = max((len(a) for a in added), default=0) + 1
    if keep == "keep_start":
        p, stop = start, min(len(text) - 1, start + SEARCH)
        while True:
            p = text.find(" ", p, stop)
            if p < 0:
                return None
            if p > 0 and _word_end(text, p, added, reach):
                return p
            p += 1
    p, stop = start + 1, max(1, start - SEARCH)
    while True:
        p = text.rfind(" ", stop, p)
        if p < 1:
            return None
        if _word_end(text, p, added, reach):
            return p


def _word_end(text: str, p: int, added: tuple[str, ...], reach: int) -> bool:
    if unicodedata.category(text[p - 1])[0] not in "LNPS":
        return False
    window = text[max(0, p - reach):p + reach]
    return not any(a in window for a in added)


def too_long(n_chars: int, row: int, field: str, why: str) -> DataError:
    """The refusal of a field too long to tokenize whole (module docstring)."""
    return DataError(f"row {row}: field '{field}' is {n_chars:,} characters long, over the "
                     f"{WHOLE_LIMIT:,} memlab tokenizes whole ({why}); {FIX}", row=row)


def check_size(value: Any, row: int, field: str, why: str) -> None:
    """Refuse a field (a string, or messages: their contents together) tokenized whole that is
    over :data:`WHOLE_LIMIT` characters."""
    n = size(value)
    if n > WHOLE_LIMIT:
        raise too_long(n, row, field, why)


def size(value: Any) -> int:
    """Characters of a string field, or of the contents of a list of messages."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(m.get("content") or "") if isinstance(m, dict) else 0 for m in value)
    return 0


def encode(tok, text: str, n: int | None, keep: Keep, ids_of: Callable[[str], list[int]],
           row: int, field: str, slack: int = 8, kept_whole: str = "every token is kept"
           ) -> tuple[list[int], int]:
    """``ids_of(text)``, or, when ``text`` is far longer than ``n`` tokens, ``ids_of`` of the
    text cut (module docstring) so that its first (keep_start) or last (keep_end) ``n`` ids are
    those of the whole text. ``slack``: the most ids ``ids_of`` adds on the far side of the cut
    (special tokens, the one character kept there); ``kept_whole``: why ``n`` is None, for the
    refusal. Returns ``(ids, characters cut off)``."""
    info = _info(tok)
    whole = len(text) <= WHOLE_LIMIT
    if n is None or info.why_not is not None:
        if not whole:
            raise too_long(len(text), row, field,
                           kept_whole if n is None else
                           f"the tokenizer cannot be cut provably: {info.why_not}")
        return ids_of(text), 0
    chars = n * GUESS
    while len(text) > 2 * chars + SEARCH:
        start = chars if keep == "keep_start" else len(text) - 1 - chars
        p = boundary(text, start, keep, info.added)
        if p is None:
            break
        piece = text[:p + 1] if keep == "keep_start" else text[p - 1:]
        ids = ids_of(piece)
        if len(ids) - slack >= n:
            return ids, len(text) - len(piece)
        chars *= 2  # (past n x the longest entry only where a normalizer shrinks the text)
    if not whole:
        raise too_long(len(text), row, field, "no word boundary (a space after a letter, digit "
                       f"or sign) within {SEARCH:,} characters of where it would be cut before "
                       "tokenizing")
    return ids_of(text), 0
