"""Issue 43, item 6: one very long JSONL line no longer passes 6 GB while tokenizing.

Where the method truncates, a string far longer than ``max_length`` is cut before tokenizing, at a
word boundary, to the same kept token ids (:mod:`memlab.data.cut` argues why; conversations:
:mod:`memlab.data.chat_cut`, tests/reliability/test_long_chat_rows.py); what is tokenized whole
(packing that keeps every token, a method without length limits, no word boundary) is refused
above ``cut.WHOLE_LIMIT`` characters, naming file, line and field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memlab.data import cut, text
from memlab.data.assets import load_tokenizer
from memlab.data.base import DataError
from reliability.helpers import ENV

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _texts(tok) -> dict[str, str]:
    """Texts of several kinds, each ~400k characters."""
    rng = random.Random(0)
    words = ["the", "cat's", "sat,", "on", "42", "1234567", "mats.", "Ünïcödé", "日本語",
             "\n", "\t", "  ", "--", "x" * 30, "(a)", "don't"]
    longest = max((e for e in tok.get_vocab() if e.isalpha()), key=len)
    mixed = " ".join(rng.choice(words) for _ in range(70_000))
    return {
        "mixed": mixed,
        # tokens of ~14 characters: more than cut.GUESS, so the cut is moved further (doubling)
        "long tokens": " ".join([longest] * 30_000),
        # one long run without spaces in the middle: the boundary is searched past it
        "a run": mixed[:150_000] + "y" * 50_000 + mixed[150_000:300_000],
    }


@pytest.mark.parametrize("keep", ["keep_start", "keep_end"])
def test_cut_keeps_the_same_ids(tok, keep):
    """A bit over the margin and much over: the kept ``n`` ids are those of the whole text."""
    for name, whole_text in _texts(tok).items():
        full = text.document_ids(tok, whole_text)
        for n in (64, 1000):
            for length in (2 * n * cut.GUESS + cut.SEARCH + 50, len(whole_text)):
                t = whole_text[:length] if keep == "keep_start" else whole_text[-length:]
                ref = full if length == len(whole_text) else text.document_ids(tok, t)
                ids, n_cut = cut.encode(tok, t, n, keep, lambda s: text.document_ids(tok, s),
                                        0, "text")
                assert n_cut > 0, (name, n, length)
                if keep == "keep_start":
                    assert ids[:n] == ref[:n], (name, n, length)
                else:
                    assert ids[-n:] == ref[-n:], (name, n, length)


def test_what_is_covered(tok):
    """memlab's tokenizer is covered by the argument; a tokenizer without a pre-tokenizer is
    not, and is never cut (a field over the limit is refused)."""
    assert cut.why_not(tok) is None
    assert cut.longest_entry(tok) >= max(len(e) for e in tok.get_vocab())
    from tokenizers import Tokenizer

    bare = json.loads(tok.backend_tokenizer.to_str())
    bare["pre_tokenizer"] = None
    other = load_tokenizer()
    other._tokenizer = Tokenizer.from_str(json.dumps(bare))
    assert "does not split at spaces" in (cut.why_not(other) or "")
    with pytest.raises(DataError, match="cannot be cut provably"):
        cut.encode(other, "a " * (cut.WHOLE_LIMIT // 2 + 1), 8, "keep_start", list, 3, "text")


def _prepare(tmp_path: Path, rows: list[dict], *overrides: str):
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab.pipeline import prepare_rows
    from memlab_testing import compose, with_fast

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose(with_fast(["data=local", f"data.path={path}", *overrides]))
    cfg = OmegaConf.to_container(cfg)
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    tok = ctx.model.load_tokenizer(ctx)
    return prepare_rows(ctx, tok)[1:3], path


@pytest.mark.parametrize("keep", ["keep_start", "keep_end"])
def test_prepared_rows_are_the_same(tmp_path, tok, keep):
    """Through method=sft's prepare: text and string prompt-completion rows, cut, train on the
    same ids and labels as when tokenized whole and truncated."""
    from memlab.method.base import shifted_labels

    mixed = _texts(tok)["mixed"]
    sft = dataclasses.replace(_sft(), truncation_mode=keep)
    for fmt, rows in [("text", [{"text": mixed}, {"text": "short"}]),
                      ("prompt_completion", [
                          {"prompt": mixed[:200_000], "completion": mixed[200_000:]},
                          {"prompt": "Say it:", "completion": mixed}])]:
        (ds, stats), _ = _prepare(tmp_path, rows, "method=sft", "method.max_length=512",
                                  f"method.truncation_mode={keep}")
        assert stats.extra["cut_before_tokenizing"]["rows"] == (1 if fmt == "text" else 2)
        for i, row in enumerate(rows):
            ids, mask, _ = sft._encode(fmt, row, i, tok, None, "")  # whole, then truncated
            ids, mask = (ids[:512], mask[:512]) if keep == "keep_start" else (ids[-512:],
                                                                             mask[-512:])
            assert ds[i]["input_ids"] == ids, (fmt, i)
            assert ds[i]["labels"] == shifted_labels(ids, mask), (fmt, i)


def _sft():
    from memlab.method.sft import SFT

    return SFT(max_length=512)


def test_what_is_kept_whole_is_refused_above_the_limit(tmp_path):
    """Packing that keeps every token, and a method without length limits: a field over the
    limit is ``invalid`` naming file, line, field and size, before anything is tokenized; a
    pathological run with no word boundary too."""
    big = "word " * (cut.WHOLE_LIMIT // 5 + 1)
    run = "z" * (cut.WHOLE_LIMIT + 1)
    cases = [
        ([{"text": "ok"}, {"text": big}], ["method=sft", "packing=wrapped"],
         "line 2: row 1: field 'text'", "keeps every token"),
        ([{"text": big}], ["method=sft", "packing=bfd_split"], "line 1: row 0: field 'text'",
         "keeps every token"),
        ([{"text": run}], ["method=sft"], "field 'text'", "no word boundary"),
        ([{"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": big}]}],
         ["method=sft", "packing=bfd_split"], "field 'messages'", "keeps every token"),
        ([{"prompt": big, "chosen": "a", "rejected": "b"}],
         ["method=dpo", "method.max_length=null", "method.max_prompt_length=null"],
         "field 'prompt'", "keeps every token"),
    ]
    for rows, overrides, where, why in cases:
        with pytest.raises(DataError) as e:
            _prepare(tmp_path, rows, *overrides)
        msg = str(e.value)
        assert "rows.jsonl" in msg and where in msg and why in msg, msg
        assert f"over the {cut.WHOLE_LIMIT:,}" in msg and "split it into several rows" in msg


def test_a_20_mb_line_prepares_in_bounded_memory(tmp_path):
    """A 20 MB single-line row (method=sft, max_length=1024) prepares in its own process under
    1 GB peak RSS; tokenized whole it took ~230 bytes a character (1.4 GB at 5 MB: ~4.6 GB).
    The peak is the process's own memory's high-water mark (VmHWM): ``ru_maxrss`` keeps the
    high-water mark of the process it was forked from (a large test worker's)."""
    path = tmp_path / "big.jsonl"
    chunk = json.dumps("alpha beta gamma, delta. 42 eta\n" * 1000)[1:-1]
    with path.open("w") as f:
        f.write('{"text": "short"}\n{"text": "' + chunk * (20_000_000 // len(chunk)) + '"}\n')
    script = textwrap.dedent(f"""
        import json
        from omegaconf import OmegaConf
        from memlab.context import validate
        from memlab.pipeline import prepare_rows
        from memlab_testing import compose, with_fast
        cfg = OmegaConf.to_container(compose(with_fast(
            ["method=sft", "method.max_length=1024", "data=local", "data.path={path}"])))
        del cfg["hydra"]
        ctx = validate(OmegaConf.create(cfg))
        _, ds, stats, _ = prepare_rows(ctx, ctx.model.load_tokenizer(ctx))
        print(json.dumps({{"rows": len(ds), "cut": stats.extra["cut_before_tokenizing"],
                          "lens": [len(x) for x in ds["input_ids"]],
                          "rss": [int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                                  if line.startswith("VmHWM:")][0]}}))
    """)
    tests = Path(__file__).parents[1]
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tests), ENV.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rows"] == 2 and result["lens"][1] == 1024
    assert result["cut"]["characters"] > 19_000_000
    assert result["rss"] < 2**30, f"peak RSS {result['rss'] / 2**20:.0f} MiB"
