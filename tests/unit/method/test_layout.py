"""Packed and shared-prompt layouts of preference batches (method/_layout.py, Segments with a
shared prefix), the one-row fit of a pair (bfd), and how shared prompts are counted."""

from __future__ import annotations

import types

import datasets
import pytest

from memlab.data.assets import load_tokenizer
from memlab.data.synthetic import generate_preference
from memlab.method import _layout, _rows
from memlab.method.base import IGNORE, Segments
from memlab.method.dpo import DPO
from memlab.method.kto import KTO
from memlab.method.reward import Reward, common_prefix
from memlab.packing.groups import PACK_ROWS

P, C, R = [11, 12, 13], [21, 22], [31, 32, 33, 34]


def test_shared_prompt_documents_and_fork():
    docs = _layout.unit_docs(P, [C, R], [0, 5], shared=True)
    assert [d.ids for d in docs] == [P + C, R]
    assert docs[0].labels == [IGNORE, IGNORE, 21, 22, IGNORE]  # the prompt's end predicts C[0]
    assert docs[1].labels == [32, 33, 34, IGNORE]
    assert docs[1].first_position == 3 and docs[1].prefix == (-1, 3)
    assert docs[1].fork == (31, 5)  # ... and R[0], scored for sequence 5
    unshared = _layout.unit_docs(P, [C, R], [0, 5], shared=False)
    assert [d.ids for d in unshared] == [P + C, P + R]
    assert all(d.prefix is None and d.fork is None for d in unshared)


def test_rows_to_tensors():
    pair = _layout.unit_docs(P, [C, R], [0, 2], shared=True)
    other = _layout.unit_docs([41], [[51], [61, 62]], [1, 3], shared=True)
    t, stored, total = _layout.collate_rows([pair, other], pad_id=0, multiple=None, flat=False)
    assert t["input_ids"].tolist() == [P + C + R, [41, 51, 61, 62, 0, 0, 0, 0, 0]]
    assert stored == 9 + 4 and total == 18
    # the rejected tokens see the prompt [0, 3), not the chosen tokens; the pad tail is its own
    assert t["segments"] == Segments([(5, (4, 0, 3)), (2, (2, 0, 1), 5)])
    assert t["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6],
                                          [0, 1, 1, 2, 0, 1, 2, 3, 4]]
    assert t["fork_index"].tolist() == [2, 9] and t["fork_labels"].tolist() == [31, 61]
    assert t["fork_segments"].tolist() == [2, 3]
    assert t["segment_ids"][0].tolist() == [-1, -1, 0, 0, -1, 2, 2, 2, -1]
    flat, stored_f, total_f = _layout.collate_rows([pair, other], 0, None, flat=True)
    assert flat["input_ids"].shape == (1, 13) and stored_f == total_f == 13
    assert flat["segments"] == Segments([(5, (4, 0, 3), 2, (2, 9, 10))])
    assert flat["fork_index"].tolist() == [2, 9]


def test_segments_documents_and_their_checks():
    s = Segments([(5, (4, 0, 3), 2)])
    assert s.shares_prefixes() and not Segments([(5, 4)]).shares_prefixes()
    assert s.bounds(0) == [(0, 5), (5, 9), (9, 11)]
    assert s.documents(0) == [(0, 5, None), (5, 9, (0, 3)), (9, 11, None)]
    assert Segments.of(((5, (4, 0, 3), 2),)) == s  # a wrapper's plain copy is restored
    with pytest.raises(ValueError, match="lies before the document"):
        Segments([((4, 0, 3), 5)]).documents(0)


def test_packed_items_unfold_into_units_and_back():
    items = [{"prompt_ids": [[1], [2]], "chosen_ids": [[3], [4]], PACK_ROWS: [[0], [1, 0]]},
             {"prompt_ids": [[5]], "chosen_ids": [[6]], PACK_ROWS: [[0]]}]
    units, rows_of = _layout.units_of(items)
    assert [u["prompt_ids"] for u in units] == [[1], [2], [5]]
    assert rows_of == [[0], [1, 0], [2]]  # the second item's rows follow the first's
    assert _layout.per_item([10, 20, 30], items) == [[10, 20], [30]]
    plain = [{"prompt_ids": [1]}]
    assert _layout.units_of(plain) == (plain, None) and _layout.per_item([7], plain) == [7]


def test_fit_row_cuts_completions_to_a_common_length():
    c, r = list(range(30)), list(range(100, 110))
    # unshared: the prompt counts twice; room 60 - 2*10 = 40 = 30 + 10 -> nothing cut
    assert _rows.fit_row(10, [c, r], 60, shared=False) == ([c, r], 0)
    # room 50 - 20 = 30: k = 20 (20 + 10), the shorter untouched, the longer cut from the right
    (c2, r2), cut = _rows.fit_row(10, [c, r], 50, shared=False)
    assert c2 == c[:20] and r2 == r and cut == 10
    # shared, room 30 - 6 = 24: the largest k with min(30, k) + 10 <= 24 is 14
    (c3, r3), _ = _rows.fit_row(6, [c, r], 30, shared=True)
    assert (len(c3), len(r3)) == (14, 10)
    # no room for one token of each completion: dropped
    assert _rows.fit_row(10, [c, r], 21, shared=False) is None
    assert _rows.fit_row(10, [c, r], 12, shared=True) is not None


