"""``memlab lengths``: exact statistics on a local jsonl of known token lengths, the padding
estimate against the trainer's own batching, and the embedded default's heavy tail."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from memlab.cli import lengths as L

pytestmark = pytest.mark.usefixtures("no_cpu_bf16")

WORDS = ("apple banana cherry river mountain planet garden window silver yellow orange "
         "quiet rapid gentle castle harbor").split()


def _texts(n: int, seed: int = 0) -> list[str]:
    """Plain texts with heavy-tailed word counts (1 .. ~400 words)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = max(1, min(400, int(rng.lognormvariate(math.log(12), 1.1))))
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)))
    return out


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _expected_lengths(texts: list[str]) -> np.ndarray:
    """What SFT feeds the model for a plain-text row: the text's ids + EOS (shipped tokenizer)."""
    from memlab.data.assets import load_tokenizer

    tok = load_tokenizer()
    return np.array([len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts])


def _nearest_rank(values: np.ndarray, q: float) -> int:
    s = sorted(int(v) for v in values)
    return s[max(1, math.ceil(q / 100 * len(s))) - 1]


def _brute_padding(lengths: np.ndarray, batch_size: int, seed: int, epochs: int,
                   multiple: int | None) -> float:
    """Padding of real padded batches: the trainer's BatchStream + the methods' pad_batch."""
    import datasets

    from memlab.method.base import pad_batch
    from memlab.trainer.batch import BatchStream

    ds = datasets.Dataset.from_dict({"input_ids": [[7] * int(n) for n in lengths]})
    stream = BatchStream(ds, batch_size, seed, collate=lambda rows: rows)
    real = slots = 0
    for _ in range(epochs * -(-len(lengths) // batch_size)):
        _, r, t = pad_batch(next(stream), 0, multiple, {"input_ids": 0})
        real, slots = real + r, slots + t
    assert stream.epoch == epochs - 1 and stream.pos == len(lengths)
    return 1 - real / slots


# --------------------------------------------------------------------------------------------


def test_hydra_flags_split_off_and_default_candidates():
    from memlab.cli.compose import split_hydra_flags

    hydra, rest = split_hydra_flags(["--out", "d", "-m", "data=local", "--cfg", "job",
                                     "--candidates=64,128", "data.path=a=b.jsonl", "-cd", "x",
                                     "--no-plot", "+x=1"])
    assert hydra == ["-m", "--cfg", "job", "-cd", "x"]
    args, overrides = L.build_parser().parse_known_args(rest)
    assert args.out.name == "d" and args.candidates == [64, 128] and args.no_plot
    assert overrides == ["data=local", "data.path=a=b.jsonl", "+x=1"]
    assert L.default_candidates(5600) == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert L.default_candidates(4096) == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert L.default_candidates(100_000) == [2**k for k in range(7, 15)]
    assert L.default_candidates(10) == [128]


@pytest.mark.pipeline
def test_local_jsonl_exact(tmp_path, monkeypatch):
    from memlab.model.tiny import Tiny

    def no_model(*a, **k):
        raise AssertionError("memlab lengths must never load a model")

    monkeypatch.setattr(Tiny, "load", no_model)
    texts = _texts(60)
    data = _write_jsonl(tmp_path / "rows.jsonl", texts)
    expected = _expected_lengths(texts)
    cands = [16, 64, 128, 256, 512, 1024]
    total = int(expected.sum())
    fracs = {c: sum(max(0, int(n) - c) for n in expected) / total for c in cands}
    assert fracs[128] > fracs[256]
    threshold = (fracs[128] + fracs[256]) / 2  # so the rule must pick 256, not an end
    out = tmp_path / "out"
    code = L.main(["data=local", f"data.path={data}", "train.seed=3", "--out", str(out),
                   "--candidates", ",".join(map(str, cands)), "--batch-size", "3",
                   "--max-truncated", repr(threshold), "--epochs", "4", "--num-proc", "1"])
    assert code == 0
    res = json.loads((out / "lengths.json").read_text())

    st = res["stats"]
    for q in L.PERCENTILES:
        assert st[f"p{q}"] == _nearest_rank(expected, q)
    assert st["max"] == expected.max() and st["min"] == expected.min()
    assert st["count"] == len(texts) and st["total_tokens"] == expected.sum()
    assert st["mean"] == pytest.approx(expected.mean(), rel=1e-12)

    assert [r["max_length"] for r in res["candidates"]] == cands
    for r in res["candidates"]:
        c = r["max_length"]
        over = sum(max(0, int(n) - c) for n in expected)
        n_over = sum(int(n) > c for n in expected)
        assert r["tokens_truncated"] == over and r["examples_truncated"] == n_over
        assert r["tokens_truncated_frac"] == pytest.approx(over / total, rel=1e-12, abs=0)
        assert r["examples_truncated_frac"] == pytest.approx(n_over / len(texts), rel=1e-12)
        brute = _brute_padding(np.minimum(expected, c), 3, seed=3, epochs=4, multiple=None)
        assert r["padding_frac"] == pytest.approx(brute, rel=1e-12, abs=1e-15)
        assert 0 < r["packed_fill"] <= 1

    # the rule: the smallest candidate cutting <= --max-truncated of the tokens
    want = min(c for c in cands if fracs[c] <= threshold)
    assert want == 256
    assert res["recommended"]["max_length"] == want
    assert f"max_length={want}" in res["recommended"]["reason"]
    assert res["data"] == "local" and res["method"] == "sft"

    png = out / "lengths.png"
    assert png.is_file() and png.stat().st_size > 5000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.pipeline
def test_sharded_tokenization_is_identical(tmp_path):
    from memlab.cli.compose import compose
    from memlab.context import validate

    texts = _texts(600, seed=1)
    data = _write_jsonl(tmp_path / "rows.jsonl", texts)
    cfg, choices = compose(["data=local", f"data.path={data}", "method.max_length=16"])
    ctx = validate(cfg, tmp_path, choices)
    tok = ctx.model.load_tokenizer(ctx)
    raw = ctx.data.load(ctx)
    one = L.tokenize_lengths(ctx, tok, raw, num_proc=1)["total"]
    two = L.tokenize_lengths(ctx, tok, raw, num_proc=2)["total"]
    np.testing.assert_array_equal(one, _expected_lengths(texts))  # max_length=16 not applied
    np.testing.assert_array_equal(two, one)


@pytest.mark.parametrize("batch_size,multiple", [(1, None), (4, None), (5, 8), (64, None)])
def test_padding_matches_batchstream(batch_size, multiple):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=37)
    perms = L.epoch_permutations(len(lengths), seed=5, epochs=3)
    got = L.padding_fraction(lengths, batch_size, perms, multiple)
    assert got == pytest.approx(_brute_padding(lengths, batch_size, 5, 3, multiple),
                                rel=1e-12, abs=1e-15)
    if batch_size == 1 and multiple is None:
        assert got == 0.0


def test_recommend_rule_and_no_candidate():
    lengths = np.array([10] * 98 + [1000, 1000])  # 1980 of 2980 tokens sit in two examples
    res = L.profile(lengths, batch_size=2, candidates=[16, 512, 1024], max_truncated=0.01)
    assert res["recommended"]["max_length"] == 1024
    assert res["candidates"][1]["tokens_truncated"] == 2 * 488
    res = L.profile(lengths, batch_size=2, candidates=[16, 512], max_truncated=0.01)
    assert res["recommended"]["max_length"] is None
    assert "try larger --candidates" in res["recommended"]["reason"]
    res = L.profile(lengths, batch_size=2, candidates=[16, 512], max_truncated=0.5)
    assert res["recommended"]["max_length"] == 512
    text = L.format_table(res)
    assert "512 *" in text and "recommended max_length: 512" in text


def test_preference_columns():
    import datasets

    ds = datasets.Dataset.from_dict({
        "prompt_input_ids": [[1, 2, 3], [1]],
        "chosen_input_ids": [[4, 5], [4, 5, 6, 7]],
        "rejected_input_ids": [[6, 7, 8, 9], [8]],
        "score": [0.5, 1.0],
    })
    got = L.lengths_of(ds)
    assert got["prompt"].tolist() == [3, 1]
    assert got["chosen"].tolist() == [2, 4] and got["rejected"].tolist() == [4, 1]
    assert got["total"].tolist() == [7, 5]
    res = L.profile(got, batch_size=2, candidates=[4, 8])
    assert set(res["parts"]) == {"prompt", "chosen", "rejected"}
    assert res["stats"]["total_tokens"] == 12


def test_bad_config_exits_2(tmp_path, capsys):
    assert L.main(["data=local", "--out", str(tmp_path)]) == 2
    assert "data.path" in capsys.readouterr().err
    assert L.main(["data=nope", "--out", str(tmp_path)]) == 2


@pytest.mark.pipeline
def test_embedded_default_heavy_tail(tmp_path):
    code = L.main(["--out", str(tmp_path), "--no-plot"])
    assert code == 0
    res = json.loads((tmp_path / "lengths.json").read_text())
    st = res["stats"]
    assert res["data"] == "embedded" and st["count"] == 2000
    assert st["p99"] > 4 * st["p50"]
    rec = res["recommended"]["max_length"]
    assert rec is not None
    rows = {r["max_length"]: r for r in res["candidates"]}
    assert rows[rec]["tokens_truncated_frac"] <= 0.01
    assert all(r["tokens_truncated_frac"] > 0.01 for c, r in rows.items() if c < rec)
    assert not (tmp_path / "lengths.png").exists()
