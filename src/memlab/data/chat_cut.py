"""Conversations far longer than a method keeps, cut before tokenizing, to the same kept token ids
and loss mask (issue 43, item 6); plain text: :mod:`memlab.data.cut`, whose argument this one
builds on.

A chat template transforms what it renders (Llama 3 trims a message's content, Qwen3 splits an
answer at ``</think>``), so a conversation is not cut on trust. Every content longer than the
margin is cut at a word boundary (:func:`memlab.data.cut.boundary`, in the direction the method
truncates; ``keep_start`` adds one letter after the kept space, so a template that trims the
content keeps that space), and the template renders both the conversation *whole* and *cut*, as
text (a string costs a few bytes a character; tokenizing, ~230). Only the cut text is tokenized.

**Why the kept tokens are the same.** The two texts must agree on a region that ends (or starts)
at a word boundary of both (:func:`memlab.data.cut.common_start`, :func:`~memlab.data.cut.
common_end`; a prompt + completion rendering: the prompt's end and the completion's start, a
region bounded on both sides). By the argument of :mod:`memlab.data.cut` the tokens inside the
region are the same in both texts; the character offsets of the cut text's tokens count them
(:func:`memlab.data.cut.inside`), and the cut is kept only when they are at least the ``n``
tokens the method keeps (else the margin doubles, as for text). Where a template renders the
kept side differently once the far side is cut (Qwen3 moving reasoning before a later
``</think>``), the region ends early, the count falls short, and the conversation is not cut.

**Loss masks** (``method.loss_on=completion``) follow :mod:`memlab.data.chat`'s two methods:

* *markers*: the template renders both texts with their ``{% generation %}`` spans (the
  renderer ``apply_chat_template`` uses); a token is masked when it overlaps a span, which is
  checked against ``apply_chat_template``'s own mask of the cut text. The spans clipped to the
  kept side must be the same in both texts.
* *turns*: the whole conversation's text checks run on its renderings (strings), so a template
  that cannot be split is refused (or replaced by the training template) as when it is
  tokenized whole. Each assistant turn's two boundaries must be the same on the kept side; a
  turn across the cut must have its end-of-turn token on the kept side (``keep_end``) or no
  special token before the cut (``keep_start``). The whole text's boundaries on the far side
  must be token boundaries by offsets, proven on a piece of text between two word boundaries
  around each (the tokens between two word boundaries are those of the whole text), so that
  the whole conversation would have been split the same way, by offsets (the tokenizers
  :func:`memlab.data.cut.why_not` admits give offsets in order), never by the prefix
  renderings, which could fail far from the kept tokens.

A prompt + completion (``completion_ids``) is rendered whole and cut too: the whole rendering
must start with the whole prompt's (the check the whole row makes), the cut one with the cut
prompt's; the whole row's check that the pair's ids begin with the prompt's is decided on the
cut text where the prompt's end is kept, and on two pieces of the whole texts around it where it
is cut off (:meth:`_Pair.whole_prefix`), so a row the whole check refuses is refused cut too.

**Not cut** (tokenized whole, so refused above :data:`memlab.data.cut.WHOLE_LIMIT` characters):
a method that keeps every token, a tokenizer :func:`memlab.data.cut.why_not` rejects, a check
above that fails (:class:`NotCut` where a row's several fields must be redone whole together).
A check made on the cut text alone decides for the whole only where its tokens are proven the
same; elsewhere the cut row is not cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from memlab.data import chat, cut
from memlab.data.base import DataError, check_messages, normalize_tools
from memlab.data.cut import Keep

SENTINEL = "x"
"""What ``keep_start`` writes after the kept space of a cut content (so that a trim keeps it)."""
NOT_RENDERED = ("no cut before tokenizing is proven to keep the same tokens: no word boundary "
                "past the margin, or the chat template renders the side kept differently once "
                "the rest is cut")

T = TypeVar("T")


class NotCut(Exception):
    """A row's field cannot be cut provably; its fields are redone whole (refused above
    :data:`memlab.data.cut.WHOLE_LIMIT`). The message says why."""


# ----------------------------------------------------------------------------------- cutting


def why_whole(tok, n: int | None, kept_whole: str) -> str | None:
    """Why a field is tokenized whole (None: it may be cut)."""
    if n is None:
        return kept_whole
    why = cut.why_not(tok)
    return None if why is None else f"the tokenizer cannot be cut provably: {why}"


def is_long(messages: list[dict], chars: int) -> bool:
    return any(isinstance(m.get("content"), str) and len(m["content"]) > 2 * chars + cut.SEARCH
               for m in messages)


def attempts(n: int, *groups: list[dict]) -> Iterator[int]:
    """Margins in characters: ``n`` x GUESS, doubled while some content is longer."""
    chars = n * cut.GUESS
    while any(is_long(g, chars) for g in groups):
        yield chars
        chars *= 2


def search(tok, messages: list[dict], n: int, keep: Keep,
           attempt: Callable[[list[dict], int], tuple[int, Callable[[], T]] | None]) -> T | None:
    """The margin search every cut path makes: for each margin of :func:`attempts`, the
    conversation cut there (:func:`cut_messages`) is tried (``attempt(messages cut, characters
    cut)``: the tokens proven the same on the kept side, and what the path returns once they are
    ``n``; None: this cut is not provable). The first cut with ``n`` tokens proven wins; None
    when a cut is not provable, or the count stops growing as the margin doubles (the template
    renders the cut differently)."""
    best = -1
    for chars in attempts(n, messages):
        found = cut_messages(tok, messages, chars, keep)
        tried = None if found is None else attempt(*found)
        if tried is None:
            return None
        kept, result = tried
        if kept >= n:
            return result()
        if kept <= best:
            return None
        best = kept
    return None


def cut_messages(tok, messages: list[dict], chars: int, keep: Keep
                 ) -> tuple[list[dict], int] | None:
    """``messages`` with every content over ``2 x chars + SEARCH`` cut at a word boundary
    ``chars`` from its kept end (module docstring), and the characters cut off; None when a
    content has no word boundary there."""
    out, n_cut = [], 0
    added = cut.added_texts(tok)
    for m in messages:
        text = m.get("content")
        if not isinstance(text, str) or len(text) <= 2 * chars + cut.SEARCH:
            out.append(m)
            continue
        start = chars if keep == "keep_start" else len(text) - 1 - chars
        p = cut.boundary(text, start, keep, added)
        if p is None:
            return None
        piece = text[:p + 1] + SENTINEL if keep == "keep_start" else text[p - 1:]
        out.append({**m, "content": piece})
        n_cut += len(text) - (p + 1 if keep == "keep_start" else len(piece))
    return out, n_cut


def whole_or_refuse(size: int, row: int, field: str, why: str, compute: Callable[[], T]) -> T:
    if size > cut.WHOLE_LIMIT:
        raise cut.too_long(size, row, field, why)
    return compute()


@dataclass(frozen=True)
class Region:
    """Where the cut text's tokens are those of the whole text: between the word boundaries
    ``lo`` and ``hi`` of the cut text (None: its start / end); a position ``x`` there is
    ``x + shift`` in the whole text."""

    lo: int | None
    hi: int | None
    shift: int


def region_of(whole: str, text: str, keep: Keep, added: tuple[str, ...]) -> Region | None:
    if keep == "keep_start":
        q = cut.common_start(whole, text, added)
        return None if q is None else Region(None, q, 0)
    q = cut.common_end(whole, text, added)
    return None if q is None else Region(q, None, len(whole) - len(text))


def encoded(tok, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Ids and offsets of a cut text, None when it is itself too long to tokenize whole."""
    return None if len(text) > cut.WHOLE_LIMIT else cut.with_offsets(tok, text)