@pytest.fixture(scope="module")
def pairs():
    return datasets.Dataset.from_list(generate_preference(12, seed=3, median_tokens=120,
                                                          max_tokens=400))


def _packing(packs: bool, keeps_overflow: bool = False):
    return types.SimpleNamespace(packing=types.SimpleNamespace(packs=packs,
                                                               keeps_overflow=keeps_overflow))


def test_shared_prompt_counts_the_prompt_once_in_data_stats(pairs):
    tok = load_tokenizer()
    plain, s_plain = DPO(max_length=None, max_prompt_length=None).prepare(pairs, tok, None)
    shared, s_shared = DPO(max_length=None, max_prompt_length=None,
                           share_prompt=True).prepare(pairs, tok, None)
    assert plain["prompt_ids"] == shared["prompt_ids"]
    assert s_plain.tokens_in - s_shared.tokens_in == sum(map(len, plain["prompt_ids"]))
    # and the collated batch stores it once: real tokens = prompt + chosen + rejected
    rows = [shared[i] for i in range(4)]
    batch = DPO(share_prompt=True).collate(rows, tok, None)
    assert batch.real_tokens == sum(len(r["prompt_ids"]) + len(r["chosen_ids"])
                                    + len(r["rejected_ids"]) for r in rows)
    assert DPO().collate(rows, tok, None).real_tokens == batch.real_tokens + sum(
        len(r["prompt_ids"]) for r in rows)


def test_bfd_fits_each_pair_to_one_row_and_counts_the_cut(pairs):
    """max_prompt_length=128 leaves room in a 300-token row for every pair (2 * 128 < 300), so
    none is dropped: the fit only shortens completions, and the count says by how much."""
    tok = load_tokenizer()
    for shared in (False, True):
        method = DPO(max_length=300, max_prompt_length=128, share_prompt=shared)
        loose, s_loose = method.prepare(pairs, tok, _packing(True, keeps_overflow=True))
        fitted, s_fit = method.prepare(pairs, tok, _packing(True))
        whole, _ = method.unit_sizes(fitted, None)
        whole_loose, _ = method.unit_sizes(loose, None)
        assert len(fitted) == len(loose) == 12 and max(whole) <= 300 < max(whole_loose)
        assert fitted["prompt_ids"] == loose["prompt_ids"]  # the fit never cuts the prompt
        assert s_fit.tokens_in == s_loose.tokens_in
        assert s_fit.tokens_dropped - s_loose.tokens_dropped == sum(whole_loose) - sum(whole)
        for c, c_loose in zip(fitted["chosen_ids"], loose["chosen_ids"], strict=True):
            assert c == c_loose[: len(c)]  # cut from the right


def test_kto_and_reward_units(pairs):
    tok = load_tokenizer()
    kto, stats = KTO(max_length=None, max_prompt_length=None, share_prompt=True).prepare(
        pairs, tok, None)
    assert len(kto) == 12 and stats.examples == 24
    assert all(len(c) == 2 and lab == [True, False] for c, lab in
               zip(kto["completion_ids"], kto["label"], strict=True))
    batch = KTO(share_prompt=True).collate([kto[i] for i in range(3)], tok, None)
    assert batch.num_items == 6 and batch.tensors["label"].tolist() == [True, False] * 3
    assert batch.tensors["input_ids"].shape[0] == 3 == batch.tensors["kl_input_ids"].shape[0]
    with pytest.raises(Exception, match="unpaired"):
        KTO(share_prompt=True).prepare(datasets.Dataset.from_list(
            [{"prompt": "a", "completion": "b", "label": True}]), tok, None)
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 1  # each keeps at least its last token
    rew, _ = Reward(max_length=None, share_prompt=True).prepare(pairs, tok, None)
    rows = [rew[i] for i in range(3)]
    shared = Reward(share_prompt=True).collate(rows, tok, None)
    plain = Reward().collate(rows, tok, None)
    assert shared.real_tokens == plain.real_tokens - sum(
        common_prefix(r["chosen_ids"], r["rejected_ids"]) for r in rows)
    # the reward is read at the same token as in the padding-free layout (last non-pad)
    flat = Reward(padding_free=True).collate(rows, tok, None).tensors
    expected = flat["input_ids"][0, flat["last_index"]]
    got = shared.tensors["input_ids"].reshape(-1)[shared.tensors["last_index"]]
    assert got.tolist() == expected.tolist()
    positions = shared.tensors["position_ids"].reshape(-1)[shared.tensors["last_index"]]
    assert positions.tolist() == flat["position_ids"][0, flat["last_index"]].tolist()
