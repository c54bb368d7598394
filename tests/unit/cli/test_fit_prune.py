"""memlab fit's pruning bookkeeping (memlab.cli.fit.prune) on made-up estimates: what waits for
what, what is pruned and why, twins; and the precision option equal to the configuration. The
same levers against real estimates: tests/integration/test_fit_prune.py."""

from memlab.cli.fit.prune import Plan, estimated_alike
from memlab.cli.fit.search import rank
from memlab.cli.fit.space import candidates, dimensions

CFG = {"method": {"name": "sft"}, "train": {"batch_size": 4, "grad_accum": 1,
                                            "max_grad_norm": 1.0}}
CHOICES = {"packing": "none", "attention": "sdpa", "offload": "none"}
BUDGET = 170
FIXED = {"method.padding_free", "method.loss_impl", "packing"}


def _space(device="cuda", **kw):
    dims, notes = dimensions(CFG, device, fixed=FIXED, **kw)
    return dims, notes, candidates(dims, CFG, CHOICES)


def _need(c) -> int:
    """Made up: checkpointing and offloading save, rows cost; 1 x 4 costs more than 2 x 2
    would suggest (no pruning across one micro-batch a step may rely on monotony there)."""
    rows = next(int(o.split("=")[1]) for o in c.overrides if o.startswith("train.batch_size"))
    return 100 * rows + 80 - 30 * c.coords["checkpointing"] - 10 * c.coords["offload"]


def _made_up_with(need_of):
    """A made-up estimate from ``need_of(candidate)``; its predicted seconds grow with
    checkpointing and offloading only (the FLOPs of a step: the same whatever the split or the
    padding)."""
    def estimate_of(i, c, budget):
        need = need_of(c)
        return {"status": "ok", "needed_bytes": need, "fits": need <= budget,
                "predicted_s": 1.0 + 0.2 * c.coords["checkpointing"]
                + 0.1 * c.coords["offload"]}
    return estimate_of


_made_up = _made_up_with(_need)


def _search(plan, budget, estimate_of=_made_up):
    """Fit's search order over ``plan``: each ready candidate pruned or given
    ``estimate_of(i, candidate, budget)``; the indices estimated."""
    made = []
    pending = list(plan.reps)
    while pending:
        i = next(i for i in pending if plan.ready(i))
        pending.remove(i)
        why = plan.pruned(i)
        if why:
            plan.settle(i, pruned=why)
            continue
        plan.settle(i, estimate=estimate_of(i, plan.cands[i], budget))
        made.append(i)
    return made


def _assert_ranks_as_exhaustive(cands, dims, cfg, budget, estimate_of) -> list[str]:
    """``cands`` (searched with pruning) rank as estimating every candidate does, each pruned
    one not fitting in that exhaustive search or ranked there after the fitting one that pruned
    it; returns the lever of each dominated one."""
    every = candidates(dims, cfg, CHOICES)
    for k, c in enumerate(every):
        c.estimate = estimate_of(k, c, budget)
    full = rank(every)
    kept = {c.label for c in cands if not c.pruned}
    assert [c.label for c in rank(cands)] == [c.label for c in full if c.label in kept]
    pos = {c.label: k for k, c in enumerate(full)}
    levers = []
    for c, e in zip(cands, every, strict=True):
        if c.pruned and c.pruned["reason"] == "no_fit":
            assert not e.estimate["fits"], c.label
        elif c.pruned:
            by = cands[c.pruned["by"]]
            assert by.estimate["fits"] and every[c.pruned["by"]].estimate["fits"] and (
                not e.estimate["fits"] or pos[by.label] < pos[c.label]), c.label
            if c.pruned["reason"] == "dominated":
                levers.append(c.pruned["lever"])
    return levers


