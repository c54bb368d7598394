"""memlab's changes to third-party code live in one module, restore themselves, and fail loudly
when their target is missing (an upgrade that renames a function must not turn a patch into a
silent no-op)."""

from __future__ import annotations

import types

import pytest

from memlab._guards import has
from memlab.measure import patches

DEEPSPEED = pytest.mark.skipif(not has("deepspeed"), reason="needs the deepspeed extra")


def test_patched_restores_the_original_and_refuses_a_missing_target():
    owner = types.SimpleNamespace(f=lambda: "original")
    with patches.patched(owner, "f", lambda: "patched") as original:
        assert owner.f() == "patched" and original() == "original"
    assert owner.f() == "original"
    with pytest.raises(RuntimeError):  # restored on error too
        with patches.patched(owner, "f", lambda: "patched"):
            raise RuntimeError("boom")
    assert owner.f() == "original"
    with pytest.raises(patches.PatchTargetMissing, match="renamed_away"):
        with patches.patched(owner, "renamed_away", lambda: None):
            pass


def test_a_class_attribute_patch_leaves_no_instance_or_class_residue():
    class Owner:
        def f(self):
            return 1

    with patches.patched(Owner, "f", lambda self: 2):
        assert Owner().f() == 2
    assert Owner().f() == 1 and "f" in vars(Owner)


@pytest.mark.parametrize("name, target", [
    ("recording_multi_grad_hooks",
     ("torch.distributed._tools.mod_tracker", "register_multi_grad_hook")),
    ("stop_at_length", ("transformers.generation.utils", "StopCheck.__call__")),
    ("mask_decisions", ("transformers.masking_utils", "find_packed_sequence_indices")),
    ("mask_decisions", ("transformers.masking_utils", "_ignore_causal_mask_sdpa")),
    *[pytest.param("deepspeed_on_fake_tensors", target, marks=DEEPSPEED) for target in [
        ("deepspeed.runtime.engine", "DeepSpeedEngine.__init__"),
        ("deepspeed.runtime.zero.stage_1_and_2", "is_invalid_grad_norm"),
        ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.has_overflow"),
        ("deepspeed.runtime.zero.stage3", "is_invalid_grad_norm"),
        ("deepspeed.runtime.bf16_optimizer", "is_invalid_grad_norm"),
        ("deepspeed.runtime.fp16.unfused_optimizer", "is_invalid_grad_norm"),
        ("deepspeed.runtime.utils", "CheckOverflow.has_overflow"),
        ("deepspeed.runtime.zero.utils", "get_lst_from_rank0")]],
])
def test_every_patch_target_exists_in_the_installed_versions(name, target):
    """Each patch's target is where memlab expects it; entering the patch checks it too."""
    import importlib

    module, attr = target
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    assert callable(obj)
    args = {"recording_multi_grad_hooks": (), "stop_at_length": (lambda: 1,),
            "mask_decisions": (lambda orig, p: orig(p), lambda orig, *a, **k: orig(*a, **k)),
            "deepspeed_on_fake_tensors": ()}
    with getattr(patches, name)(*args[name]):
        pass


def test_a_renamed_target_fails_the_patch_loudly(monkeypatch):
    """Negative control: if transformers renamed StopCheck.__call__'s class, the estimator's
    patch would raise instead of patching nothing."""
    from transformers.generation import utils as gen_utils

    monkeypatch.delattr(gen_utils, "StopCheck")
    with pytest.raises(patches.PatchTargetMissing, match="StopCheck"):
        with patches.stop_at_length(lambda: 1):
            pass
    monkeypatch.undo()
    from transformers import masking_utils as mu

    monkeypatch.delattr(mu, "_ignore_causal_mask_sdpa")
    with pytest.raises(patches.PatchTargetMissing, match="_ignore_causal_mask_sdpa"):
        with patches.mask_decisions(lambda o, p: o(p), lambda o, *a, **k: o(*a, **k)):
            pass


@DEEPSPEED
def test_deepspeed_patch_answers_as_a_healthy_rank_0_and_restores(monkeypatch):
    """Inside, DeepSpeed's overflow checks answer "finite" and ZeRO-3's cross-rank list check
    answers this rank's own list; outside, DeepSpeed's own functions are back. Negative
    control: an engine whose constructor lost ``dont_change_device`` fails the patch."""
    from deepspeed.runtime import engine, utils
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero import utils as zero_utils

    nan = float("nan")
    assert stage_1_and_2.is_invalid_grad_norm(nan)  # DeepSpeed's own: NaN is an overflow
    with patches.deepspeed_on_fake_tensors() as engines:
        assert not stage_1_and_2.is_invalid_grad_norm(nan)
        assert not utils.CheckOverflow.has_overflow(None, [])
        assert zero_utils.get_lst_from_rank0([3, 1, 2]) == [3, 1, 2]
        assert engines == []
    assert stage_1_and_2.is_invalid_grad_norm(nan)
    assert zero_utils.get_lst_from_rank0.__module__ == "deepspeed.runtime.zero.utils"

    monkeypatch.setattr(engine.DeepSpeedEngine, "__init__", lambda self, model=None: None)
    with pytest.raises(patches.PatchTargetMissing, match="dont_change_device"):
        with patches.deepspeed_on_fake_tensors():
            pass


