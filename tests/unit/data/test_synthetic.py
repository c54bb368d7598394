"""The embedded synthetic data and the shipped tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from memlab.data import synthetic  # noqa: E402
from memlab.data.assets import load_tokenizer, tokenizer_path  # noqa: E402
from memlab.data.synthetic._qa import answer  # noqa: E402
from memlab.data.synthetic._random import Sampler  # noqa: E402
from memlab.data.synthetic._tokens import est  # noqa: E402
from memlab.data.synthetic._words import BAD_OPENERS, GOOD_OPENERS  # noqa: E402
from memlab.data.synthetic.chat import conversation  # noqa: E402

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _pct(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def _lengths(tok, conversations: list[list[dict]]) -> list[int]:
    texts = tok.apply_chat_template(conversations, tokenize=False)
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


# -- determinism -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gen", [synthetic.generate_chat, synthetic.generate_text, synthetic.generate_preference]
)
def test_deterministic(gen):
    a = gen(50, seed=3)
    assert a == gen(50, seed=3)
    assert a != gen(50, seed=4)
    assert gen(20, seed=3) == a[:20]  # a prefix of a longer run


# The first 16 hex digits of the sha256 of each generator's rows (as JSON, key order kept) for a
# few seeds, sizes and length settings. They pin the exact data the code has generated since it
# was written: a refactor must keep every byte, so the shipped tokenizer (trained on this text)
# and every recorded measurement stay valid. ``median_tokens=32, max_tokens=64`` makes chat and
# preference rows overshoot and take the shorter-retry path.
FINGERPRINTS = [
    ("chat", 0, 60, {}, "11e51c396a244bae"),
    ("chat", 7, 25, {}, "9beb779901f52495"),
    ("chat", 1, 60, {"median_tokens": 64, "max_tokens": 256}, "f7eaeb8278dff142"),
    ("chat", 1, 60, {"median_tokens": 32, "max_tokens": 64}, "26d9f1dd73132a4e"),
    ("chat", 2, 30, {"median_tokens": 1000, "max_tokens": 3000, "sigma": 0.5}, "52945001cce5f886"),
    ("text", 0, 60, {}, "1757216a836f71eb"),
    ("text", 7, 25, {}, "469fb2f94c1fe151"),
    ("text", 1, 60, {"median_tokens": 64, "max_tokens": 256}, "e5085c5f457f4185"),
    ("text", 1, 60, {"median_tokens": 32, "max_tokens": 64}, "261dfc58859b0342"),
    ("preference", 0, 60, {}, "dda5905e8a3999c9"),
    ("preference", 7, 25, {}, "838d1f03a2b3d627"),
    ("preference", 1, 60, {"median_tokens": 64, "max_tokens": 256}, "7fa3d46c8e05e551"),
    ("preference", 1, 60, {"median_tokens": 32, "max_tokens": 64}, "34c844826c0b2b19"),
    (
        "preference",
        2,
        30,
        {"median_tokens": 1000, "max_tokens": 3000, "sigma": 0.5},
        "7aecebf3bcdc1f3b",
    ),
]


@pytest.mark.parametrize("kind,seed,n,kwargs,want", FINGERPRINTS)
def test_output_is_byte_identical_to_the_recorded_fingerprint(kind, seed, n, kwargs, want):
    rows = getattr(synthetic, f"generate_{kind}")(n, seed=seed, **kwargs)
    blob = json.dumps(rows, ensure_ascii=False).encode()
    assert hashlib.sha256(blob).hexdigest()[:16] == want, (
        f"generate_{kind}({n}, seed={seed}, **{kwargs}) no longer gives the recorded rows"
    )


# -- schema ------------------------------------------------------------------------------------
def _check_messages(msgs: list[dict]) -> None:
    assert isinstance(msgs, list) and msgs
    for m in msgs:
        assert set(m) == {"role", "content"}
        assert m["role"] in ("system", "user", "assistant")
        assert isinstance(m["content"], str) and m["content"].strip() == m["content"]
        assert m["content"]


def test_chat_schema():
    rows = synthetic.generate_chat(300, seed=1)
    assert len(rows) == 300
    n_system = 0
    turns = set()
    for row in rows:
        assert set(row) == {"messages"}
        msgs = row["messages"]
        _check_messages(msgs)
        if msgs[0]["role"] == "system":
            n_system += 1
            msgs = msgs[1:]
        assert all(m["role"] != "system" for m in msgs)
        roles = [m["role"] for m in msgs]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) % 2 == 0
        turns.add(len(roles) // 2)
    assert turns == {1, 2, 3}
    assert 0.15 < n_system / len(rows) < 0.45


def test_text_schema():
    rows = synthetic.generate_text(200, seed=1)
    assert len(rows) == 200
    for row in rows:
        assert set(row) == {"text"}
        assert isinstance(row["text"], str) and row["text"]


def test_preference_schema():
    rows = synthetic.generate_preference(300, seed=1)
    assert len(rows) == 300
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected"}
        _check_messages(row["prompt"])
        assert row["prompt"][-1]["role"] == "user"
        for key in ("chosen", "rejected"):
            _check_messages(row[key])
            assert [m["role"] for m in row[key]] == ["assistant"]


def test_preference_pairs_differ_learnably():
    rows = synthetic.generate_preference(300, seed=2)
    different_length = 0
    for row in rows:
        chosen = row["chosen"][0]["content"]
        rejected = row["rejected"][0]["content"]
        assert chosen != rejected
        different_length += len(chosen.split()) != len(rejected.split())
        # The rule: chosen opens politely and stays on the question's key noun.
        assert any(chosen.startswith(o) for o in GOOD_OPENERS)
        assert any(rejected.startswith(o) for o in BAD_OPENERS)
    assert different_length > 0.8 * len(rows)


def _words(text: str) -> set[str]:
    return set(text.replace(".", " ").replace(",", " ").replace(":", " ").split())


def test_chosen_names_the_key_noun_and_rejected_does_not():
    g = Sampler(0, 300, 6000, 1.1)
    for _ in range(200):
        _, q = conversation(g, g.length(), final_answer=False)
        key = q["key"]
        assert key in _words(answer(g, q, 200, good=True))
        assert key not in _words(answer(g, q, 200, good=False))


def test_small_caps_and_medians():
    rows = synthetic.generate_chat(200, seed=0, median_tokens=64, max_tokens=400)
    lengths = [sum(est(m["content"]) + 5 for m in r["messages"]) for r in rows]
    assert max(lengths) <= 400
    assert 40 <= _pct(lengths, 0.5) <= 110
    with pytest.raises(ValueError):
        synthetic.generate_chat(1, max_tokens=0)


def test_generation_is_fast():
    t0 = time.perf_counter()
    synthetic.generate_chat(2000, seed=0)
    # The target is < 2 s on a laptop core; the bound only catches order-of-magnitude slowdowns.
    assert time.perf_counter() - t0 < 10


# -- lengths under the shipped tokenizer ---------------------------------------------------------
@pytest.mark.slow
def test_chat_lengths_are_heavy_tailed(tok):
    rows = synthetic.generate_chat(1000, seed=0)
    lengths = _lengths(tok, [r["messages"] for r in rows])
    assert 150 <= _pct(lengths, 0.5) <= 600
    assert _pct(lengths, 0.99) > 2000
    assert max(lengths) <= 6000


def _content_lengths(tok, rows: list[dict], key: str) -> list[int]:
    # Exact: <|im_end|> is special, so a turn's content tokenizes the same on its own.
    texts = [r[key][0]["content"] for r in rows]
    return [len(ids) + 2 for ids in tok(texts, add_special_tokens=False)["input_ids"]]


@pytest.mark.slow
def test_text_and_preference_lengths(tok):
    texts = [r["text"] for r in synthetic.generate_text(300, seed=0)]
    lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    assert 150 <= _pct(lengths, 0.5) <= 600 and _pct(lengths, 0.95) > 1000
    assert max(lengths) <= 6000

    rows = synthetic.generate_preference(300, seed=0)
    prompts = tok.apply_chat_template(
        [r["prompt"] for r in rows], tokenize=False, add_generation_prompt=True
    )
    prompt_len = [len(ids) for ids in tok(prompts, add_special_tokens=False)["input_ids"]]
    chosen = [p + c for p, c in zip(prompt_len, _content_lengths(tok, rows, "chosen"))]
    rejected = [p + c for p, c in zip(prompt_len, _content_lengths(tok, rows, "rejected"))]
    assert 150 <= _pct(chosen, 0.5) <= 600 and _pct(chosen, 0.95) > 1000
    assert max(chosen) <= 6000 and max(rejected) <= 6000
    assert _pct(prompt_len, 0.95) > 4 * _pct(prompt_len, 0.5)


def test_small_max_tokens_is_respected(tok):
    rows = synthetic.generate_chat(200, seed=1, median_tokens=64, max_tokens=256)
    assert max(_lengths(tok, [r["messages"] for r in rows])) <= 256
    rows = synthetic.generate_preference(200, seed=1, median_tokens=64, max_tokens=256)
    for key in ("chosen", "rejected"):
        assert max(_lengths(tok, [r["prompt"] + r[key] for r in rows])) <= 256


# -- the tokenizer -------------------------------------------------------------------------------
def test_tokenizer_files_and_special_tokens(tok):
    path = tokenizer_path()
    assert (path / "tokenizer.json").stat().st_size < 1_000_000
    assert (path / "tokenizer_config.json").is_file()
    assert len(tok) == 4096
    assert tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2, 3, 4]
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 0)
    assert (tok.bos_token, tok.bos_token_id) == ("<|bos|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 4)
    assert tok.model_max_length >= 1_000_000
    ids = tok("hello world")["input_ids"]
    assert 1 not in ids and 4 not in ids  # nothing added automatically
    assert tok.convert_ids_to_tokens(tok("<|im_start|>user<|im_end|>")["input_ids"])[0] == (
        "<|im_start|>"
    )


def test_tokenizer_round_trips(tok):
    samples = [r["text"] for r in synthetic.generate_text(20, seed=5)]
    samples += [
        "Unseen words: zygote, quixotic; UNICODE: héllo wörld, 你好, emoji 🙂.",
        "def f(x):\n\treturn x ** 2  # tabs, spaces   and\r\nCRLF",
        "   leading and trailing spaces   ",
    ]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_tokenizer_is_compact_on_its_corpus(tok):
    rows = synthetic.generate_chat(200, seed=9)
    for r in rows[:50]:
        text = " ".join(m["content"] for m in r["messages"])
        n_tok = len(tok(text, add_special_tokens=False)["input_ids"])
        assert n_tok <= 1.25 * est(text) + 5


def test_assistant_mask_covers_exactly_the_assistant_turns(tok):
    rows = synthetic.generate_chat(60, seed=7)
    assert any(len(r["messages"]) >= 5 for r in rows)
    for r in rows:
        msgs = r["messages"]
        out = tok.apply_chat_template(
            msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = out["input_ids"], out["assistant_masks"]
        assert len(ids) == len(mask)
        spans, cur = [], []
        for i, m in zip(ids, mask):
            if m:
                cur.append(i)
            elif cur:
                spans.append(cur)
                cur = []
        if cur:
            spans.append(cur)
        want = [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
        assert [tok.decode(s) for s in spans] == want
        unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert all(m["content"] in unmasked for m in msgs if m["role"] != "assistant")


def test_generation_prompt_is_a_prefix(tok):
    for row in synthetic.generate_preference(20, seed=3):
        prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
        assert prompt.endswith("<|im_start|>assistant\n")
        assert full == prompt + row["chosen"][0]["content"] + "<|im_end|>\n"
        assert prompt.startswith("<|im_start|>") and "<|bos|>" not in full
