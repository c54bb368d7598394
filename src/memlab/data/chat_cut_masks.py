"""Conversations cut before tokenizing with a loss mask on their assistant turns
(``method.loss_on=completion``): :func:`assistant_mask`, :mod:`memlab.data.chat`'s rule on a
conversation far longer than the method keeps; the argument is in :mod:`memlab.data.chat_cut`'s
docstring (*Loss masks*)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memlab.data import chat, cut
from memlab.data.base import check_messages, normalize_tools
from memlab.data.chat_cut import (
    NOT_RENDERED,
    SHORT,
    Region,
    encoded,
    is_long,
    region_of,
    search,
    whole_or_refuse,
    why_whole,
)
from memlab.data.cut import Keep

_Cut = tuple[list[int], list[int], int]
"""Ids, loss mask and characters cut off."""


def assistant_mask(tok, messages: list[dict], n: int | None, keep: Keep, row: int,
                   field: str = "messages", fix: str = chat.SFT_FIX, tools: Any = None,
                   kept_whole: str = "every token is kept"
                   ) -> tuple[list[int], list[int], int]:
    """:func:`memlab.data.chat.assistant_mask`, cut before tokenizing when far longer than
    ``n`` tokens so that the first (keep_start) or last (keep_end) ``n`` ids and mask values
    are the same (module docstring); and the characters cut."""
    check_messages(messages, row, field)

    def whole() -> tuple[list[int], list[int], int]:
        return (*chat.assistant_mask(tok, messages, row, field, fix, tools), 0)

    why = why_whole(tok, n, kept_whole)
    if why is not None or n is None or not is_long(messages, n * cut.GUESS):
        return whole_or_refuse(cut.size(messages), row, field, why or SHORT, whole)
    tools = normalize_tools(tools, row)
    info = chat.template_info(tok)
    chat._check_reasoning(info.text, messages, row, field)
    found, bounds = None, None
    if not info.markers:  # the whole conversation's text checks, as when tokenized whole
        try:
            bounds = chat._Turns(tok, info, messages, row, field, fix, tools).bounds()
        except chat.Unsplittable as e:
            found = chat.training_template(tok, messages, row, field, e)
    if bounds is not None:
        out = _Turned(tok, info, messages, bounds, row, field, fix, tools).cut(n, keep)
    else:
        out = _marked_cut(tok, messages, n, keep, row, field, tools,
                          found.text if found is not None else None)
    if out is None:
        return whole_or_refuse(cut.size(messages), row, field, NOT_RENDERED, whole)
    if found is not None:
        chat.count_template(tok, row, found.name)
    if not any(out[1]):
        raise chat.ChatTemplateError(f"row {row}: field '{field}' has no assistant turn to "
                                     f"train on; {fix}")
    return out


def _generation(tok, messages: list[dict], tools: list | None, template: str | None, row: int,
                field: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendering and its ``{% generation %}`` spans, as ``apply_chat_template`` makes them
    (None-valued keys dropped, the tokenizer's special tokens and the run's variables)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        out: Any = render_jinja_template(  # (annotated -> str; returns text and spans)
            conversations=[msgs], tools=tools, chat_template=tok.get_chat_template(template,
                                                                                  tools),
            return_assistant_tokens_mask=True, add_generation_prompt=False,
            **{**tok.special_tokens_map, **chat._settings(tok).kwargs})
    except Exception as e:  # noqa: BLE001 - templates raise their own exceptions
        raise chat._cannot_render(tok, e, messages, row, field, tools, template) from e
    rendered, spans = out
    return rendered[0], [(int(s), int(e)) for s, e in spans[0]]


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """The mask ``apply_chat_template`` makes: a token is masked when it overlaps a span."""
    mask, k = [0] * len(offsets), 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if e > spans[k][0]:
            mask[t] = 1
    return mask


def _clipped(spans: list[tuple[int, int]], region: Region, shift: int
             ) -> list[tuple[int, int]] | None:
    """The spans (in the cut text's positions) as they bear on the tokens kept: the same
    clipped spans mask them the same; None unless the spans are in order and apart."""
    if any(s > e for s, e in spans) or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    moved = [(s - shift, e - shift) for s, e in spans]
    if region.hi is not None:
        return [(s, min(e, region.hi)) for s, e in moved if s < region.hi]
    q = region.lo or 0
    return [(max(s, q - 1), e) for s, e in moved if e > q]


def _marked_cut(tok, messages: list[dict], n: int, keep: Keep, row: int, field: str,
                tools: list | None, template: str | None) -> _Cut | None:
    """Ids, mask and characters cut with a template with markers, or None (not cut)."""
    added = cut.added_texts(tok)
    w_text, w_spans = _generation(tok, messages, tools, template, row, field)

    def attempt(shown: list[dict], n_cut: int) -> tuple[int, Callable[[], _Cut]] | None:
        try:
            text, spans = _generation(tok, shown, tools, template, row, field)
            ids, mask = chat._marked(tok, shown, tools, template, row, field)
        except chat.ChatTemplateError:
            return None
        enc, region = encoded(tok, text), region_of(w_text, text, keep, added)
        if (enc is None or region is None or enc[0] != ids
                or _overlapping(enc[1], spans) != mask):
            return None  # (the mask apply_chat_template makes is not the one argued)
        span = cut.inside(enc[1], region.lo, region.hi)
        clipped = _clipped(spans, region, 0)
        if span is None or clipped is None or clipped != _clipped(w_spans, region,
                                                                  region.shift):
            return None
        return span[1] - span[0], lambda: (ids, mask, n_cut)

    return search(tok, messages, n, keep, attempt)


class _Turned:
    """The turns method (:mod:`memlab.data.chat`) on a conversation cut, checked against the
    whole one's text bounds (module docstring)."""

    def __init__(self, tok, info, messages: list[dict], bounds: tuple[str, list[int], list[int]],
                 row: int, field: str, fix: str, tools: list | None):
        self.tok, self.info, self.messages = tok, info, messages
        self.row, self.field, self.fix, self.tools = row, field, fix, tools
        self.whole, self.turns, self.cuts = bounds
        self.added = cut.added_texts(tok)

    def cut(self, n: int, keep: Keep) -> _Cut | None:
        return search(self.tok, self.messages, n, keep,
                      lambda shown, n_cut: self._attempt(shown, n_cut, keep))

    def _attempt(self, shown: list[dict], n_cut: int, keep: Keep
                 ) -> tuple[int, Callable[[], _Cut]] | None:
        turns = chat._Turns(self.tok, self.info, shown, self.row, self.field, self.fix,
                            self.tools)
        try:
            text, which, cuts = turns.bounds()
        except chat.ChatTemplateError:
            return None
        enc, region = encoded(self.tok, text), region_of(self.whole, text, keep, self.added)
        if enc is None or region is None or which != self.turns:
            return None
        ids, offsets = enc
        span = cut.inside(offsets, region.lo, region.hi)
        at = cut.cut_positions(offsets, len(text), cuts)  # as chat's _token_cuts
        if span is None or at is None:
            return None
        far = self._far(keep, region, span, cuts, at, ids)
        if far is None or not all(self._provable(c) for c in far):
            return None

        def masked() -> _Cut:
            mask = [0] * len(ids)
            for j in range(len(which)):
                end = turns._end_of_turn(ids, at[2 * j], at[2 * j + 1])
                mask[at[2 * j]:end] = [1] * (end - at[2 * j])
            return ids, mask, n_cut

        return span[1] - span[0], masked

    def _far(self, keep: Keep, region: Region, span: tuple[int, int], cuts: list[int],
             at: list[int], ids: list[int]) -> list[int] | None:
        """The whole text's turn bounds on the far side, or None when a turn is not split the
        same on the kept side (module docstring)."""
        special, far = self.info.special_ids, []
        for j in range(len(cuts) // 2):
            (bw, aw), (bc, ac) = self.cuts[2 * j:2 * j + 2], cuts[2 * j:2 * j + 2]
            if keep == "keep_start":
                q = region.hi
                assert q is not None
                if bc >= q and bw >= q:
                    far += [bw, aw]
                elif bc != bw:
                    return None
                elif ac <= q and aw <= q:
                    if ac != aw:
                        return None
                elif ac > q and aw > q and not any(i in special for i in ids[at[2 * j]:span[1]]):
                    far.append(aw)  # all of the turn's kept tokens are trained, as whole
                else:
                    return None
                continue
            q, d = region.lo, region.shift
            assert q is not None
            if ac <= q and aw <= q + d:
                far += [bw, aw]
            elif bc >= q:
                if (bw, aw) != (bc + d, ac + d):
                    return None
            elif aw == ac + d and bw < q + d and any(i in special
                                                     for i in ids[span[0]:at[2 * j + 1]]):
                far.append(bw)  # its end-of-turn token is kept: the turn ends the same
            else:
                return None
        return far

    def _provable(self, pos: int) -> bool:
        """Whether ``pos`` of the whole text is a token boundary by offsets, tokenizing only a
        piece between two word boundaries around it (the argument of :mod:`memlab.data.cut`),
        or the text's ends."""
        text = self.whole
        if pos >= len(text) or pos <= 0:
            return True
        lo = cut.boundary(text, pos - 1, "keep_end", self.added)
        hi = cut.boundary(text, pos + 1, "keep_start", self.added)
        if lo is None and pos > cut.SEARCH or hi is None and len(text) - pos > cut.SEARCH:
            return False
        a = 0 if lo is None else lo - 1
        b = len(text) if hi is None else hi + 1
        enc = cut.with_offsets(self.tok, text[a:b])
        if enc is None:
            return False
        span = cut.inside(enc[1], None if lo is None else lo - a, None if hi is None else hi - a)
        at = cut.cut_positions(enc[1], b - a, [pos - a])
        return span is not None and at is not None and span[0] < at[0] < span[1]
