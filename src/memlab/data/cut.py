"""Rows far longer than a method keeps, cut before tokenizing, to the same kept tokens; rows that
cannot be cut, refused above :data:`WHOLE_LIMIT` characters (issue 43, item 6).

**What is cut.** Every field a method truncates in a known direction: ``method=sft``'s ``text``,
string ``prompt`` / ``completion`` (:func:`encode`) and conversations (``messages``,
conversational prompt-completion rows: :mod:`memlab.data.chat_cut`, which renders the row whole
and cut and proves the kept tokens and loss mask the same with :func:`common_start`,
:func:`common_end` and :func:`inside`); the preference methods' prompts (kept at their end:
``max_prompt_length``, or ``max_length``, which drops an example whose prompt fills it) and
completions (kept at their start: ``max_completion_length`` / ``max_length``), reward sequences
(kept at their end), ``gkd``'s and the online methods' prompts (:mod:`memlab.method._rows`).
The kept ids being the same, so are the decisions taken on them (an example dropped, a pair
hollow); ``data.tokens_in`` counts what was tokenized, ``data.cut_before_tokenizing`` the rows
and characters cut off.

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

**Two texts** (:func:`common_start`, :func:`common_end`, :func:`inside`): the same argument
holds between any two texts that agree on a region bounded by word boundaries of both (the
added-token window checked in each): the tokens inside it are the same. A chat template's
rendering of a conversation whole and cut is such a pair; the cut text's character offsets
count the tokens inside the region.

**Refused** (``DataError`` naming the row, hence file and line, the field and its size): a field
over :data:`WHOLE_LIMIT` characters that is tokenized whole: no boundary within
:data:`SEARCH` characters of the margin (one run of a single character class), a tokenizer the
argument does not cover, a method or packing that keeps every token (``packing=bfd_split`` /
``wrapped``, ``max_length=null``, a preference method with all its length limits null, an eval
sample's prompt), a conversation whose cut cannot be proven (:mod:`memlab.data.chat_cut`).
"""

from __future__ import annotations

import bisect
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


def added_texts(tok) -> tuple[str, ...]:
    """The texts of the tokenizer's added tokens (which it splits out before anything else)."""
    return _info(tok).added


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


# ------------------------------------------------------------------ two renderings of one row


def is_boundary(text: str, q: int, added: tuple[str, ...]) -> bool:
    """Whether ``q`` is a word boundary of ``text`` (module docstring)."""
    reach = max((len(a) for a in added), default=0) + 1
    return 0 < q < len(text) and text[q] == " " and _word_end(text, q, added, reach)


def common_start(whole: str, cut: str, added: tuple[str, ...], at: int = 0, shift: int = 0
                 ) -> int | None:
    """The last word boundary ``q`` of ``cut`` (``q + shift`` of ``whole``) up to which the two
    texts agree from ``at`` (``at + shift``) on, the character at ``q`` included; None when
    there is none within :data:`SEARCH` characters of where they part."""
    lo, hi = 0, min(len(cut) - at, len(whole) - at - shift)
    while lo < hi:  # the longest run cut[at:at + m] found at whole[at + shift:]
        mid = (lo + hi + 1) // 2
        if whole.startswith(cut[at:at + mid], at + shift):
            lo = mid
        else:
            hi = mid - 1
    q = at + lo - 1
    stop = max(at + 1, q - SEARCH)
    while q >= stop:
        q = cut.rfind(" ", stop, q + 1)
        if q < 0:
            return None
        if is_boundary(cut, q, added) and is_boundary(whole, q + shift, added):
            return q
        q -= 1
    return None


def common_end(whole: str, cut: str, added: tuple[str, ...]) -> int | None:
    """The first word boundary ``q`` of ``cut`` (``q + len(whole) - len(cut)`` of ``whole``)
    from which the two texts agree to their ends, the character before ``q`` included; None
    when there is none within :data:`SEARCH` characters of where they part."""
    shift = len(whole) - len(cut)
    lo, hi = 0, min(len(cut), len(whole))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if whole.endswith(cut[len(cut) - mid:]):
            lo = mid
        else:
            hi = mid - 1
    q = len(cut) - lo + 1
    stop = min(len(cut) - 1, q + SEARCH)
    while q <= stop:
        q = cut.find(" ", q, stop + 1)
        if q < 0:
            return None
        if is_boundary(cut, q, added) and is_boundary(whole, q + shift, added):
            return q
        q += 1
    return None


def inside(offsets: list[tuple[int, int]], lo: int | None, hi: int | None
           ) -> tuple[int, int] | None:
    """``[i, j)``: the tokens (by their character offsets) that lie between the word boundaries
    ``lo`` and ``hi`` of their text (None: its start / end); None when a token straddles one, or
    an empty one sits on it (which side it belongs to is then unknown)."""
    i, j = 0, len(offsets)
    if lo is not None:
        i = next((t for t, (s, _) in enumerate(offsets) if s >= lo), len(offsets))
        if i < len(offsets) and offsets[i][0] == offsets[i][1] == lo:
            return None
        if i > 0 and offsets[i - 1][1] > lo:
            return None
    if hi is not None:
        j = next((t for t, (_, e) in enumerate(offsets) if e > hi), len(offsets))
        if j > 0 and offsets[j - 1][0] == offsets[j - 1][1] == hi:
            return None
        if j < len(offsets) and offsets[j][0] < hi:
            return None
    return i, max(i, j)


def with_offsets(tok, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Ids of ``text`` (no special tokens added) and their character offsets; None where the
    tokenizer gives none (a slow one)."""
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        return None
    ids, offsets = list(enc["input_ids"]), enc.get("offset_mapping")
    if offsets is None or len(offsets) != len(ids):
        return None
    return ids, [(s, e) for s, e in offsets]


def token_cuts(tok, text: str, cuts: list[int]) -> tuple[list[int], list[int]] | None:
    """Ids of ``text`` and, for each character position in ``cuts``, the number of tokens before
    it, from one tokenization with character offsets. None unless the offsets prove every cut a
    token boundary (:func:`cut_positions`). Slow tokenizers have no offsets: None."""
    enc = with_offsets(tok, text)
    if enc is None:
        return None
    found = cut_positions(enc[1], len(text), cuts)
    return None if found is None else (enc[0], found)


def cut_positions(offsets: list[tuple[int, int]], n_chars: int, cuts: list[int]
                  ) -> list[int] | None:
    """For each character position in ``cuts``, the number of tokens before it; None unless
    every cut is a token boundary: the token before it ends exactly there and the one after
    starts there (no token straddles it, even with trimmed offsets)."""
    starts = [s for s, _ in offsets]
    if any(a > b for a, b in zip(starts, starts[1:])):
        return None
    positions = []
    for cut in cuts:
        j = bisect.bisect_left(starts, cut)
        if cut == n_chars:
            j = len(offsets)
        elif j == len(offsets) or starts[j] != cut or offsets[j][1] == cut:
            return None  # no token starts here, or a zero-width one that could go either way
        if j > 0 and offsets[j - 1][1] != cut:
            return None
        positions.append(j)
    return positions
