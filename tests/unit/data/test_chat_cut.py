"""Conversations far longer than a method keeps, cut before tokenizing (memlab.data.chat_cut,
issue 43 item 6): the kept ids and loss mask equal those of the conversation tokenized whole.

On templates that transform what they render (Llama 3 trims every content, Qwen3 splits an
answer at ``</think>``), with ``{% generation %}`` markers and without (the turns method), and on
a stock template that no turn split works for (its rows go to the training template, counted as
when whole); where the renderings cannot prove a cut, the row is tokenized whole below the limit
and refused above it. The margins are lowered (``cut.SEARCH``) so that rows of a few thousand
characters are "far longer" than the few tokens kept."""

from __future__ import annotations

import random
import re

import pytest

from memlab.data import chat, chat_cut, chat_cut_masks, cut, templates
from memlab.data.assets import load_tokenizer
from memlab.data.base import DataError
from unit.data.test_templates import QWEN3_STOCK

LLAMA3 = templates.NAMED["llama3"].text()
TEMPLATES = {
    "chatml": None,  # memlab's own (markers)
    "llama3": LLAMA3,  # markers; every content trimmed
    "llama3-turns": re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", LLAMA3),  # no markers
    "qwen3": templates.NAMED["qwen3"].text(),  # markers; an answer split at </think>
    "qwen3-stock": QWEN3_STOCK,  # multi-turn rows unsplittable: the training template
}
WORDS = ["the", "cat's", "sat,", "on", "42", "1234567", "mats.", "Ünïcödé", "日本語", "\n", "  ",
         "--", "(a)", "don't", "x", "\t", "<think>"]
N = 24


@pytest.fixture(scope="module")
def toks():
    out = {}
    for name, template in TEMPLATES.items():
        tok = load_tokenizer()
        tok.add_tokens(["<think>", "</think>"])
        tok.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                       special_tokens=True)
        if template is not None:
            tok.chat_template = template
        out[name] = tok
    return out


@pytest.fixture(autouse=True)
def small_margins(monkeypatch):
    monkeypatch.setattr(cut, "SEARCH", 256)


def _text(rng: random.Random, words: int) -> str:
    return rng.choice(["", " ", "\n"]) + " ".join(rng.choice(WORDS) for _ in range(words)) \
        + rng.choice(["", " ", "\n "])


def _conversations(seed: int) -> list[list[dict]]:
    """Each shape with its long message at each place."""
    rng = random.Random(seed)
    shapes = [["user", "assistant"], ["system", "user", "assistant"],
              ["user", "assistant", "user", "assistant"]]
    return [[{"role": r, "content": _text(rng, 500 if i == big else 4)}
             for i, r in enumerate(roles)] for roles in shapes for big in range(len(roles))]


def _copy(messages: list[dict]) -> list[dict]:
    return [dict(m) for m in messages]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_kept_ids_and_mask_are_those_of_the_whole_conversation(toks, name):
    tok = toks[name]
    for keep in ("keep_start", "keep_end"):
        kept = slice(0, N) if keep == "keep_start" else slice(-N, None)
        for i, msgs in enumerate(_conversations(len(name)) + _conversations(len(name) + 99)):
            whole = chat.conversation_ids(tok, _copy(msgs), i, "messages")
            ids, n_cut = chat_cut.rendered_ids(tok, _copy(msgs), N, keep, i, "messages")
            assert n_cut > 0 and len(ids) < len(whole) and ids[kept] == whole[kept], (keep, i)
            with chat.rendering(tok) as whole_tally:
                w_ids, w_mask = chat.assistant_mask(tok, _copy(msgs), i)
            with chat.rendering(tok) as tally:
                ids, mask, n_cut = chat_cut_masks.assistant_mask(tok, _copy(msgs), N, keep, i)
            assert n_cut > 0 and (ids[kept], mask[kept]) == (w_ids[kept], w_mask[kept]), (keep, i)
            assert tally == whole_tally  # (qwen3-stock: multi-turn rows, training template)
    if name == "qwen3-stock":
        assert whole_tally.template_rows  # the training template's path was taken


