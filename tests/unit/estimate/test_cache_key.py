"""The estimate's fake-tensor dispatch-cache key (memlab.estimate.cache_key) is torch's key:
on every op of a training step of a small transformers model (forward, backward, a foreach
AdamW step) and on a few shapes the step does not make (channels-last, a view with a storage
offset, kwargs), the fast walk appends exactly what ``FakeTensorMode._prep_args_for_hash``
appends, or both refuse the op (bypass)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache, _CacheKeyState
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from memlab.estimate.cache_key import prep_args_for_hash
from memlab.estimate.modes import estimate_fake_mode


def _walk(fn, mode, args) -> list[object] | str:
    out: list[object] = []
    try:
        fn(mode, out, args, _CacheKeyState(mode.shape_env), [])
    except _BypassDispatchCache as e:
        return f"bypass: {e}"
    return out


class _Compare(TorchDispatchMode):
    """Above the fake mode: both walks of each op's args and kwargs, compared."""

    def __init__(self, mode: FakeTensorMode):
        super().__init__()
        self.mode = mode
        self.ops = 0
        self.mismatches: list[str] = []
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for part in (args, kwargs):
            fast = _walk(prep_args_for_hash, self.mode, part)
            slow = _walk(FakeTensorMode._prep_args_for_hash, self.mode, part)
            if fast != slow:
                self.mismatches.append(f"{func}: {fast!r} != {slow!r}")
        self.ops += 1
        for a in args:
            if isinstance(a, torch.Tensor):
                self.seen.add(f"{a.dim()}d")
                if not a.is_contiguous():
                    self.seen.add("strided view")
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
                self.seen.add("tensor list")
        return func(*args, **kwargs)


def test_the_fast_key_is_torchs_key_on_every_op_of_a_training_step():
    mode = estimate_fake_mode()
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    with mode:
        model = Qwen2ForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        ids = torch.zeros(2, 16, dtype=torch.long)
        compare = _Compare(mode)
        with compare:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.step()  # (the state exists: the steady-state update)
            x = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
            (x + 1).sum(dim=(1, 2), keepdim=True)
            torch.ones(8, dtype=torch.bfloat16)[2:].add(1.5, alpha=2)
            torch.full((3,), 7, dtype=torch.int32, device="cpu")
    assert compare.mismatches == []
    assert compare.ops > 300
    assert {"4d", "strided view", "tensor list"} <= compare.seen