# ----------------------------------------------------------------------------------- renderings


def rendered_ids(tok, messages: list[dict], n: int | None, keep: Keep, row: int, field: str,
                 tools: Any = None, generation_prompt: bool = False,
                 kept_whole: str = "every token is kept") -> tuple[list[int], int]:
    """:func:`memlab.data.chat.conversation_ids` (or :func:`~memlab.data.chat.prompt_ids` with
    ``generation_prompt``), cut before tokenizing when far longer than ``n`` tokens so that the
    first (keep_start) or last (keep_end) ``n`` ids are the same; and the characters cut."""
    check_messages(messages, row, field)

    def whole() -> tuple[list[int], int]:
        fn = chat.prompt_ids if generation_prompt else chat.conversation_ids
        return fn(tok, messages, row, field, tools=tools), 0

    why = why_whole(tok, n, kept_whole)
    if why is None and n is not None and is_long(messages, n * cut.GUESS):
        found = _Rendered.cut(tok, messages, n, keep, row, field, tools, generation_prompt)
        if found is not None:
            return found.ids, found.n_cut
        why = NOT_RENDERED
    return whole_or_refuse(cut.size(messages), row, field, why or SHORT, whole)


SHORT = "no message is long enough to cut before tokenizing"


@dataclass(frozen=True)
class _Rendered:
    """A conversation rendered whole and cut, with the cut text's ids proven on ``region``."""

    whole: str
    text: str
    messages: list[dict]
    ids: list[int]
    n_cut: int
    region: Region

    @staticmethod
    def cut(tok, messages: list[dict], n: int, keep: Keep, row: int, field: str, tools: Any,
            generation_prompt: bool) -> _Rendered | None:
        """The first margin whose cut text has ``n`` tokens proven the same; None when none
        has (or the count stops growing: the template renders the cut differently)."""
        tools = normalize_tools(tools, row)
        chat._check_reasoning(chat.template_info(tok).text, messages, row, field)
        added = cut.added_texts(tok)
        whole = chat._render(tok, messages, generation_prompt, row, field, tools)

        def attempt(shown: list[dict], n_cut: int
                    ) -> tuple[int, Callable[[], _Rendered]] | None:
            try:
                text = chat._render(tok, shown, generation_prompt, row, field, tools)
            except chat.ChatTemplateError:
                return None
            region, enc = region_of(whole, text, keep, added), encoded(tok, text)
            if region is None or enc is None:
                return None
            span = cut.inside(enc[1], region.lo, region.hi)
            if span is None:
                return None
            return span[1] - span[0], lambda: _Rendered(whole, text, shown, enc[0], n_cut,
                                                        region)

        return search(tok, messages, n, keep, attempt)