def test_keeping_puts_back_what_the_block_replaced():
    """vLLM's CPU worker replaces torch.set_num_threads while its engine starts; the trainer's
    torch gets its own back (and a missing target fails loudly)."""
    import torch

    own = torch.set_num_threads
    with patches.keeping_torch_threads():
        torch.set_num_threads = lambda n: None  # what vLLM's worker does
    assert torch.set_num_threads is own
    with pytest.raises(patches.PatchTargetMissing, match="renamed_away"):
        with patches.keeping(types.SimpleNamespace(), "renamed_away"):
            pass


def test_an_override_of_a_renamed_private_method_fails_loudly():
    """memlab's tracker overrides private methods of torch's MemTracker: each must still exist
    there (negative control: an override of a method the base no longer has)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from memlab.measure.memory import tracker_class

    class Base:
        def _hook(self):
            return 1

    class Sub(Base):
        def _hook(self):
            return 2

        def _renamed(self):
            return 3

        def _own_helper(self):
            return 4

    with pytest.raises(patches.PatchTargetMissing, match="_renamed"):
        patches.check_overrides(Base, Sub, own=("_own_helper",))
    patches.check_overrides(Base, Sub, own=("_own_helper", "_renamed"))
    tracker = tracker_class()  # checks its overrides against the installed torch
    assert issubclass(tracker, MemTracker) and "_pre_fw_hook" in vars(tracker)


def test_deepspeed_op_table_patch_marks_the_kernel_unbuildable():
    pytest.importorskip("deepspeed")
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    patches.skip_deepspeed_shm_comm()
    assert deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] is False


def test_liger_instance_patcher_target_exists():
    """GPU extra: Liger's (private) instance patcher is where memlab calls it."""
    liger = pytest.importorskip("liger_kernel.transformers")
    assert callable(patches.check_target(liger, "_apply_liger_kernel_to_instance"))


DOCUMENTED_STATE = {("os", "environ"), ("sys", "argv"), ("sys", "stdout"), ("sys", "stderr"),
                    ("warnings", "showwarning"), ("tempfile", "tempdir")}
"""Process state Python documents as the program's to set: the environment, the arguments,
the console streams (a forked child's own, unbuffered as ``python -u``), the hook that shows
warnings (written above a progress bar), the default dir of temp files (the fork server's
socket dir made under /tmp for a moment: memlab.distributed.starter.socket_dir)."""


@pytest.mark.slow
def test_third_party_code_is_changed_only_here():
    """No module but memlab.measure.patches assigns an attribute of an imported module (or
    what one holds: ``module.attr[key] = ...``) or setattr()s one; the process's documented
    state aside (:data:`DOCUMENTED_STATE`: what Python documents for a program to replace).
    Negative control: such a line is found."""
    import ast
    from pathlib import Path

    src = Path(patches.__file__).resolve().parents[2]

    def offending(code: str) -> list[int]:
        tree = ast.parse(code)
        imported = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}

        def root(e: ast.expr) -> tuple[str | None, str]:
            chain = []
            while isinstance(e, ast.Attribute):
                chain.append(e.attr)
                e = e.value
            return (e.id if isinstance(e, ast.Name) else None), (chain[-1] if chain else "")

        lines = []
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(base, ast.Attribute):
                    name, first = root(base)
                    if name in imported and (name, first) not in DOCUMENTED_STATE:
                        lines.append(node.lineno)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and node.args and \
                    root(node.args[0])[0] in imported:
                lines.append(node.lineno)
        return lines

    assert offending("import torch\ntorch.set_num_threads = print\n") == [2]
    assert offending("import deepspeed.ops\ndeepspeed.ops.__compatible_ops__['x'] = 0\n") == [2]
    assert offending("import os\nos.environ['X'] = '1'\n") == []
    bad = [f"{p.relative_to(src)}:{line}" for p in sorted(src.rglob("*.py"))
           if p != Path(patches.__file__).resolve() for line in offending(p.read_text())]
    assert not bad, "third-party code changed outside memlab.measure.patches:\n  " + \
        "\n  ".join(bad)


def test_forward_replaced_on_one_instance_keeps_the_signature_and_restores():
    """transformers reads the forward's signature (``generate`` passes ``logits_to_keep`` only
    to a forward that takes it): the replacement keeps it; other instances keep theirs."""
    import inspect

    import torch
    from torch import nn

    class Head(nn.Module):
        def forward(self, x, logits_to_keep=0):
            return x + 1

    a, b = Head(), Head()
    calls = []

    def around(original, *args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs) * 10

    with patches.forward_replaced(a, around):
        assert "logits_to_keep" in inspect.signature(a.forward).parameters
        assert a(torch.ones(1), logits_to_keep=1).item() == 20 and b(torch.ones(1)).item() == 2
    assert calls == [{"logits_to_keep": 1}]
    assert a(torch.ones(1)).item() == 2 and "forward" not in vars(a)


def test_no_multi_grad_hook_is_left_on_a_leaf_under_no_grad():
    """The tracker's module hooks under ``no_grad`` (a generate forward whose embedding output is
    made a leaf that requires grad) register nothing that could keep the leaf alive."""
    import torch
    from torch.distributed._tools import mod_tracker

    leaf = torch.ones(2, requires_grad=True)
    with patches.recording_multi_grad_hooks() as handles:
        with torch.no_grad():
            mod_tracker.register_multi_grad_hook([leaf], lambda grads: None)
        assert handles == []
        mod_tracker.register_multi_grad_hook([leaf], lambda grads: None)
        assert len(handles) == 1
    handles[0].remove()
