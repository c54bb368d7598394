"""``memlab fit``'s pruned search against an exhaustive one, on real estimates of the tiny
default as a CUDA run (so that attention backends are searched): the same fitting candidates,
in the same predicted order, with the same estimates; every candidate it did not estimate
shares a twin's estimate, or does not fit, or is dominated by a fitting candidate ranked above
it; every estimate it stopped over the budget does not fit, and needs at least what it had
reached. The exhaustive search's estimate of a candidate the pruned one made is that estimate (an
estimate is a function of the candidate: tests/integration/test_fit.py compares workers'
with serial ones); every other candidate is estimated here."""

import multiprocessing

import pytest

from memlab.cli.fit import fit
from memlab.cli.fit.search import FitOptions, _worker_init, estimate_candidate, rank
from memlab.cli.fit.space import Candidate

pytestmark = pytest.mark.integration

# needs (MiB): no checkpointing 69.3 / 61.3 / 53.8 (4 x 1, 2 x 2, 1 x 4), every 2nd layer
# 59.3 / 56.3 / 51.3, every layer 51.3 each. At 56 MiB (53.3 with the 5% margin): 1 x 4
# without checkpointing does not fit (2 x 2 pruned), every 2nd layer's 1 x 4 fits, every
# layer's 4 x 1 fits (estimated first: every layer's 2 x 2 and 1 x 4 dominated, one micro-batch
# a step), flex shares sdpa's estimates; 4 x 1 without checkpointing is stopped once its tracked
# memory passes 53.3 MiB.
BASE = ["method.max_length=128", "packing=none", "method.loss_impl=chunked", "precision=fp32",
        "method.padding_free=false", "offload=none"]
OPTS = FitOptions(budget_bytes=56 * 2**20, device="cuda", estimate_only=True, jobs=2)


def _estimate(c: Candidate) -> dict:
    return estimate_candidate(BASE, c, OPTS)


def _same(a: dict, b: dict) -> dict:
    return {k: v for k, v in a.items() if k not in ("seconds", "cpu_s")} == {
        k: v for k, v in b.items() if k not in ("seconds", "cpu_s")}


def test_the_pruned_search_finds_what_the_exhaustive_one_finds(tmp_path):
    record = fit(BASE, OPTS, tmp_path, ["--budget", "56MiB", "--device", "cuda",
                                        "--estimate-only", *BASE], tty=False)
    cands = record["candidates"]
    counts = record["search"]["counts"]
    assert counts["shared"] and counts["no_fit"] and counts["dominated"], counts
    assert counts["stopped"], counts
    by = record["search"]["avoided"]["dominated_by"]
    assert by["micro_batch"] == 2, by
    assert counts["estimated"] + counts["stopped"] + counts["shared"] + counts["no_fit"] + counts[
        "dominated"] == len(cands) == 18
    full = [Candidate(c["overrides"], c["label"], c["exact"]) for c in cands]
    for f, c in zip(full, cands, strict=True):
        f.coords = _coords(c["label"])
        if c["estimate"].get("status") == "ok" and c["shared_with"] is None:
            f.estimate = c["estimate"]  # made by the pruned search
    todo = [i for i, f in enumerate(full) if not f.estimate]
    with multiprocessing.get_context("fork").Pool(2, initializer=_worker_init) as pool:
        for i, est in zip(todo, pool.map(_estimate, [full[i] for i in todo]), strict=True):
            full[i].estimate = est
    exhaustive = rank(full)
    pos = {f.label: k for k, f in enumerate(exhaustive)}
    for c, f in zip(cands, full, strict=True):
        if c["estimate"].get("status") == "over_budget":  # stopped (or a stopped one's twin)
            assert not f.estimate["fits"], c["label"]
            assert c["estimate"]["needed_at_least_bytes"] <= f.estimate["needed_bytes"]
        elif c["shared_with"] is not None:  # a twin's estimate is its own
            assert _same(c["estimate"], f.estimate), c["label"]
        elif c["pruned"] and c["pruned"]["reason"] == "no_fit":
            assert not f.estimate["fits"], c["label"]
        elif c["pruned"]:
            by = full[c["pruned"]["by"]]
            assert by.estimate["fits"] and (not f.estimate["fits"] or
                                            pos[by.label] < pos[f.label]), c["label"]
            # the premise: the dominated candidate's step has no fewer FLOPs
            assert f.estimate["flops_per_step"] >= by.estimate["flops_per_step"], c["label"]
    ranked = [c["label"] for c in sorted((c for c in cands if c["predicted_rank"]),
                                         key=lambda c: c["predicted_rank"])]
    kept = {c["label"] for c in cands if not c["pruned"]}
    assert ranked == [f.label for f in exhaustive if f.label in kept]
    assert (tmp_path / "fit.csv").read_text().count("\n") == len(cands) + 1


def _coords(label: str) -> dict[str, int]:
    ck = ("no checkpointing", "checkpoint every 2nd layer", "checkpoint every layer")
    micro = ("4 x 1", "2 x 2", "1 x 4")
    return {"checkpointing": next(i for i, x in enumerate(ck) if label.startswith(x)),
            "micro_batch": next(i for i, x in enumerate(micro) if x in label),
            "attention": int(label.endswith("flex"))}


PF_BASE = ["method.max_length=128", "packing=none", "method.loss_impl=chunked", "precision=fp32",
           "offload=none", "train.gradient_checkpointing=false", "train.batch_size=1",
           "train.grad_accum=4"]


def test_padding_free_rows_dominate_padded_ones(tmp_path):
    """Lever 3 on padding: the padded candidate is not estimated where its padding-free twin of
    the same settings fits; estimated after all, it fits too, with no fewer FLOPs, and ranks
    after it (the speed model puts padding last)."""
    opts = FitOptions(budget_bytes=64 * 2**20, device="cuda", estimate_only=True, jobs=1)
    record = fit(PF_BASE, opts, tmp_path, ["--budget", "64MiB", "--device", "cuda",
                                           "--estimate-only", *PF_BASE], tty=False)
    cands = record["candidates"]
    assert [d["name"] for d in record["space"]] == ["padding_free", "attention"]
    pruned = [c for c in cands if c["pruned"]]
    assert len(pruned) == 2 and all(c["pruned"]["lever"] == "padding_free" and
                                    c["label"].startswith("padded") for c in pruned), pruned
    assert record["search"]["avoided"]["dominated_by"]["padding_free"] == 1
    by = cands[pruned[0]["pruned"]["by"]]
    padded = Candidate(pruned[0]["overrides"], pruned[0]["label"], pruned[0]["exact"])
    padded.estimate = estimate_candidate(PF_BASE, padded, opts)
    free = Candidate(by["overrides"], by["label"], by["exact"])
    free.estimate = by["estimate"]
    assert padded.estimate["flops_per_step"] >= free.estimate["flops_per_step"]
    assert [c.label for c in rank([padded, free])][0] == free.label
