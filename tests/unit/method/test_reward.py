"""method=reward pieces: row formats, drop / keep_end truncation counts, margins, transformers'
last-non-pad pooling under right padding, padded vs padding-free rewards, and the loss wiring
against the Bradley-Terry closed form."""

from __future__ import annotations

import math

import datasets
import pytest
import torch

from memlab.data.assets import load_tokenizer
from memlab.data.base import DataError
from memlab.method.base import Batch
from memlab.method.reward import Reward


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def seq_cls(tok):
    from transformers import AutoModelForSequenceClassification

    from memlab.model.tiny import Tiny

    cfg = Tiny(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
               num_kv_heads=1).hf_config(tok)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(cfg, attn_implementation="sdpa").eval()


def _rows(n_words: list[int], margin: bool = False) -> datasets.Dataset:
    rows = []
    for i, n in enumerate(n_words):
        row = {"prompt": "tell me about the tempo", "chosen": "tempo " * n, "rejected": "meh"}
        if margin:
            row["margin"] = float(i)
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def test_sequences_with_and_without_prompt(tok):
    out, stats = Reward().prepare(_rows([2]), tok, None)
    p = tok("tell me about the tempo", add_special_tokens=False)["input_ids"]
    assert out["chosen_ids"][0][: len(p)] == p and out["chosen_ids"][0][-1] == tok.eos_token_id
    assert stats.examples == 1 and "margin" not in out.column_names
    chat = {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]}
    out, _ = Reward().prepare(datasets.Dataset.from_list([chat]), tok, None)
    full = tok.apply_chat_template(chat["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert out["chosen_ids"][0] == list(full)
    with pytest.raises(DataError, match="needs rows with 'chosen' and 'rejected'"):
        Reward().prepare(datasets.Dataset.from_list([{"text": "x"}]), tok, None)


def test_drop_and_keep_end_truncation_counts(tok):
    ds = _rows([2, 60, 3], margin=True)
    full, _ = Reward(max_length=None).prepare(ds, tok, None)
    lens = [(len(c), len(r)) for c, r in zip(full["chosen_ids"], full["rejected_ids"])]
    assert lens[1][0] > 40 > max(lens[0][0], lens[2][0])
    out, stats = Reward(max_length=40).prepare(ds, tok, None)
    assert stats.examples_dropped == 1 and len(out) == 2
    assert stats.tokens_dropped == sum(lens[1]) and stats.tokens_in == sum(map(sum, lens))
    assert out["margin"] == [0.0, 2.0]  # margins follow their pairs
    out, stats = Reward(max_length=40, truncation_mode="keep_end").prepare(ds, tok, None)
    assert stats.examples_dropped == 0 and len(out) == 3
    assert out["chosen_ids"][1] == full["chosen_ids"][1][-40:]
    assert stats.tokens_dropped == lens[1][0] - 40
    out, _ = Reward(use_margin=False).prepare(ds, tok, None)
    assert "margin" not in out.column_names


def test_hf_pools_the_last_non_pad_token_with_right_padding(tok, seq_cls):
    seqs = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32]]
    alone = [seq_cls(input_ids=torch.tensor([s])).logits.item() for s in seqs]
    rows = [{"chosen_ids": seqs[0], "rejected_ids": seqs[1]},
            {"chosen_ids": seqs[2], "rejected_ids": seqs[0]}]
    batch = Reward().collate(rows, tok, None)
    assert batch.tensors["input_ids"][1, -1].item() == tok.pad_token_id  # right padded
    got = Reward().rewards(seq_cls, batch.tensors)
    assert got.tolist() == pytest.approx([alone[0], alone[2], alone[1], alone[0]], rel=1e-5)
    flat = Reward(padding_free=True, pad_to_multiple_of=8).collate(rows, tok, None)
    assert flat.tensors["input_ids"].shape[0] == 1 and "attention_mask" not in flat.tensors
    got_flat = Reward(padding_free=True).rewards(seq_cls, flat.tensors)
    assert got_flat.tolist() == pytest.approx(got.tolist(), rel=1e-5, abs=1e-6)


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_loss_is_the_bradley_terry_sum(monkeypatch):
    r = [1.0, -0.5, 0.2, 0.5]  # chosen 0, chosen 1, rejected 0, rejected 1
    monkeypatch.setattr(Reward, "rewards", lambda self, m, t, attention=None: torch.tensor(r, requires_grad=True))
    t = {"margin": torch.tensor([0.3, 0.0])}
    loss, m = Reward(center_rewards_coefficient=0.1).loss(
        {"policy": None}, Batch(t, num_items=2, real_tokens=1, total_tokens=1), None)
    want = -_logsig(1.0 - 0.2 - 0.3) - _logsig(-0.5 - 0.5) + 0.1 * ((1.2) ** 2 + 0.0 ** 2)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["accuracy"] == 0.5
    assert m["rewards/margins"] == pytest.approx((0.8 - 1.0) / 2)
    assert m["rewards/chosen"] == pytest.approx(0.25) and m["rewards/rejected"] == pytest.approx(0.35)