# ----------------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    """A conversational prompt, tokenized with the generation prompt: cut (``keep``) or not."""

    messages: list[dict]
    """As given."""
    shown: list[dict]
    """As rendered: cut, or ``messages``."""
    ids: list[int]
    n_cut: int = 0
    keep: Keep | None = None
    whole_text: str | None = None
    """The rendering of ``messages`` (when cut)."""
    text: str | None = None
    """The rendering of ``shown`` (when cut)."""
    bound: int | None = None
    """The word boundary of ``text`` that bounds what is kept (when cut)."""


def prompt(tok, messages: list[dict], n: int | None, keep: Keep, row: int, tools: Any = None,
           field: str = "prompt", kept_whole: str = "every token is kept") -> Prompt:
    """The prompt's ids (:func:`memlab.data.chat.prompt_ids`), cut before tokenizing when far
    longer than ``n`` tokens, its first (keep_start) or last (keep_end) ``n`` ids the same."""
    check_messages(messages, row, field)
    why = why_whole(tok, n, kept_whole)
    if why is None and n is not None and is_long(messages, n * cut.GUESS):
        found = _Rendered.cut(tok, messages, n, keep, row, field, tools, True)
        if found is not None:
            r = found.region
            return Prompt(messages, found.messages, found.ids, found.n_cut, keep, found.whole,
                          found.text, r.lo if keep == "keep_end" else r.hi)
        why = NOT_RENDERED
    return whole_or_refuse(cut.size(messages), row, field, why or SHORT, lambda: Prompt(
        messages, messages, chat.prompt_ids(tok, messages, row, field, tools=tools)))