def test_twins_share_an_estimate_and_the_pruned_are_not_fitting_or_dominated():
    dims, _, cands = _space()
    assert [d.name for d in dims] == ["checkpointing", "micro_batch", "offload", "attention"]
    plan = Plan(cands, dims, "cuda")
    assert len(plan.reps) == len(cands) // 2  # flex is estimated as sdpa on a CUDA target
    made = _search(plan, budget=BUDGET)
    counts = plan.counts()
    assert counts["shared"] == len(made) and counts["left"] == 0
    assert counts["no_fit"] and counts["dominated"]
    # the same candidates as estimating every one, each pruned one not fitting or dominated
    _assert_ranks_as_exhaustive(cands, dims, CFG, BUDGET, _made_up)
    # one micro-batch a step (4 x 1) is never pruned by a smaller one not fitting
    assert not any(c.pruned and c.pruned["reason"] == "no_fit" and "4 x 1" in c.label
                   for c in cands)


def test_a_candidate_waits_for_what_could_prune_it_and_exhaustive_estimates_all():
    dims, _, cands = _space()
    plan = Plan(cands, dims, "cuda")
    first = plan.reps[0]  # one micro-batch a step first: it may dominate those that accumulate
    assert plan.ready(first) and "no checkpointing, 4 x 1" in cands[first].label
    assert not all(plan.ready(i) for i in plan.reps)
    every = Plan(cands, dims, "cuda", prune=False)
    assert len(every.reps) == len(cands) and all(every.ready(i) for i in every.reps)


PF_CFG = {"method": {"name": "sft", "padding_free": False},
          "train": {"batch_size": 4, "grad_accum": 1, "max_grad_norm": 1.0}}


def _pf_need(c) -> int:
    """Made up: rows cost, checkpointing and offloading save, padding-free saves a little."""
    rows = next(int(o.split("=")[1]) for o in c.overrides if o.startswith("train.batch_size"))
    return (40 * rows + 80 - 30 * c.coords["checkpointing"] - 10 * c.coords["offload"]
            - 5 * c.coords["padding_free"])


_pf_estimate = _made_up_with(_pf_need)


def test_one_micro_batch_a_step_and_padding_free_rows_dominate():
    """Lever 3's other two keys: a fitting candidate with one micro-batch a step dominates the
    same settings accumulating, a padding-free one the same settings padded (the speed model
    ranks them first at equal FLOPs); at every budget the pruned search ranks what estimating
    every candidate ranks, each pruned one not fitting or ranked after the one that pruned it."""
    fixed = {"method.loss_impl", "packing"}
    dims, _ = dimensions(PF_CFG, "cuda", fixed=fixed)
    assert [d.name for d in dims] == ["checkpointing", "micro_batch", "padding_free",
                                      "offload", "attention"]
    levers: dict[str, int] = {}
    for budget in (120, 150, 175, 200, 230, 260):
        cands = candidates(dims, PF_CFG, CHOICES)
        plan = Plan(cands, dims, "cuda")
        _search(plan, budget, _pf_estimate)
        for lever in _assert_ranks_as_exhaustive(cands, dims, PF_CFG, budget, _pf_estimate):
            levers[lever] = levers.get(lever, 0) + 1
    assert levers.get("micro_batch") and levers.get("padding_free") and levers.get(
        "checkpointing"), levers
    # two accumulating splits are not compared this way (lever 2 runs the other way), nor
    # does an offloading candidate dominate
    plan = Plan(candidates(dims, PF_CFG, CHOICES), dims, "cuda")
    by_label = {c.label: i for i, c in enumerate(plan.cands)}
    two = by_label["no checkpointing, 2 x 2 accumulated, padding-free, no offload, sdpa"]
    one = by_label["no checkpointing, 1 x 4 accumulated, padding-free, no offload, sdpa"]
    off = by_label["no checkpointing, 4 x 1 accumulated, padding-free, activations offloaded, "
                   "sdpa"]
    pad = by_label["no checkpointing, 4 x 1 accumulated, padded, no offload, sdpa"]
    free = by_label["no checkpointing, 4 x 1 accumulated, padding-free, no offload, sdpa"]
    assert not plan._dominates(two, one) and not plan._dominates(one, two)
    assert not plan._dominates(off, one) and not plan._dominates(pad, one)
    assert plan._dominates(free, one) and plan._dominates(free, pad)
    assert plan.dominance(free, one) == "micro_batch" and plan.dominance(free, pad) == \
        "padding_free"
    # a configuration that offloads and does not search it: nothing dominates
    plan = Plan(candidates(dims, PF_CFG, CHOICES), dims, "cuda", offload_configured=True)
    assert not plan._dominates(free, one) and not plan._dominates(free, pad)


