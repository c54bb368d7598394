"""Every option composes and validates; registry and conf/ in parity; errors name the fix."""

from __future__ import annotations

import pytest

from memlab import _guards
from memlab.context import resolved_options, validate
from memlab.registry import GROUPS, ConfigErrors, build, options
from memlab_testing import CONF, FAST, SWEEPS, compose

pytestmark = pytest.mark.usefixtures("no_cpu_bf16")

GPU_ONLY = {
    ("attention", "flash_attention_2"), ("attention", "flash_attention_3"),
    ("attention", "kernels"), ("attention", "flex_attention"),
    ("precision", "fp16_mixed"), ("peft", "qlora"), ("offload", "activations"),
    ("optimizer", "paged_adamw_8bit"),
}
NEEDS_INPUT = {("data", "local"): "data.path", ("data", "mixture"): "data.sources"}
NEEDS_PACKAGE = {("generation", "vllm"): "vllm",  # extras outside [dev] (own envs on CPU)
                 ("optimizer", "adamw_8bit"): "bitsandbytes"}


def _plain(cfg):
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True)


def test_registry_matches_conf_files():
    for group in GROUPS:
        yamls = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        assert yamls == options(group), f"conf/{group}/ and the registry disagree"
        for name in yamls:
            text = (CONF / group / f"{name}.yaml").read_text()
            assert f"name: {name}\n" in text, f"conf/{group}/{name}.yaml must say name: {name}"


@pytest.mark.parametrize(
    "group,name", [(g, n) for g in GROUPS for n in sorted(p.stem for p in (CONF / g).glob("*.yaml"))]
)
def test_every_option_composes_and_validates(group, name):
    fast = [o for o in FAST if not o.startswith(f"{group}.")]
    cfg = _plain(compose(fast + [f"{group}={name}"]))
    if (group, name) in NEEDS_INPUT:
        with pytest.raises(ConfigErrors, match=NEEDS_INPUT[group, name]):
            validate(cfg)
        return
    package = NEEDS_PACKAGE.get((group, name))
    if package and not _guards.has(package):
        with pytest.raises(ConfigErrors, match=f"'{package}' package"):
            validate(cfg)
        return
    if (group, name) in GPU_ONLY:
        with pytest.raises(ConfigErrors) as e:
            validate(cfg)
        msg = str(e.value)
        assert name in msg and ("CUDA" in msg or "cuda" in msg or "CPU" in msg), msg
        return
    ctx = validate(cfg)
    chosen = getattr(ctx, group)
    # an option that stands for another where it runs (precision=auto) is recorded as resolved
    assert chosen.name == name or resolved_options(cfg, ctx) == {group: chosen.name}


def test_all_errors_reported_at_once_with_fixes():
    cfg = _plain(compose(FAST + ["+method.bta=0.1", "train.lr=fast", "peft=lora",
                                 "+peft.alpah=8"]))
    with pytest.raises(ConfigErrors) as e:
        validate(cfg)
    errs = e.value.errors
    assert len(errs) == 3, errs
    assert any("unknown key 'bta'" in x for x in errs)
    assert any("train.lr" in x and "number" in x for x in errs)
    assert any("'alpah'" in x and "did you mean 'alpha'" in x for x in errs)


def test_cross_group_rules_collected_together():
    cfg = _plain(compose(FAST + ["attention=flash_attention_2", "precision=fp16_mixed",
                                 "packing=bfd", "method.max_length=null"]))
    with pytest.raises(ConfigErrors) as e:
        validate(cfg)
    text = str(e.value)
    assert "flash_attention_2" in text and "use attention=sdpa" in text
    assert "fp16_mixed" in text
    assert "method.max_length" in text


def test_unknown_option_names_choices():
    _, errs = build("packing", {"name": "bdf"})
    assert errs and "bfd" in errs[0] and "choose one of" in errs[0]


def test_invalid_combination_rejected_before_model_load(job, monkeypatch):
    from memlab.model.tiny import Tiny

    def boom(*a, **k):
        raise AssertionError("model loaded for an invalid config")

    monkeypatch.setattr(Tiny, "load", boom)
    monkeypatch.setattr(Tiny, "load_tokenizer", boom)
    s = job(["attention=flex_attention"])
    assert s["status"] == "invalid"
    assert "attention=sdpa" in s["error"]


def test_experiment_configs_compose_and_validate():
    """The experiments on the embedded model, with the fast test sizes (real-model experiments,
    which switch the model and data: tests/integration/test_experiments.py)."""
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        if "override /model: hf" in path.read_text():
            continue
        cfg = _plain(compose([o for o in FAST if not o.startswith("method.max_length")]
                             + [f"experiment={path.stem}"]))
        ctx = validate(cfg)
        assert ctx.method.name in ("sft", "dpo", "reward", "kto")


@pytest.mark.slow
def test_every_point_of_every_shipped_sweep_validates():
    """The ready sweeps (sweeps/*.yaml, ``memlab -m sweep=<name>``): each point of the
    sweeper's grid, composed with ``sweep=<name>`` (so with the sweep's own settings), passes
    validation as a CUDA run (no model loads; some points are CPU-invalid on purpose, e.g.
    activation offloading in techniques.yaml), so a shipped sweep never fails on a typo."""
    import itertools

    import yaml

    from memlab.estimate import validate_for

    paths = sorted(SWEEPS.glob("*.yaml"))
    assert len(paths) >= 9, paths
    for path in paths:
        params = yaml.safe_load(path.read_text())["hydra"]["sweeper"]["params"]
        grid = [[f"{k}={v}" for v in (str(vals).split(",") if not str(vals).startswith("[")
                                      else [vals])] for k, vals in params.items()]
        for point in itertools.product(*grid):
            overrides = [f"sweep={path.stem}", *point]
            try:
                validate_for(_plain(compose(overrides)), "cuda")
            except Exception as e:  # noqa: BLE001 - name the sweep and the point
                raise AssertionError(f"{path.name}: {overrides}: {e}") from e


def test_the_context_types_every_group_by_its_protocol():
    """BuildContext has one field per registered group, annotated with the group's Protocol (no
    ``Any``), and ``groups()`` gives them in the registry's order."""
    import dataclasses

    from memlab.context import BuildContext

    types = {f.name: f.type for f in dataclasses.fields(BuildContext)}
    assert all(g in types and types[g] not in ("Any", "object") for g in GROUPS), types
    ctx = validate(_plain(compose(FAST)))
    assert list(ctx.groups()) == list(GROUPS)
    assert ctx.groups()["method"] is ctx.method