def completion_ids(tok, prompt: Prompt, completion: list[dict], n: int | None, keep: Keep,
                   row: int, field: str, tools: Any = None, fix: str = chat.SPLIT_FIX,
                   kept_whole: str = "every token is kept") -> tuple[list[int], int]:
    """:func:`memlab.data.chat.completion_ids` after ``prompt`` (cut or not), ``completion``
    cut before tokenizing when far longer than ``n`` tokens, its first (keep_start) or last
    (keep_end) ``n`` ids the same; a prompt cut keep_end keeps the completion's ids whole
    after it, one cut keep_start none (they lie past what is kept). Raises :class:`NotCut`
    where the prompt was cut and the pair cannot be."""
    check_messages(completion, row, field)
    why = why_whole(tok, n, kept_whole)
    long = why is None and n is not None and is_long(completion, n * cut.GUESS)
    if prompt.keep is None and not long:
        return whole_or_refuse(cut.size(completion), row, field, why or SHORT, lambda: (
            chat.completion_ids(tok, prompt.messages, prompt.ids, completion, row, field, fix,
                                tools), 0))
    tools = normalize_tools(tools, row)
    chat._check_reasoning(chat.template_info(tok).text, completion, row, field)
    pair = _Pair(tok, prompt, completion, row, field, tools, fix)
    if not long:
        if cut.size(completion) > cut.WHOLE_LIMIT:
            raise NotCut(why or SHORT)
        return pair.try_cut(completion, 0, None, None) or pair.refuse()
    assert n is not None

    def attempt(shown: list[dict], n_cut: int
                ) -> tuple[int, Callable[[], tuple[list[int], int] | None]]:
        out = pair.try_cut(shown, n_cut, keep, n)  # (None: pair.kept says how far it got)
        return (n if out is not None else pair.kept), lambda: out

    out = search(tok, completion, n, keep, attempt)
    if out is not None:
        return out
    if prompt.keep is None:
        return whole_or_refuse(cut.size(completion), row, field, NOT_RENDERED, lambda: (
            chat.completion_ids(tok, prompt.messages, prompt.ids, completion, row, field, fix,
                                tools), 0))
    return pair.refuse()


