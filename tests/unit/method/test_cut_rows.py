"""Rows far longer than a method keeps, cut before tokenizing (issue 43 item 6): what each
method prepares from them, and decides, equals what it prepares from its rows tokenized whole.

``dpo``, ``kto``, ``reward``, ``gkd``, the online methods' prompts and ``sft``'s conversations,
on plain-text and conversational rows (memlab's ChatML, with markers): ids, the rows dropped
(a prompt that fills max_length), the KL completions, and the rows of each truncation mode.
"Whole" is the same method with cutting off (the tokenizer reported as not covered by the
argument of memlab.data.cut); the margins are lowered (``cut.SEARCH``) so that rows of a few
thousand characters are far longer than the few tokens kept. ``tokens_in`` counts what was
tokenized, so the cut run's is smaller and its ``cut_before_tokenizing`` says what was cut."""

from __future__ import annotations

import dataclasses
import random

import datasets
import pytest

from memlab.data import chat_cut, cut
from memlab.data.assets import load_tokenizer
from memlab.method import _rollout
from memlab.method.dpo import DPO
from memlab.method.gkd import GKD
from memlab.method.kto import KTO
from memlab.method.reward import Reward
from memlab.method.sft import SFT

WORDS = ["the", "cat's", "sat,", "on", "42", "1234567", "mats.", "Ünïcödé", "日本語", "\n", "--",
         "(a)", "don't"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(autouse=True)
def small_margins(monkeypatch):
    monkeypatch.setattr(cut, "SEARCH", 256)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _rows(kind: str, seed: int = 0) -> dict[str, list[dict]]:
    """Preference rows, plain text and conversations: long prompts, long completions, both."""
    rng = random.Random(seed)

    def field(n: int, role: str | None = None):
        value = _text(rng, n)
        return value if kind == "text" else [{"role": role or "assistant", "content": value}]

    def prompt(n: int):
        if kind == "text":
            return _text(rng, n)
        return [{"role": "system", "content": "Answer."},
                {"role": "user", "content": _text(rng, n)}]

    sizes = [(600, 600, 3), (3, 600, 700), (700, 3, 3), (3, 3, 3), (500, 500, 500)]
    return {"pairs": [{"prompt": prompt(p), "chosen": field(c), "rejected": field(r)}
                      for p, c, r in sizes],
            "unpaired": [{"prompt": prompt(p), "completion": field(c), "label": i % 2 == 0}
                         for i, (p, c, _) in enumerate(sizes)]}


def _prepared(monkeypatch, fn, *args):
    """``fn(*args)`` as is (cut) and with cutting off (whole)."""
    cut_ = fn(*args)
    with monkeypatch.context() as m:
        info = cut._info
        m.setattr(cut, "_info", lambda t: dataclasses.replace(info(t), why_not="off (tests)"))
        return cut_, fn(*args)


def _same(cut_, whole, columns: list[str]) -> int:
    """The two preparations agree (rows, columns, examples dropped); the rows cut."""
    (a, sa), (b, sb) = cut_, whole
    for c in columns:
        assert a[c] == b[c], c
    assert sa.examples_dropped == sb.examples_dropped and sa.examples == sb.examples
    assert sa.hollow_rows == sb.hollow_rows
    return sa.extra.get("cut_before_tokenizing", {}).get("rows", 0)


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_dpo_pairs(tok, monkeypatch, kind):
    ds = datasets.Dataset.from_list(_rows(kind)["pairs"])
    for limits in ({"max_prompt_length": 16, "max_completion_length": 12, "max_length": 64},
                   {"max_prompt_length": None, "max_completion_length": None, "max_length": 40},
                   {"max_prompt_length": 10, "max_completion_length": None, "max_length": 30}):
        out = _prepared(monkeypatch, DPO(**limits).prepare, ds, tok, None)
        assert _same(*out, ["prompt_ids", "chosen_ids", "rejected_ids"]) >= 3, limits
        if limits["max_prompt_length"] is None:  # the long prompts fill max_length: dropped
            assert out[0][1].examples_dropped == 3


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_kto_examples_and_pairs(tok, monkeypatch, kind):
    rows = _rows(kind)
    columns = ["prompt_ids", "completion_ids", "label", "kl_completion_ids"]
    for name, share in (("unpaired", False), ("pairs", False), ("pairs", True)):
        ds = datasets.Dataset.from_list(rows[name])
        method = KTO(max_prompt_length=16, max_completion_length=12, max_length=40,
                     share_prompt=share)
        out = _prepared(monkeypatch, method.prepare, ds, tok, None)
        assert _same(*out, columns) >= 3, (name, share)
        assert {"desirable", "undesirable"} <= set(out[0][1].extra)


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_reward_sequences(tok, monkeypatch, kind):
    pairs = _rows(kind)["pairs"]
    with_prompt = datasets.Dataset.from_list(pairs)
    alone = datasets.Dataset.from_list(  # the completion is the whole conversation / text
        [{"chosen": r["chosen"] if kind == "text" else r["prompt"] + r["chosen"],
          "rejected": r["rejected"] if kind == "text" else r["prompt"] + r["rejected"]}
         for r in pairs])
    for ds in (with_prompt, alone):
        for mode in ("drop", "keep_end"):
            method = Reward(max_length=32, truncation_mode=mode)
            out = _prepared(monkeypatch, method.prepare, ds, tok, None)
            assert _same(*out, ["chosen_ids", "rejected_ids"]) >= 3, mode
            if mode == "drop":  # (a long sequence: the pair is dropped, cut or whole)
                assert out[0][1].examples_dropped >= 3


def test_gkd_and_online_prompts(tok, monkeypatch):
    rng = random.Random(3)
    convs = [[{"role": "user", "content": _text(rng, u)}, {"role": "assistant",
                                                          "content": _text(rng, a)}]
             for u, a in ((600, 3), (3, 600), (600, 600), (3, 3))]
    ds = datasets.Dataset.from_list([{"messages": m} for m in convs])
    gkd = GKD(max_prompt_length=16, max_length=40)
    out = _prepared(monkeypatch, gkd.prepare, ds, tok, None)
    assert _same(*out, ["prompt_ids", "completion_ids"]) == 3
    strings = datasets.Dataset.from_list([{"prompt": m[0]["content"], "chosen": "a"}
                                          for m in convs])
    for d in (ds, strings):
        out = _prepared(monkeypatch, _rollout.prompt_rows, d, tok, 16)
        assert _same(*out, ["prompt_ids", "prompt_text"]) == 2


@pytest.mark.parametrize("keep", ["keep_start", "keep_end"])
def test_sft_conversations(tok, monkeypatch, keep):
    """Conversations (loss on all tokens and on the assistant turns) and conversational
    prompt-completion rows: the ids and loss mask of the ``max_length`` tokens kept."""
    rng = random.Random(4)
    limit, window = 24, slice(0, 24) if keep == "keep_start" else slice(-24, None)
    convs = [[{"role": "system", "content": _text(rng, s)},
              {"role": "user", "content": _text(rng, u)},
              {"role": "assistant", "content": _text(rng, a)}]
             for s, u, a in ((600, 3, 3), (3, 600, 3), (3, 3, 600), (3, 600, 600))]
    for loss_on in ("all", "completion"):
        sft = SFT(max_length=limit, truncation_mode=keep, loss_on=loss_on)
        for i, msgs in enumerate(convs):
            rows = [("messages", {"messages": [dict(m) for m in msgs]}),
                    ("prompt_completion", {"prompt": [dict(m) for m in msgs[:2]],
                                           "completion": [dict(msgs[2])]})]
            for fmt, row in rows:
                (ids, mask, n_cut), (w_ids, w_mask, _) = _prepared(
                    monkeypatch, sft._encode, fmt, row, i, tok, limit, "kept")
                assert n_cut > 0 and (ids[window], mask[window]) == (w_ids[window],
                                                                     w_mask[window]), (fmt, i)


def test_a_conversation_the_chat_cut_refuses_is_tokenized_whole(tok, monkeypatch):
    """Where the chat cut cannot prove a conversation's cut (``NotCut``: a template that renders
    the cut text differently on the kept side), dpo's pairs and reward's sequences are tokenized
    whole: what they prepare equals the preparation with cutting off, and nothing is cut."""

    def refuse(*args, **kwargs):
        raise chat_cut.NotCut("the template renders the cut differently (test)")

    monkeypatch.setattr(chat_cut, "prompt", refuse)
    pairs = datasets.Dataset.from_list(_rows("chat")["pairs"])
    dpo = DPO(max_prompt_length=16, max_completion_length=12, max_length=64)
    assert _same(*_prepared(monkeypatch, dpo.prepare, pairs, tok, None),
                 ["prompt_ids", "chosen_ids", "rejected_ids"]) == 0
    reward = Reward(max_length=32, truncation_mode="keep_end")
    assert _same(*_prepared(monkeypatch, reward.prepare, pairs, tok, None),
                 ["chosen_ids", "rejected_ids"]) == 0