def test_backends_the_estimate_runs_alike():
    assert estimated_alike("flex_attention") and estimated_alike("sdpa")
    assert not estimated_alike("eager")  # trains on the CPU: estimated as itself
    assert not estimated_alike("flash_attention_2")  # bf16 / fp16 only, and a package


def test_the_precision_option_equal_to_the_configuration_is_not_searched():
    dims, notes, _ = _space(allow=["precision"], precision="bf16_mixed")
    assert "precision" not in [d.name for d in dims]
    assert any(n.startswith("precision: not searched") for n in notes)
    dims, _, _ = _space(allow=["precision"], precision="fp32")
    assert "precision" in [d.name for d in dims]


def test_the_progress_line_has_counts_an_eta_and_the_best_so_far():
    import io

    from memlab.cli.fit.progress import Progress, duration
    from memlab.cli.fit.search import rank_key

    dims, _, cands = _space()
    plan = Plan(cands, dims, "cuda")
    now = [0.0]
    out = io.StringIO()
    bar = Progress(2, best=lambda cs: min((c for c in cs if c.estimate.get("fits")),
                                          key=rank_key, default=None),
                   stream=out, tty=False, every_s=10.0, clock=lambda: now[0])
    for k, i in enumerate(plan.reps[:3]):
        now[0] += 4.0
        plan.settle(i, estimate={"status": "ok", "needed_bytes": 2**30 * (k + 1), "fits": True,
                                 "predicted_s": 1.5 - 0.25 * k, "seconds": 4.0})
        bar.estimated(plan, i)
    text = bar.text(plan, 10**6)
    left = len(plan.reps) - 3
    assert f"3/{len(plan.reps)} settled: 3 estimated, 0 pruned, 3 shared" in text
    # the first estimate warms the process up: not timed; 3 of 3 settled were estimated
    assert f"ETA ~{duration(left * 4.0 / 2)} (<= {duration(left * 4.0 / 2)})" in text
    assert f"best: {cands[plan.reps[2]].label} (3.00 GiB, 1 s/step)" in text
    now[0] += 10.0
    bar.tick(plan)  # in a log: the bar's text every 10 s
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"[fit] estimate 1/{len(plan.reps)} #{plan.reps[0]} ")
    assert "(also #" in lines[0] and sum(x.startswith("[fit] [") for x in lines) == 2
    assert duration(75) == "1m15s" and duration(3725) == "1h02m"


def test_parameters_too_large_for_the_budget_rule_out_every_candidate_of_the_same_weights():
    dims, _, cands = _space(allow=["peft"], precision="fp32")
    assert "peft" in [d.name for d in dims]
    plan = Plan(cands, dims, "cuda", fits_below=BUDGET, params_bound=True)
    full = {i for i, c in enumerate(cands) if "full fine-tuning" in c.label}

    def estimate_of(i, c, budget):
        params = 180 if i in full else 20  # full fine-tuning's weights alone: over the budget
        need = _need(c) + params
        return {"status": "ok", "needed_bytes": need, "peak_bytes": need,
                "by_category": {"parameters": params}, "fits": need <= budget, "predicted_s": 1.0}

    made = _search(plan, BUDGET, estimate_of)
    assert len([i for i in made if i in full]) == 1  # the first says what the weights need
    ruled = [c for c in cands if c.pruned and c.pruned["reason"] == "parameters"]
    assert ruled and all("full fine-tuning" in c.label for c in ruled)
    assert all(c.pruned["at_least_bytes"] == 180 for c in ruled)
    assert plan.counts()["parameters"] == len(ruled)
    # sharded weights (or --exhaustive) are never ruled out by another candidate's parameters
    plan = Plan(cands, dims, "cuda", fits_below=BUDGET, params_bound=False)
    first = next(i for i in plan.reps if i in full)
    plan.settle(first, estimate={"status": "ok", "needed_bytes": 200, "peak_bytes": 200,
                                 "by_category": {"parameters": 180}, "fits": False})
    assert not any((plan.pruned(i) or {}).get("reason") == "parameters"
                   for i in plan.reps if i in full and i != first)
