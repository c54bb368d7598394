"""`distributed=deepspeed`: DeepSpeed ZeRO stages 0-3 over N processes on this machine (started
like ``ddp`` by ``memlab.distributed.launch``, or by torchrun / the ``deepspeed`` launcher across
nodes). Needs the ``deepspeed`` extra (``pip install 'memlab[deepspeed]'``).

What each stage shards over the N ranks, per rank (Psi = parameter count, trainable):

- stage 0: nothing (data parallel like DDP: full parameters, gradients, optimizer state);
- stage 1: the optimizer state - Adam's two moments *and* a master copy of the rank's slice of
  the weights (DeepSpeed keeps one even for fp32 weights), 1/N each;
- stage 2: + the gradients (reduce-scattered into each rank's slice as backward produces them);
- stage 3: + the parameters: each rank keeps 1/N of every weight, and a layer's full weights are
  all-gathered just before its forward (and again before its backward), then freed.

memlab keeps its own loop, optimizer and schedule: the engine is built with memlab's optimizer
(the ``optimizer`` group with ``train.lr`` / ``weight_decay``) and memlab's LR schedule drives
it. From stage 1 on (and in DeepSpeed's bf16 mode) the optimizer steps ZeRO's flat fp32
partitions, 1-D slices of all the parameters at once: AdamW and 8-bit AdamW step them (8-bit
blocks then run across parameter boundaries; no embedding is apart, so
``embedding_states_32bit`` is refused), Adafactor cannot (it factors 2-D weights; refused);
``optimizer.in_backward`` is refused (the engine owns the step). memlab estimate measures each
option's state on the fake partitions, as it measures AdamW's;
the loss is normalised over the whole step exactly as under DDP (so N ranks x B == 1 x N*B),
gradient accumulation uses the engine's boundary (``set_gradient_accumulation_boundary``) and
gradient clipping is DeepSpeed's (``train.max_grad_norm`` -> ``gradient_clipping``).

Precision: ``fp32`` and ``bf16_mixed`` run an fp32 engine (autocast is memlab's); ``bf16`` turns
on DeepSpeed's bf16 mode, which - unlike memlab's single-process ``bf16`` - keeps fp32 master
weights and fp32 optimizer state in the (sharded) optimizer. ``fp16_mixed`` is not wired to
DeepSpeed's loss scaler and is rejected.

Generation (online methods) under ZeRO-3: with ``gather_for_generation: true`` (the default, TRL's
``ds3_gather_for_generation``) the full weights are gathered once for the whole ``generate``
call - fast, but every rank then briefly holds all parameters; with ``false`` each layer is
gathered on every decoding step - slow, but the peak stays that of one layer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, ClassVar, Literal, cast

import torch
from torch import nn

from memlab.distributed.base import (
    NativeStates,
    OptimizerTensors,
    Ranks,
    Sharding,
    StepOwner,
    env_rank,
    register,
)
from memlab.measure import patches
from memlab.registry import NonNegativeInt, PositiveInt, Range
from memlab.trainer.routing import Routed, base_model, unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext


def _merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in, nested dicts key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


_SET_HERE: set[str] = set()
"""The rank variables :func:`_rank_env` set in this process (the process's environment is what
they live in): :meth:`DeepSpeed.teardown` removes them, so a one-rank run inside a longer-lived
process (an in-process sweep, a notebook, a test) leaves no RANK behind for what runs next."""


def _rank_env(rank: int, local: int, world: int) -> None:
    """The variables DeepSpeed reads (its own launcher and torchrun set them; memlab's launcher
    passes ranks under its own names)."""
    for key, value in (("RANK", rank), ("LOCAL_RANK", local), ("WORLD_SIZE", world)):
        if key not in os.environ:
            os.environ[key] = str(value)
            _SET_HERE.add(key)


class _HashingEngine:
    """DeepSpeed's checkpoint engine (``engine.checkpoint_engine``: DeepSpeed's hook for how its
    checkpoint files are written), for one ``save_checkpoint``: with the default
    ``TorchCheckpointEngine``, ``save`` writes ``torch.save``'s bytes through a
    :class:`~memlab.trainer.safetensors_writer.HashingFile` and records their sha256 in
    ``hashes`` (by path relative to ``root``); everything else is the engine's own. Another
    engine (one the DeepSpeed config chose) writes its own way, and the checkpoint hashes its
    files after they are written (:func:`memlab.trainer.integrity.file_hashes`). DeepSpeed's
    ``latest`` and ``zero_to_fp32.py``, written without the engine, are hashed there too."""

    def __init__(self, inner: Any, root: Path, hashes: dict[str, str]):
        self._inner, self._root, self._hashes = inner, root, hashes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        from memlab.trainer.safetensors_writer import HashingFile

        if type(self._inner) is not TorchCheckpointEngine:
            self._inner.save(state_dict, path)
            return
        with HashingFile(path) as f:  # (a file-like object: torch.save writes through write)
            torch.save(state_dict, cast(IO[bytes], f),
                       _use_new_zipfile_serialization=self._inner.zipfile_serialization)
        self._hashes[Path(os.path.relpath(path, self._root)).as_posix()] = f.hexdigest()


def _engine(model: nn.Module):
    """The DeepSpeed engine around ``model`` (the wrapped policy)."""
    from deepspeed import DeepSpeedEngine

    if not isinstance(model, DeepSpeedEngine):
        raise TypeError(f"expected the DeepSpeed engine, got {type(model).__name__}")
    return model


@register("deepspeed")
@dataclass(kw_only=True)
class DeepSpeed(Ranks):
    """ZeRO data parallelism through a DeepSpeed engine."""

    wraps_fake_tensors: ClassVar[bool] = True

    zero_stage: Annotated[int, Range(ge=0, le=3)] = 2
    """0: replicate everything; 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """ZeRO-Offload: optimizer state and the optimizer step on the host (CUDA runs, stage >= 1)."""
    offload_param: Literal["none", "cpu"] = "none"
    """ZeRO-Infinity: the parameter shards live on the host (CUDA runs, stage 3)."""
    gather_for_generation: bool = True
    """ZeRO-3 and online methods: gather the full weights once for a ``generate`` call."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (more bucket memory in flight)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_bucket_size: PositiveInt | None = None
    """Elements reduced at a time. With ``contiguous_gradients`` DeepSpeed allocates a buffer of
    this many gradient elements up front (its own default, 5e8, is 2 GB in fp32 whatever the
    model). None: hidden_size^2, like the Hugging Face integration's "auto"."""
    allgather_bucket_size: PositiveInt | None = None
    """Elements all-gathered at a time after the step (stages 1-2). None: hidden_size^2."""
    stage3_prefetch_bucket_size: NonNegativeInt | None = None
    """Elements of upcoming layers gathered ahead (stage 3). None: 0.9 x hidden_size^2."""
    stage3_param_persistence_threshold: NonNegativeInt | None = None
    """Parameters smaller than this stay gathered on every rank (stage 3: norms, biases).
    None: 10 x hidden_size."""
    stage3_max_live_parameters: PositiveInt = 1_000_000_000
    """Most gathered elements alive at once (stage 3). Measured here: a model below it stays
    gathered through forward and backward (the shards *plus* the whole weights at the peak);
    ``memlab estimate`` models the gathered bytes as min(all weights, max(two units, this))."""
    stage3_max_reuse_distance: NonNegativeInt = 1_000_000_000
    """A gathered parameter used again within this many gathered elements is not released
    (stage 3). Lowering it did not lower the measured CPU peak of a 29M-weight model."""
    config: dict[str, Any] = field(default_factory=dict)
    """Merged over the generated DeepSpeed config (any other DeepSpeed key)."""

    # ---------------------------------------------------------------- checks
    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if (err := ctx.platform.missing("deepspeed", "distributed=deepspeed")) is not None:
            errors.append(err)
        if self.zero_stage not in (0, 1, 2, 3):
            errors.append(f"distributed.zero_stage must be 0, 1, 2 or 3 (got {self.zero_stage})")
        if self.offload_optimizer != "none" and not ctx.is_cuda:
            errors.append("distributed.offload_optimizer=cpu moves optimizer state off a GPU; "
                          "this run is on cpu, where it is already there: set "
                          "distributed.offload_optimizer=none")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            errors.append("distributed.offload_optimizer needs distributed.zero_stage>=1")
        if self.offload_param != "none" and (self.zero_stage != 3 or not ctx.is_cuda):
            errors.append("distributed.offload_param=cpu needs distributed.zero_stage=3 on a "
                          "CUDA run; set distributed.offload_param=none")
        if ctx.precision.needs_scaler:
            errors.append(f"distributed=deepspeed with precision={ctx.precision.name} is not "
                          "supported (memlab's GradScaler and DeepSpeed's loss scaler would both "
                          "scale); use precision=bf16_mixed or precision=bf16")
        liger = ctx.method.as_liger()
        if liger is not None and liger.uses_liger() and self.zero_stage == 3:
            errors.append("distributed=deepspeed zero_stage=3 with method.use_liger_kernel=true "
                          "is not supported (Liger reads the partitioned output head); use "
                          "method.loss_impl=chunked or zero_stage<=2")
        return errors

    # ---------------------------------------------------------------- the engine
    def ds_config(self, ctx: BuildContext, hidden_size: int) -> dict[str, Any]:
        """The DeepSpeed config this option generates (then ``config`` merged over it); bucket
        sizes left at None follow the model's ``hidden_size``."""
        square = hidden_size * hidden_size

        def pick(value: int | None, auto: float) -> int:
            return int(auto) if value is None else int(value)

        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "overlap_comm": self.overlap_comm,
            "contiguous_gradients": self.contiguous_gradients,
            "reduce_bucket_size": pick(self.reduce_bucket_size, square),
            "allgather_bucket_size": pick(self.allgather_bucket_size, square),
        }
        if self.zero_stage == 3:
            zero.update(
                stage3_prefetch_bucket_size=pick(self.stage3_prefetch_bucket_size, 0.9 * square),
                stage3_param_persistence_threshold=pick(self.stage3_param_persistence_threshold,
                                                        10 * hidden_size),
                stage3_max_live_parameters=self.stage3_max_live_parameters,
                stage3_max_reuse_distance=self.stage3_max_reuse_distance)
        if self.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": self.offload_optimizer, "pin_memory": True}
        if self.offload_param != "none":
            zero["offload_param"] = {"device": self.offload_param, "pin_memory": True}
        train = ctx.train
        cfg: dict[str, Any] = {
            # DeepSpeed checks batch x accumulation x ranks; memlab feeds the batches itself
            "train_micro_batch_size_per_gpu": train.batch_size,
            "gradient_accumulation_steps": train.grad_accum,
            "train_batch_size": train.batch_size * train.grad_accum * ctx.world_size,
            "gradient_clipping": float(train.max_grad_norm or 0.0),
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,  # memlab's optimizer group's
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if ctx.precision.param_dtype == "bfloat16":  # bf16 weights: DeepSpeed's bf16 mode
            cfg["bf16"] = {"enabled": True}
        return _merge(cfg, self.config)

    def setup(self, ctx: BuildContext) -> None:
        super().setup(ctx)  # the process group; DeepSpeed's comm layer adopts it
        self._adopt_group(ctx, env_rank()[1])

    def teardown(self) -> None:
        """The process group, through DeepSpeed's comm layer when it adopted it: that also
        drops the groups DeepSpeed cached from it (a later engine in this process, such as an
        estimate's after a one-rank run, would otherwise find them destroyed)."""
        import deepspeed.comm

        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()
        super().teardown()
        while _SET_HERE:
            os.environ.pop(_SET_HERE.pop(), None)

    def _adopt_group(self, ctx: BuildContext, local_rank: int) -> None:
        """DeepSpeed's comm layer on the existing process group (with the rank variables it
        reads), after checking that it picked the accelerator this run is on."""
        import deepspeed
        import torch.distributed as dist

        _rank_env(ctx.rank, local_rank, ctx.world_size)
        if not ctx.is_cuda:
            # DeepSpeed picks its accelerator at import; on a CPU run make sure it is the CPU one
            from deepspeed.accelerator import get_accelerator

            if get_accelerator().device_name() != "cpu":
                raise RuntimeError("DeepSpeed selected a GPU accelerator for a CPU run; set "
                                   "DS_ACCELERATOR=cpu")
            patches.skip_deepspeed_shm_comm()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)

    @contextlib.contextmanager
    def on_fake_group(self, ctx: BuildContext) -> Iterator[list[str]]:
        """``memlab estimate``'s rank 0 of a fake process group: DeepSpeed's rank variables for
        the block only, its comm layer on the fake group (torn down with it), and
        :func:`memlab.measure.patches.deepspeed_on_fake_tensors` (the engine built in the fake
        weights' mode and left where they are; its value reads answered as on a healthy rank
        0). A step the engine skipped anyway fails the estimate: it would be too low."""
        from unittest import mock

        from memlab.measure import patches

        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(ctx.world_size)}
        with mock.patch.dict(os.environ, env), patches.deepspeed_on_fake_tensors() as engines:
            self._adopt_group(ctx, 0)
            offloaded = [k for k, where in (("offload_optimizer", self.offload_optimizer),
                                            ("offload_param", self.offload_param))
                         if where != "none"]
            try:
                yield ["DeepSpeed's value reads answered as on a healthy rank 0: the gradients "
                       "are finite (the step is applied, not skipped as an overflow)"
                       + ("; every rank records the same module and parameter order"
                          if self.zero_stage == 3 else "")] + (
                    [f"{' and '.join(offloaded)}: what DeepSpeed moves to the host is counted in "
                     "the device's memory (the fake tensors all live on one device): an upper "
                     "bound"] if offloaded else [])
            finally:
                self.teardown()  # the fake group, and the groups DeepSpeed cached from it
            skipped = sum(e.skipped_steps for e in engines)
            if skipped:  # an overflow check the patch does not answer: the estimate is too low
                raise RuntimeError(
                    f"DeepSpeed skipped {skipped} optimizer step(s) on fake tensors as overflows: "
                    "a check memlab.measure.patches.deepspeed_on_fake_tensors does not answer")

    def wrap(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        import deepspeed
        import torch.distributed as dist

        if not dist.is_initialized():  # one rank (ZeRO-Offload on one GPU): a local group
            dist.init_process_group(self.backend_for(ctx.device), store=dist.HashStore(),
                                    rank=0, world_size=1)
            self._adopt_group(ctx, 0)
        root = Routed(model)
        params = [p for p in root.parameters() if p.requires_grad]
        config = getattr(unwrap(model), "config", None)
        hidden = int(getattr(config, "hidden_size", 0) or 4096)
        engine, *_ = deepspeed.initialize(
            model=root, model_parameters=params, config=self.ds_config(ctx, hidden),
            optimizer=lambda ps: ctx.optimizer.build(list(ps), ctx),
            dist_init_required=False)
        liger = ctx.method.as_liger()
        if (self.zero_stage == 3 and liger is not None
                and liger.reads_head_weight(ctx) is not None):
            # a chunked / fused loss reads the output head's weight directly, inside the root's
            # forward (call_inside): gather it (and the tied input embedding) for that forward.
            # The cost: the head stays gathered for the whole forward and backward.
            from deepspeed.runtime.zero import register_external_parameter

            base = base_model(unwrap(model))
            for mod in (base.get_output_embeddings(), base.get_input_embeddings()):
                if mod is not None and getattr(mod, "weight", None) is not None:
                    register_external_parameter(root, mod.weight)
        return engine

    # ---------------------------------------------------------------- the trainer's hooks
    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The torch optimizer inside the engine's (ZeRO / bf16) wrapper: its param groups
        are what the LR schedule sets."""
        opt = _engine(model).optimizer
        while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt

    @contextlib.contextmanager
    def sync(self, model: nn.Module, last: bool) -> Iterator[None]:
        """Reduce gradients (and step) only at the step's last micro-batch."""
        _engine(model).set_gradient_accumulation_boundary(last)
        yield

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        # memlab already normalised the loss over the whole step
        _engine(model).backward(loss, scale_wrt_gas=False)

    def step(self, model: nn.Module) -> float | None:
        """The optimizer step (clipping included; the last micro-batch's ``sync`` set the
        boundary); returns the gradient norm before clipping."""
        engine = _engine(model)
        engine.step()
        norm = engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def generation(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around an online method's ``generate``: under ZeRO-3 with ``gather_for_generation``,
        the full weights gathered once for the whole call."""
        if self.zero_stage != 3 or not self.gather_for_generation:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(_engine(model).module.parameters()))

    @contextlib.contextmanager
    def gathered(self, param: torch.Tensor) -> Iterator[torch.Tensor]:
        """Under ZeRO-3 the parameter's partitions gathered for the block (every rank calls
        it); whole already at stages 0-2."""
        if self.zero_stage != 3:
            yield param
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            yield param

    def memory_roles(self, model: nn.Module) -> dict[str, list[torch.Tensor]]:
        """DeepSpeed's own persistent buffers, by memlab category, for the tracker: the rank's
        parameter partitions (stage 3), the fp32 master partitions (optimizer state, as the ZeRO
        paper counts them) and the partitioned gradient buffers."""
        opt = _engine(model).optimizer
        roles: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [],
                                                "optimizer": []}

        def add(role: str, obj: Any) -> None:
            if isinstance(obj, torch.Tensor):
                roles[role].append(obj)
            elif isinstance(obj, dict):
                for v in obj.values():
                    add(role, v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    add(role, v)

        if self.zero_stage == 3:
            add("parameters", getattr(opt, "fp16_partitioned_groups_flat", None))
            for p in _engine(model).module.parameters():
                add("parameters", getattr(p, "ds_tensor", None))
            add("optimizer", getattr(opt, "fp32_partitioned_groups_flat", None))
            add("gradients", getattr(opt, "grad_partitions_flat_buffer", None))
        else:
            add("optimizer", getattr(opt, "single_partition_of_fp32_groups", None))
            add("optimizer", getattr(opt, "fp32_groups_flat_partition", None))  # bf16, stage 0
            add("gradients", getattr(opt, "averaged_gradients", None))
            add("gradients", getattr(opt, "all_grad_tensors", None))  # between micro-batches
            add("gradients", getattr(opt, "grads_in_partition", None))
        return roles

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The trainable weights, whole (gathered under ZeRO-3), named as in the unwrapped model,
        on CPU. A collective under ZeRO-3: every rank calls it."""
        inner = unwrap(model)
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        gather = contextlib.nullcontext()
        if self.zero_stage == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([p for _, p in named])
        with gather:
            return {n: p.detach().to("cpu", copy=True) for n, p in named}

    def save_states(self, model: nn.Module, path: Path) -> dict[str, str]:
        """Every rank writes its shards of weights and optimizer state (DeepSpeed's format),
        each hashed as it is written (:class:`_HashingEngine`); returns the sha256 of every
        rank's files, by path relative to ``path`` (on every rank: a collective)."""
        engine = _engine(model)
        hashes: dict[str, str] = {}
        own = engine.checkpoint_engine
        engine.checkpoint_engine = _HashingEngine(own, path, hashes)
        try:
            engine.save_checkpoint(str(path), tag="deepspeed", exclude_frozen_parameters=True)
        finally:
            engine.checkpoint_engine = own
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            every: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, hashes)
            for theirs in every:
                hashes.update(theirs or {})
        return hashes

    def load_states(self, model: nn.Module, path: Path) -> None:
        engine = _engine(model)
        engine.load_checkpoint(str(path), tag="deepspeed", load_module_strict=False,
                               load_optimizer_states=True, load_lr_scheduler_states=False)

    def describe(self, model: nn.Module) -> dict[str, Any]:
        return {"zero_stage": self.zero_stage, "offload_optimizer": self.offload_optimizer,
                "offload_param": self.offload_param,
                "gather_for_generation": self.gather_for_generation}

    def optimizer_tensors(self, ctx: BuildContext) -> OptimizerTensors:
        """ZeRO (stage >= 1) and DeepSpeed's bf16 mode step flat fp32 partitions; stage 0 with
        fp32 weights steps the module's parameters."""
        if self.zero_stage >= 1 or ctx.precision.param_dtype == "bfloat16":
            return "flat_partitions"
        return "parameters"

    def sharding(self) -> Sharding | None:
        """ZeRO's stage (measured by ``memlab estimate`` on the fake process group)."""
        return Sharding(zero_stage=self.zero_stage)

    def as_step_owner(self) -> StepOwner | None:
        return self

    def as_native_states(self) -> NativeStates | None:
        return self
