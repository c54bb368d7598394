"""memlab's changes to third-party code live in one module, restore themselves, and fail loudly
when their target is missing (an upgrade that renames a function must not turn a patch into a
silent no-op)."""

from __future__ import annotations

import types

import pytest

from memlab.measure import patches


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
            "mask_decisions": (lambda orig, p: orig(p), lambda orig, *a, **k: orig(*a, **k))}
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
