"""Every change memlab makes to third-party code, in one place.

memlab patches no module of its own. Where it must change what a library does, the change is
made here, scoped where it can be (a context manager that restores the original on exit), and
checked: the target must exist as memlab expects it, or :class:`PatchTargetMissing` names it and
the installed version, so an upgrade that renames a function fails loudly instead of silently
turning the patch into a no-op.

- :func:`recording_multi_grad_hooks` (the run's memory tracker): torch's module tracker leaves
  one multi-grad hook per module input behind; memlab records them to remove them (and
  registers none under ``no_grad``, where no backward can fire them).
- :func:`stop_at_length` (``memlab estimate``): transformers' decoding loop stops when every row
  has sampled EOS, a value read; on fake tensors the estimate decodes to a given length instead.
- :func:`mask_decisions` (``memlab estimate``): two value-dependent decisions of transformers'
  mask construction (is this a packed row? is the padding mask all ones?) answered by the
  estimator from the real batch.
- :func:`forward_replaced` (``memlab estimate``): one model instance's ``forward`` goes through
  the estimator first (the shortened decode answers the decode steps it skips).
- :func:`deepspeed_on_fake_tensors` (``memlab estimate distributed=deepspeed``): DeepSpeed's
  engine built and stepped on fake tensors as rank 0 of a fake process group: the engine leaves
  the model where it is, and the three values it reads are answered as on a healthy rank 0.
- :func:`keep_4bit_training_layout` (``peft=qlora`` on CPU): bitsandbytes repacks a 4-bit
  layer's weight into a CPU layout the first time it runs in eval mode without grad (generation,
  a reference pass), after which its training forward loses the gradient of its input; memlab
  keeps the layers in the training layout. Set on the run's layers for the run (no scope).
- :func:`keeping_torch_threads` (``generation=vllm``, colocated): vLLM's CPU worker replaces
  ``torch.set_num_threads`` when its engine starts in the training process; torch's own is put
  back.
- :func:`liger_kernels` (``method.use_liger_kernel``): Liger's instance patcher swaps the
  forward of a loaded model's modules for its fused kernels (that instance only, for good).
- :func:`skip_deepspeed_shm_comm` (``distributed=deepspeed`` on the CPU): DeepSpeed's table of
  buildable ops marks its shared-memory all-reduce kernel unavailable (for good: a process).
- :func:`check_overrides`: memlab's memory tracker subclasses torch's MemTracker and overrides
  private methods of it (:func:`memlab.measure.memory.tracker_class`, and the estimate's
  :func:`memlab.estimate.modes.estimate_tracker`); each must still exist in torch, or the
  override would silently never run.

Not patches, though they touch third-party objects: memlab sets documented attributes of the
objects it owns (a model's ``config``, a tokenizer's ``pad_token``), replaces modules of a model
instance it built (``memlab estimate``'s quantized stand-ins, as PEFT does), marks that stand-in
model as quantized for transformers (``is_loaded_in_4bit``), restores an LR scheduler's state
after resuming (``_last_lr``, which ``load_state_dict`` leaves stale), and hands Hydra a job
result it can pickle (``JobReturn._return_value``, in the isolating launcher's worker).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

_MISSING = object()

GLOBAL_TARGETS: tuple[tuple[str, str], ...] = (
    ("torch.distributed._tools.mod_tracker", "register_multi_grad_hook"),
    ("transformers.generation.utils", "StopCheck.__call__"),
    ("transformers.masking_utils", "find_packed_sequence_indices"),
    ("transformers.masking_utils", "_ignore_causal_mask_sdpa"),
    ("torch", "set_num_threads"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.__init__"),
    ("deepspeed.runtime.zero.stage_1_and_2", "is_invalid_grad_norm"),
    ("deepspeed.runtime.zero.stage3", "is_invalid_grad_norm"),
    ("deepspeed.runtime.bf16_optimizer", "is_invalid_grad_norm"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "is_invalid_grad_norm"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.has_overflow"),
    ("deepspeed.runtime.utils", "CheckOverflow.has_overflow"),
    ("deepspeed.runtime.zero.utils", "get_lst_from_rank0"),
)
"""(module, attribute path) of every module-level or class attribute the scoped patches below
replace for a block and put back: the test suite checks after each test that each is as it
was (tests/conftest.py). The instance patches (a model's forward, a layer's flag) and
:func:`skip_deepspeed_shm_comm` (a DeepSpeed rank's process, for good) are not listed."""


class PatchTargetMissing(RuntimeError):
    """A third-party attribute memlab patches is not where memlab expects it."""


def _version(owner: Any) -> str:
    from importlib.metadata import PackageNotFoundError, version

    root = str(getattr(owner, "__module__", None) or getattr(owner, "__name__", "?")).split(".")[0]
    try:
        return f"{root} {version(root)}"
    except PackageNotFoundError:
        return root


def check_target(owner: Any, name: str) -> Any:
    """The current value of ``owner.name``; :class:`PatchTargetMissing` if there is none."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise PatchTargetMissing(
            f"memlab patches {where}.{name}, which the installed {_version(owner)} does not "
            "have; memlab supports the versions pinned in pyproject.toml (or update "
            "memlab.measure.patches for this one)")
    return value


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Any) -> Iterator[Any]:
    """``owner.name = replacement`` for the block (checked with :func:`check_target`); yields the
    original. Restored on exit, whatever happens inside."""
    original = check_target(owner, name)
    own = vars(owner).get(name, _MISSING)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


class _NoHook:
    """The handle of a hook that was not registered."""

    def remove(self) -> None:
        return None


@contextlib.contextmanager
def recording_multi_grad_hooks() -> Iterator[list]:
    """Every hook torch's ModTracker registers with ``register_multi_grad_hook`` inside the block
    is appended to the yielded list (the caller removes them). Under ``torch.no_grad`` none is
    registered: no backward can reach it, and its closure would keep a leaf input alive until
    the step ends (transformers' ``enable_input_require_grads`` makes each generate forward's
    embedding output one: one hidden state per decode step, held through the training step)."""
    import torch
    from torch.distributed._tools import mod_tracker

    handles: list = []
    real = check_target(mod_tracker, "register_multi_grad_hook")

    def recording(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return _NoHook()
        handle = real(*args, **kwargs)
        handles.append(handle)
        return handle

    with patched(mod_tracker, "register_multi_grad_hook", recording):
        yield handles


@contextlib.contextmanager
def stop_at_length(stop_at: Callable[[], int]) -> Iterator[None]:
    """transformers' decoding loop stops once the sequences reach ``stop_at()`` tokens, instead of
    reading whether every row has finished."""
    from transformers.generation import utils as gen_utils

    def stop(self, unfinished_sequences, tokens, length):
        return length >= stop_at()

    with patched(check_target(gen_utils, "StopCheck"), "__call__", stop):
        yield


@contextlib.contextmanager
def mask_decisions(find_packed: Callable[[Callable, Any], Any],
                   ignore_causal: Callable[..., bool]) -> Iterator[None]:
    """transformers' ``find_packed_sequence_indices(position_ids)`` becomes
    ``find_packed(original, position_ids)`` and ``_ignore_causal_mask_sdpa(padding_mask, ...)``
    becomes ``ignore_causal(original, padding_mask, ...)``."""
    from transformers import masking_utils as mu

    orig_find = check_target(mu, "find_packed_sequence_indices")
    orig_skip = check_target(mu, "_ignore_causal_mask_sdpa")
    with patched(mu, "find_packed_sequence_indices",
                 lambda position_ids: find_packed(orig_find, position_ids)), \
            patched(mu, "_ignore_causal_mask_sdpa",
                    lambda *a, **k: ignore_causal(orig_skip, *a, **k)):
        yield


@contextlib.contextmanager
def deepspeed_on_fake_tensors() -> Iterator[list[Any]]:
    """DeepSpeed's engine on fake weights, as rank 0 of torch's fake process group; yields the
    engines built inside (their ``skipped_steps`` tell whether a step was lost anyway).

    - The engine is built inside the fake mode of the weights it is given, so what it allocates
      itself (flat buffers, ZeRO-3's partitions) is fake like them (built outside, ZeRO-3
      copies fake weights into real partitions, which the fake mode refuses), and with
      ``dont_change_device=True`` (a constructor argument that ``deepspeed.initialize`` does
      not pass): its ``module.to(device)`` would have ``nn.Module._apply`` swap every
      parameter, which a fake tensor refuses ("Cannot swap t1 because it has weakref
      associated with it"); the weights are on their device already.
    - The overflow checks answer "finite": ``is_invalid_grad_norm`` (ZeRO 1-2, ZeRO-3, the bf16
      optimizer, the unfused optimizer of bf16 ZeRO-0), ZeRO 1-2's ``has_overflow`` (bf16) and
      ``CheckOverflow.has_overflow`` (the unfused optimizer) return False, so the optimizer step
      is applied as on a healthy run (on fake values the norm reads NaN and the overflow flags
      are integer reads: the engine would skip the step).
    - ``get_lst_from_rank0`` (ZeRO-3's checks that every rank recorded the same module and
      parameter order) answers this rank's own list: this process *is* rank 0, and the fake
      group's broadcast moves no values to read back.
    """
    from deepspeed.runtime import bf16_optimizer, engine
    from deepspeed.runtime import utils as runtime_utils
    from deepspeed.runtime.fp16 import unfused_optimizer
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    from deepspeed.runtime.zero import utils as zero_utils

    init = check_target(engine.DeepSpeedEngine, "__init__")
    if "dont_change_device" not in inspect.signature(init).parameters:
        raise PatchTargetMissing(
            "memlab builds DeepSpeedEngine with dont_change_device=True, a parameter the "
            f"installed {_version(engine)} does not have; memlab supports the versions pinned "
            "in pyproject.toml (or update memlab.measure.patches for this one)")
    engines: list[Any] = []

    def build_in_place(self, *args: Any, **kwargs: Any) -> None:
        from torch._subclasses.fake_tensor import maybe_get_fake_mode

        weights = kwargs["model"].parameters()  # deepspeed.initialize passes it by name
        mode = next((m for p in weights if (m := maybe_get_fake_mode(p)) is not None), None)
        with mode if mode is not None else contextlib.nullcontext():
            init(self, *args, **{**kwargs, "dont_change_device": True})
        engines.append(self)

    def finite(*args: Any, **kwargs: Any) -> bool:
        return False

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(engine.DeepSpeedEngine, "__init__", build_in_place))
        for module in (stage_1_and_2, stage3, bf16_optimizer, unfused_optimizer):
            stack.enter_context(patched(module, "is_invalid_grad_norm", finite))
        for owner in (stage_1_and_2.DeepSpeedZeroOptimizer, runtime_utils.CheckOverflow):
            stack.enter_context(patched(owner, "has_overflow", finite))
        stack.enter_context(patched(zero_utils, "get_lst_from_rank0", lambda lst: list(lst)))
        yield engines


def keep_4bit_training_layout(model: Any) -> int:
    """Turn off bitsandbytes' CPU weight repacking on every 4-bit layer of ``model``; returns
    how many layers. ``Linear4bit`` repacks its weight for a fused AVX512-BF16 kernel on an
    eval, no-grad forward on CPU (``support_avx512bf16_for_cpu``), and from then on every
    forward takes that kernel (``gemv_4bit``), which has no autograd: the gradient of the
    layer's input is lost (measured with bitsandbytes 0.50.2: ``x.grad`` None after a repack).
    Off, the layer dequantizes for each matmul, as on CUDA. A model built without
    bitsandbytes ever imported (an estimate's stand-ins) has no such layer."""
    import sys

    if "bitsandbytes" not in sys.modules:
        return 0
    from bitsandbytes.nn import Linear4bit

    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    for layer in layers:
        check_target(layer, "support_avx512bf16_for_cpu")
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


@contextlib.contextmanager
def keeping(owner: Any, name: str) -> Iterator[Any]:
    """``owner.name`` as it is now, put back when the block ends (checked with
    :func:`check_target`), for code in the block that replaces it; yields it."""
    original = check_target(owner, name)
    try:
        yield original
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def keeping_torch_threads() -> Iterator[None]:
    """``torch.set_num_threads`` back as it was when the block ends: vLLM's CPU worker replaces
    it while its engine starts in this process (its own thread binding must not be undone), and
    the trainer's torch keeps its own."""
    import torch

    with keeping(torch, "set_num_threads"):
        yield


def liger_kernels(model: Any, kernels: Mapping[str, bool]) -> Any:
    """Liger's kernels on a loaded transformers model, in place (returns it): Liger's instance
    patcher (``_apply_liger_kernel_to_instance``, private in Liger) swaps the forward of the
    model's modules named in ``kernels`` (rope, rms_norm, swiglu...: ``{name: on}``) for its
    Triton kernels; Liger's own loss patches stay off (the methods compute their loss
    themselves). It changes this instance only (never a class), for the life of the run: the
    model is the run's own."""
    from liger_kernel import transformers as liger

    apply = check_target(liger, "_apply_liger_kernel_to_instance")
    apply(model=model, fused_linear_cross_entropy=False, cross_entropy=False, **kernels)
    return model


def skip_deepspeed_shm_comm() -> None:
    """Keep DeepSpeed from building its CPU shared-memory all-reduce kernel.

    DeepSpeed's comm layer compiles that kernel (a JIT C++ build, about a minute on 2 cores) the
    first time it starts on the CPU, every rank waiting on torch's extension lock. Only its
    inference all-reduce uses the kernel; training goes through the gloo process group. A build
    that is stopped half-way (a rank killed by the launcher, a CI timeout) leaves the lock file
    behind, and every later DeepSpeed run then waits on it forever. DeepSpeed reads which ops it
    may build from ``deepspeed.ops.__compatible_ops__`` (one dict, kept once probed); marking
    the kernel unavailable there is DeepSpeed's own fallback for machines that cannot build it.
    For the life of the process (a DeepSpeed rank)."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ops = check_target(deepspeed.ops, "__compatible_ops__")
    if ShareMemCommBuilder.NAME not in ops:
        raise PatchTargetMissing(f"deepspeed {deepspeed.__version__} no longer lists "
                                 f"{ShareMemCommBuilder.NAME!r} among its ops; memlab's CPU "
                                 "setup needs updating (memlab.measure.patches)")
    ops[ShareMemCommBuilder.NAME] = False


def check_overrides(base: type, cls: type, own: tuple[str, ...] = ()) -> None:
    """Every private method ``cls`` (a subclass of the third-party ``base``) defines, but those
    named in ``own`` (its new ones), must exist on ``base``: an override of a method the
    installed version renamed would silently never be called."""
    for name, value in vars(cls).items():
        if name.startswith("_") and not name.startswith("__") and callable(value) \
                and name not in own:
            check_target(base, name)


@contextlib.contextmanager
def forward_replaced(module: Any, replacement: Callable[..., Any]) -> Iterator[None]:
    """``module.forward(*args, **kwargs)`` becomes ``replacement(original, *args, **kwargs)``
    for the block, on this instance only (its class and every other instance keep theirs). The
    replacement keeps the original's signature: transformers reads it (``generate`` passes
    ``logits_to_keep`` only to a forward that takes it)."""
    original = check_target(module, "forward")

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return replacement(original, *args, **kwargs)

    with patched(module, "forward", forward):
        yield