def _answer_after_a_late_think(n_words: int) -> list[dict]:
    """An answer whose ``</think>`` lies past the margin: Qwen3's templates render the part
    before it as reasoning, so the cut conversation (without it) renders differently."""
    rng = random.Random(0)
    reasoning = " ".join(rng.choice(WORDS[:-1]) for _ in range(n_words))
    return [{"role": "user", "content": "why?"},
            {"role": "assistant", "content": f"{reasoning}</think>\n\nbecause"}]


def test_a_template_that_renders_the_cut_differently_is_tokenized_whole_or_refused(toks,
                                                                                  monkeypatch):
    tok = toks["qwen3"]
    msgs = _answer_after_a_late_think(600)
    whole = chat.assistant_mask(tok, _copy(msgs), 0)
    ids, mask, n_cut = chat_cut_masks.assistant_mask(tok, _copy(msgs), N, "keep_start", 0)
    assert n_cut == 0 and (ids, mask) == whole
    assert chat_cut.rendered_ids(tok, _copy(msgs), N, "keep_start", 0, "messages")[1] == 0
    # the end is kept the same: the cut keeps the </think>
    ids, mask, n_cut = chat_cut_masks.assistant_mask(tok, _copy(msgs), N, "keep_end", 0)
    assert n_cut > 0 and (ids[-N:], mask[-N:]) == (whole[0][-N:], whole[1][-N:])
    monkeypatch.setattr(cut, "WHOLE_LIMIT", 1000)
    for fn in (lambda: chat_cut_masks.assistant_mask(tok, _copy(msgs), N, "keep_start", 7),
               lambda: chat_cut.rendered_ids(tok, _copy(msgs), N, "keep_start", 7, "messages")):
        with pytest.raises(DataError, match="row 7: field 'messages' is .* characters long, over "
                                            "the 1,000 .*no cut before tokenizing is proven"):
            fn()


def test_a_content_without_word_boundaries_or_kept_whole_is_refused(toks, monkeypatch):
    tok = toks["chatml"]
    monkeypatch.setattr(cut, "WHOLE_LIMIT", 1000)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "z" * 3000}]
    with pytest.raises(DataError, match="no word boundary past the margin"):
        chat_cut_masks.assistant_mask(tok, _copy(msgs), N, "keep_start", 0)
    msgs[1]["content"] = "word " * 600
    with pytest.raises(DataError, match="over the 1,000 .*packing=wrapped keeps every token"):
        chat_cut.rendered_ids(tok, _copy(msgs), None, "keep_start", 0, "messages",
                              kept_whole="packing=wrapped keeps every token")
    assert chat_cut.rendered_ids(tok, _copy(msgs), N, "keep_start", 0, "messages")[1] > 0


def test_a_merge_at_the_prompt_end_cut_off_is_decided_as_whole(toks):
    """A completion kept at its end (reward models): the whole row's check that its ids start
    with the prompt's reads the tokens at the prompt's end, which the cut leaves out; it is
    decided on the whole text around them. ChatML's generation prompt ends with a newline that
    merges with an answer starting with spaces and a newline: the row cannot be split."""
    tok = toks["chatml"]
    prompt = [{"role": "user", "content": "hi"}]
    rng = random.Random(1)
    for start, splits in (("        \n on", False), ("ok", True)):
        answer = [{"role": "assistant", "content": start + " " + _text(rng, 600)}]
        pr = chat_cut.prompt(tok, _copy(prompt), N, "keep_end", 0)
        if not splits:
            with pytest.raises(chat.Unsplittable) as whole:
                chat.completion_ids(tok, _copy(prompt), pr.ids, _copy(answer), 0, "chosen")
            with pytest.raises(chat.Unsplittable) as cut_:
                chat_cut.completion_ids(tok, pr, _copy(answer), N, "keep_end", 0, "chosen")
            assert str(cut_.value) == str(whole.value)
            continue
        w = chat.completion_ids(tok, _copy(prompt), pr.ids, _copy(answer), 0, "chosen")
        ids, n_cut = chat_cut.completion_ids(tok, pr, _copy(answer), N, "keep_end", 0, "chosen")
        assert n_cut > 0 and ids[-N:] == w[-N:]