class _Pair:
    """One prompt + completion rendered whole and cut (:func:`completion_ids`)."""

    def __init__(self, tok, prompt: Prompt, completion: list[dict], row: int, field: str,
                 tools: list | None, fix: str):
        self.tok, self.prompt, self.row, self.field, self.tools = tok, prompt, row, field, tools
        self.fix, self.kept = fix, -1
        self.added = cut.added_texts(tok)
        # the check the whole row makes on its text: its rendering starts with the prompt's
        whole_prompt = prompt.whole_text or chat._render(tok, prompt.messages, True, row,
                                                         "prompt", tools)
        self.whole = chat._render(tok, prompt.messages + completion, False, row, field, tools)
        if not self.whole.startswith(whole_prompt):
            raise chat._unsplittable(tok, chat.Unsplittable(
                f"row {row}: the chat template renders 'prompt' differently alone (with the "
                f"generation prompt) and followed by '{field}' "
                f"({chat._diff(whole_prompt, self.whole)}), so the completion cannot be cut "
                "out; check that the prompt ends with a user turn and the completion is an "
                f"assistant turn, or {fix}"), row)
        self.whole_prompt = whole_prompt
        self.whole_prompt_len = len(whole_prompt)
        self.prompt_text = prompt.text or whole_prompt
        self._prefix: bool | None = None

    def refuse(self) -> Any:
        raise NotCut(NOT_RENDERED)

    def merged(self, prompt_text: str, text: str) -> DataError:
        """The whole row's error where the prompt's ids do not begin those of the pair."""
        return chat._unsplittable(self.tok, chat.Unsplittable(
            f"row {self.row}: the chat template renders 'prompt' differently alone (with the "
            f"generation prompt) and followed by '{self.field}': the tokenizer merges tokens "
            f"across the boundary ({chat._boundary(prompt_text, text)}); {self.fix}"), self.row)

    def whole_prefix(self) -> bool:
        """Whether the whole pair's ids begin with the whole prompt's (the check of
        :func:`memlab.data.chat.completion_ids`), decided on two pieces of text between word
        boundaries around the prompt's end: the tokens before its last word boundary ``q`` are
        the same in both texts (the same characters up to and past ``q``), so the check holds
        exactly when the tokens from ``q`` to the prompt's end are, in the prompt alone and
        in the pair, and the pair has a token boundary there."""
        if self._prefix is None:
            self._prefix = self._whole_prefix()
        return self._prefix

    def _whole_prefix(self) -> bool:
        tok, pt, full, b, added = self.tok, self.whole_prompt, self.whole, self.whole_prompt_len, \
            self.added
        q = cut.boundary(pt, b - 1, "keep_end", added) if b > 1 else None
        if q is not None and not cut.is_boundary(full, q, added):
            q = None
        r = cut.boundary(full, b + 1, "keep_start", added) if b + 1 < len(full) else None
        if q is None and b > cut.SEARCH or r is None and len(full) - b > cut.SEARCH:
            raise NotCut(NOT_RENDERED)
        a = 0 if q is None else q - 1
        alone = cut.with_offsets(tok, pt[a:])
        pair = cut.with_offsets(tok, full[a:len(full) if r is None else r + 1])
        lo = None if q is None else q - a
        mine = None if alone is None else cut.inside(alone[1], lo, None)
        theirs = None if pair is None else cut.inside(pair[1], lo, None if r is None else r - a)
        at = None if pair is None else cut.cut_positions(pair[1], len(full) - a if r is None
                                                         else r + 1 - a, [b - a])
        if alone is None or pair is None or mine is None or theirs is None:
            raise NotCut(NOT_RENDERED)
        return at is not None and alone[0][mine[0]:] == pair[0][theirs[0]:at[0]]

    def try_cut(self, completion: list[dict], n_cut: int, keep: Keep | None, n: int | None
                ) -> tuple[list[int], int] | None:
        """The completion's ids when the renderings prove them (module docstring), else None;
        ``keep``/``n``: how the completion was cut (None: not cut)."""
        p, tok, added = self.prompt, self.tok, self.added
        try:
            text = chat._render(tok, p.shown + completion, False, self.row, self.field,
                                self.tools)
        except chat.ChatTemplateError:
            return None
        start = len(self.prompt_text)
        if not text.startswith(self.prompt_text) or len(text) > cut.WHOLE_LIMIT:
            return None
        shift = self.whole_prompt_len - start
        lo = hi = None  # the region the two renderings agree on (module docstring)
        if p.keep == "keep_start":  # all the completion's tokens lie past what is kept
            pass
        elif keep == "keep_end":
            lo = cut.common_end(self.whole, text, added)
            if lo is None:
                return None
        else:
            if p.keep == "keep_end":
                lo = p.bound
                if not (cut.is_boundary(text, lo, added)  # type: ignore[arg-type]
                        and cut.is_boundary(self.whole, lo + shift, added)):  # type: ignore
                    return None
            if keep == "keep_start":
                hi = cut.common_start(self.whole, text, added, start, shift)
                if hi is None:
                    return None
            elif (len(self.whole) - self.whole_prompt_len != len(text) - start
                  or not self.whole.endswith(text[start:])):
                return None  # the completion, not cut, renders the same after either prompt
        enc = cut.with_offsets(tok, text)
        span = None if enc is None else cut.inside(enc[1], lo, hi)
        if enc is None or span is None:
            return None
        ids, k = enc[0], len(p.ids)
        if p.keep == "keep_start" or keep == "keep_end":  # the prompt's end lies cut off
            if not self.whole_prefix():
                raise self.merged(self.whole_prompt, self.whole)
        elif ids[:k] != p.ids:  # tokens proven the same: the whole row's check fails too
            if span[0] > k:
                return None
            raise self.merged(self.prompt_text, text)
        if p.keep == "keep_start":
            return ids[k:], n_cut
        if keep == "keep_end":
            self.kept = span[1] - max(span[0], k)
        else:
            if span[0] > k:
                return None
            self.kept = span[1] - k
        return (ids[k:], n_cut) if keep is None or self.kept >= (n or 0) else None
