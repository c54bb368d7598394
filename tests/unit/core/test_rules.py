"""Cross-group rules are written once, by the option that owns the capability, and test a
declared capability rather than another group's option name: each mistake gets exactly one
message, naming the options the user chose."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf, open_dict

from memlab.context import validate
from memlab.registry import options
from memlab_testing import FAST, compose, config_errors


def _errors(overrides: list[str]) -> list[str]:
    return config_errors(overrides)


@pytest.mark.parametrize("method", ["grpo", "rloo", "online_dpo", "ppo", "gkd"])
def test_packing_an_online_method_is_one_message_naming_it(method):
    errors = _errors([f"method={method}", "packing=bfd"])
    packing = [e for e in errors if "packing=bfd" in e]
    assert len(packing) == 1, errors
    assert f"method={method}" in packing[0]


@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_preference_methods_pack_whole_sequences_only(method):
    """bfd / bfd_split keep every sequence whole; wrapped cuts them: one message, with the
    reason and the fix."""
    for packing in ("bfd", "bfd_split"):
        assert _errors([f"method={method}", f"packing={packing}"]) == []
    errors = _errors([f"method={method}", "packing=wrapped"])
    assert len(errors) == 1 and "cuts sequences" in errors[0] and f"method={method}" in errors[0]
    assert "packing=bfd" in errors[0]


def test_bfd_split_needs_room_for_a_split_pair_in_a_micro_batch():
    errors = _errors(["method=dpo", "packing=bfd_split", "train.batch_size=1"])
    assert len(errors) == 1 and "train.batch_size >= 2" in errors[0]
    assert _errors(["method=dpo", "packing=bfd", "train.batch_size=1"]) == []
    assert _errors(["method=kto", "packing=bfd_split", "train.batch_size=1"]) == []  # 1 piece


def test_a_second_trained_model_is_refused_by_every_multi_rank_wrapper():
    """PPO's value model: the rule belongs to the distributed options (they wrap the policy
    only) and reads the method's declared ``as_extra_models().trains_extra_models``."""
    for dist in ("ddp", "fsdp2", "deepspeed"):
        errors = _errors(["method=ppo", f"distributed={dist}", "distributed.nproc=2"])
        assert len([e for e in errors if "value model" in e]) == 1, (dist, errors)
    assert _errors(["method=ppo"]) == []


def test_rules_read_capabilities_not_names():
    """A method that declares ``trains_extra_models`` (its ``as_extra_models()``) is refused by
    ddp whatever its name."""
    from memlab.distributed.ddp import DDP

    cfg = compose(FAST + ["distributed=ddp", "distributed.nproc=2"])
    with open_dict(cfg):
        del cfg["hydra"]
    ctx = validate(OmegaConf.to_container(cfg, resolve=True))

    @dataclasses.dataclass
    class Renamed(type(ctx.method)):
        trains_extra_models = True

        def as_extra_models(self):
            return self

    renamed = dataclasses.replace(ctx, method=Renamed())
    assert any("also trains another model" in e for e in DDP(nproc=2).validate(renamed))
    assert not any("also trains another model" in e for e in DDP(nproc=2).validate(ctx))


def test_every_method_declares_every_capability():
    """The capabilities the loop and the rules read are declared by every method (no
    hasattr/getattr discovery), and the registered configs hold configuration only."""
    from memlab.registry import lookup

    for name in options("method"):
        cls = lookup("method", name)
        for attr in ("data_kinds", "head", "items_name", "eval_metrics"):
            assert attr in dir(cls), (name, attr)
        for fn in ("as_generating", "as_group_packed", "as_liger", "as_extra_models",
                   "as_pinnable", "row_layout", "prepare", "collate", "loss", "evaluate",
                   "validate"):
            assert callable(getattr(cls, fn, None)), (name, fn)
        online = cls().as_generating()
        if online is not None:
            assert callable(getattr(online, "rollout", None)) and online.num_iterations >= 1
            assert isinstance(online.supports_sampling_correction, bool)
        liger = cls().as_liger()
        if liger is not None:
            for fn in ("uses_liger", "liger_model_kernels", "reads_head_weight"):
                assert callable(getattr(liger, fn, None)), (name, fn)
        extra = cls().as_extra_models()
        if extra is not None:
            assert isinstance(extra.trains_extra_models, bool), name
            for fn in ("extra_models", "before_training"):
                assert callable(getattr(extra, fn, None)), (name, fn)
        pinnable = cls().as_pinnable()
        if pinnable is not None:
            assert callable(getattr(pinnable, "pinned", None)), name
    for group in ("distributed",):
        for name in options(group):
            cls = lookup(group, name)
            assert "wraps_fake_tensors" in dir(cls), name
            for fn in ("sharding", "on_fake_group", "as_ranks", "as_step_owner", "as_gathered_states",
                       "as_native_states"):
                assert callable(getattr(cls, fn, None)), (name, fn)


def test_option_configs_hold_no_run_time_state():
    """A registered option's instance attributes are exactly its dataclass fields."""
    from memlab.registry import GROUPS, lookup

    for group in GROUPS:
        for name in options(group):
            cls = lookup(group, name)
            obj = cls()
            fields = {f.name for f in dataclasses.fields(cls)}
            assert set(vars(obj)) == fields, (group, name, set(vars(obj)) - fields)
