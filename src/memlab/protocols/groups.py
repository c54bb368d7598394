"""The run's context (:class:`BuildContext`) and each group's Protocol (:class:`Method`,
:class:`Generation`, ... :class:`Logger`), with the capabilities that read the context
(a method's :class:`Generating`, :class:`GroupPacked`, :class:`LigerUser`,
:class:`ExtraModels`, :class:`Pinnable`; a source's :class:`SplitSource`) and the logger's
:class:`RunInfo`: one module, because they name each other (a group's hooks take the context;
the context's fields are the groups' choices, each typed by its group's Protocol).

Below it, naming neither: :mod:`memlab.protocols.parts` and :mod:`memlab.protocols.method`
(what they are made of that names no context), :class:`memlab.registry.Option`, :mod:`memlab.config` and the batch and data types.
:func:`memlab.context.validate` builds the context; each group's ``base.py`` (whose docstring
says what its hooks do) re-exports its Protocol and registers its options through a
``register`` typed by it, so mypy checks every option against it. Imports no torch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from memlab.config import Platform
from memlab.protocols.method import RowLayout
from memlab.protocols.parts import (
    Engine,
    EngineMemory,
    GatheredStates,
    GenerationEnv,
    Head,
    LoggerRun,
    ModelFactory,
    MultiProcess,
    NativeStates,
    OffloadHandle,
    OptimizerTensors,
    Placement,
    QuantizedBase,
    Sharding,
    StepOwner,
)
from memlab.registry import Option

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

    from memlab.config import MeasureConfig, TrainConfig
    from memlab.measure.data import DataStats
    from memlab.trainer.batch import Batch, Segments
    from memlab.trainer.inputs import Inputs


@dataclass(frozen=True)
class BuildContext:
    """Everything a builder may know besides its own config: the other groups' choices, the
    device and the world size. Frozen: builders read it, never change it
    (:func:`memlab.context.validate` makes it)."""

    method: Method
    generation: Generation
    packing: PackingOption
    attention: Attention
    precision: Precision
    offload: Offload
    peft: Peft
    optimizer: Optimizer
    distributed: Distributed
    model: Model
    data: DataSource
    logger: Logger
    train: TrainConfig
    measure: MeasureConfig
    device: str = "cpu"
    world_size: int = 1
    rank: int = 0
    choices: dict[str, str] = field(default_factory=dict)
    run_dir: Path = Path(".")
    platform: Platform = field(default_factory=Platform)
    """The machine the run is validated for (:meth:`Platform.detect` in a run)."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def groups(self) -> dict[str, GroupOption]:
        """The typed config of every group, by group name (for code that treats every group
        alike: recording a configuration, listing its settings)."""
        return {"method": self.method, "generation": self.generation, "packing": self.packing,
                "attention": self.attention, "precision": self.precision,
                "offload": self.offload, "peft": self.peft, "optimizer": self.optimizer,
                "distributed": self.distributed,
                "model": self.model, "data": self.data, "logger": self.logger}


class GroupOption(Option, Protocol):
    """What every group's Protocol extends: a registered option
    (:class:`memlab.registry.Option`) whose ``validate`` reads the run's context."""

    def validate(self, ctx: BuildContext) -> list[str]:
        """Every problem of this choice in the run ``ctx`` (each naming its fix); loads
        nothing."""


class Method(GroupOption, Protocol):
    """What every ``method=`` option provides (:mod:`memlab.method.base`); what only some have
    is a capability asked for with ``as_<capability>()`` (None: the method does not have it)."""

    data_kinds: ClassVar[tuple[str, ...]]
    head: ClassVar[Head]
    items_name: ClassVar[str]
    eval_metrics: ClassVar[tuple[str, ...]]
    """The metrics :meth:`evaluate` reports (``train.best_metric`` picks one; the first is
    the default)."""

    def prepare(self, ds: Any, tokenizer: Any, ctx: BuildContext) -> tuple[Any, DataStats]: ...
    def collate(self, rows: list[dict], tokenizer: Any, ctx: BuildContext) -> Batch: ...
    def loss(self, models: dict[str, nn.Module], batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, Any]]: ...
    def evaluate(self, models: dict, batch: Batch, ctx: BuildContext, env: Any
                 ) -> tuple[dict[str, float], int]:
        """Each eval metric summed over the held-out micro-batch ``batch``, and the number of
        items summed over (loss tokens, pairs, prompts); runs under ``torch.no_grad`` with the
        policy in eval mode. ``env``: the run's generation environment (online methods) or
        None."""
    def row_layout(self, ctx: BuildContext) -> RowLayout:
        """How its rows are laid out in the run ``ctx``."""
    def as_generating(self) -> Generating | None:
        """The method as an online one (it samples its training batches), or None."""
    def as_group_packed(self) -> GroupPacked | None:
        """The method whose rows pack as units of several sequences, or None."""
    def as_liger(self) -> LigerUser | None:
        """The method with a Liger path (its fused losses, its kernels), or None."""
    def as_extra_models(self) -> ExtraModels | None:
        """The method that needs models besides the policy, or None."""
    def as_pinnable(self) -> Pinnable | None:
        """The method with choices that depend on the rest of the run (an ``auto``), or
        None."""


class LigerUser(Protocol):
    """A method with a Liger path (sft, dpo, kto): Liger's kernels in its model, Liger's fused
    linear loss, and memlab's own chunked one (sft): the losses that read the output head's
    weight directly rather than its output."""

    def uses_liger(self) -> bool:
        """Liger's kernels are on (``method.use_liger_kernel``)."""
    def liger_model_kernels(self) -> tuple[str, ...]:
        """Liger's kernels that replace modules of the method's models (empty: none)."""
    def reads_head_weight(self, ctx: BuildContext) -> str | None:
        """The setting whose loss reads the output head's weight directly in the run ``ctx``
        (a chunked or fused loss, e.g. ``method.loss_impl=chunked``), or None."""


class ExtraModels(Protocol):
    """A method that needs models besides the policy (a reference, a teacher, reward and value
    models), and its one-off pass over them before training."""

    trains_extra_models: ClassVar[bool]
    """It trains a model besides the policy (PPO's value model)."""

    def extra_models(self, policy: nn.Module, ctx: BuildContext, build: ModelFactory
                     ) -> dict[str, nn.Module]: ...
    def before_training(self, models: dict[str, nn.Module], ds: Any, ctx: BuildContext
                        ) -> Any: ...


class Pinnable(Protocol):
    """A method with choices that depend on the rest of the run (an ``auto``)."""

    def pinned(self, ctx: BuildContext) -> Method:
        """The method with every such choice made explicit for the run ``ctx``: what an
        estimate keeps where it measures the run in another context (DDP as one plain
        process), so that it measures the run's own choices."""


class Generating(Protocol):
    """An online method: its training batches are sampled in the trainer's generate phase."""

    supports_sampling_correction: ClassVar[bool]
    """Its loss can weight tokens by the sampler/trainer mismatch (generation=vllm)."""

    @property
    def num_iterations(self) -> int:
        """Optimizer steps per generation batch."""
    def sampling_length(self) -> int:
        """New tokens per completion (at most)."""
    def rows_per_prompt(self) -> int:
        """Completions sampled per prompt."""
    def rollout(self, models: dict[str, nn.Module], batch: Batch, ctx: BuildContext,
                env: GenerationEnv) -> Batch:
        """The training batch generated from the prompt batch ``batch``; ``env`` is the run's
        :class:`~memlab.protocols.parts.GenerationEnv` (engine, random draws)."""
    def worst_case_tensors(self, batch: Batch, new_tokens: int, token: int, ctx
                           ) -> dict[str, torch.Tensor]:
        """The training tensors ``rollout`` makes of ``batch`` when every completion runs to
        ``new_tokens`` tokens (``token`` repeated), with real values (an estimate evaluates
        the training forward's value-dependent decisions on them)."""


class Generation(GroupOption, Protocol):
    """A ``generation=`` option (:mod:`memlab.generation.base`)."""

    def build(self, ctx: BuildContext, tokenizer: Any, policy: torch.nn.Module) -> Engine:
        """The engine that samples from ``policy`` (the wrapped training model)."""
    def engine_memory(self, ctx: BuildContext, weight_elements: int, dtype: torch.dtype,
                      device_bytes: int | None) -> EngineMemory | None:
        """What this option's engine will hold on the training device, for an estimate:
        ``weight_elements`` the engine's copy of the weights holds (LoRA: the merged base),
        ``dtype`` the policy's, ``device_bytes`` the device's memory where known. None: the
        engine holds nothing there beyond the trainer's tensors."""


class PackingOption(GroupOption, Protocol):
    """A ``packing=`` option (:mod:`memlab.packing.base`)."""

    packs: ClassVar[bool]
    """Whether rows hold several sequences (every strategy but ``none``)."""
    keeps_overflow: ClassVar[bool]
    """The strategy itself handles sequences longer than the row capacity (bfd_split splits
    them, wrapped streams them), so the method must not truncate first."""
    cuts_sequences: ClassVar[bool]
    """A sequence may be cut across rows (wrapped)."""

    def apply(self, ds: Any, stats: DataStats, ctx: BuildContext) -> tuple[Any, DataStats]:
        """The prepared dataset packed into rows (and its stats updated)."""
    def batch_items(self, ctx: BuildContext) -> int:
        """Items of the prepared (packed) dataset per micro-batch: ``train.batch_size`` rows,
        or 1 where each item is a whole micro-batch (units packed in groups)."""


class GroupPacked(Protocol):
    """What a method whose rows pack as units of several sequences provides, declared through
    ``Method.as_group_packed()`` (dpo, kto, reward); the units and their sizes:
    :mod:`memlab.packing.groups`.

    The packing options read this capability: such a method's prepared dataset holds one unit
    per row, its packed dataset one micro-batch per item, and strategies that cut sequences
    (``wrapped``) do not apply to it."""

    def unit_sizes(self, ds: Any, ctx: BuildContext) -> tuple[list[int], list[list[int]]]:
        """``(whole, pieces)`` of every prepared row (:mod:`memlab.packing.groups`)."""
    def unit_pieces(self) -> int:
        """Pieces (sequences) of the largest unit: a split unit needs that many rows in a
        pack."""


class Attention(GroupOption, Protocol):
    """An ``attention=`` option: a transformers ``attn_implementation`` and what it can do
    (:mod:`memlab.attention.base`)."""

    isolates_packed: ClassVar[bool]
    """Keeps documents apart in a packed / padding-free row (restarting position_ids)."""
    skips_padding: ClassVar[bool]
    """Given a padding mask, the backend leaves padded positions out of its work; False:
    padded positions cost as much with the mask as without (``method.padding_mask``)."""
    devices: ClassVar[tuple[str, ...]]
    """The devices it runs on (``cpu``, ``cuda``)."""
    trains_on_cpu: ClassVar[bool]
    """It has a backward pass on the CPU."""

    def implementation(self) -> str:
        """The string passed to transformers as ``attn_implementation``."""
    def shares_prefix(self) -> bool:
        """Whether a document can also see a prefix stored before it in its row."""
    def document_mask(self, segments: Segments, width: int, device: torch.device | str
                      ) -> Any:
        """The ``attention_mask`` to pass for rows described by ``segments``, or None."""


class Precision(GroupOption, Protocol):
    """A ``precision=`` option: the dtype weights load in and the dtype of the compute
    (:mod:`memlab.precision.base`)."""

    param_dtype: ClassVar[str]
    """Weights are loaded in this dtype (``float32``, ``bfloat16``, ``float16``)."""
    autocast_dtype: ClassVar[str | None]
    """The compute dtype under torch.autocast (None: no autocast)."""
    needs_scaler: ClassVar[bool]
    """fp16 loss scaling."""

    def torch_param_dtype(self) -> torch.dtype: ...
    def compute_dtype_name(self) -> str:
        """The dtype the matmuls run in."""
    def autocast(self, device: str) -> contextlib.AbstractContextManager:
        """Context manager for the forward pass and loss."""
    def grad_scaler(self, device: str) -> torch.amp.GradScaler | None:
        """A GradScaler for fp16 mixed precision, else None."""
    def resolved(self, device: str, platform: Platform) -> Precision:
        """The option a run on ``device`` of ``platform`` trains with: itself, or for
        ``precision=auto`` the option it stands for there (chosen before any rule reads it)."""


class Offload(GroupOption, Protocol):
    """An ``offload=`` option (:mod:`memlab.offload.base`)."""

    def build(self, model: nn.Module, ctx: BuildContext, placement: Placement | None = None
              ) -> OffloadHandle | None:
        """The run's handle on ``model`` (None: nothing is offloaded)."""
    def forward_context(self, handle: OffloadHandle | None) -> contextlib.AbstractContextManager:
        """Around each forward + loss."""


class Peft(GroupOption, Protocol):
    """A ``peft=`` option (:mod:`memlab.peft.base`)."""

    def load_kwargs(self, ctx: BuildContext) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments (qlora: the bitsandbytes config)."""
    def apply(self, model: nn.Module, ctx: BuildContext, task: Head) -> nn.Module:
        """The model with adapters (the model itself for full fine-tuning)."""
    def has_adapter(self) -> bool:
        """Whether the trained parameters are adapters (the base can be switched off)."""
    def adapts_head(self) -> bool:
        """Whether an adapter sits on the output head (``lm_head``): a loss that reads the
        head's weight directly would leave it out."""
    def as_quantized_base(self) -> QuantizedBase | None:
        """The option as one whose frozen base is stored quantized, or None."""


class Optimizer(GroupOption, Protocol):
    """What every ``optimizer=`` option provides (:mod:`memlab.optimizer.base`)."""

    in_backward: bool
    """Step each parameter inside backward, as its gradient is ready
    (:mod:`memlab.optimizer.base`)."""
    takes_dtensors: ClassVar[bool]
    """It can step FSDP2's DTensor shards."""
    takes_flat_partitions: ClassVar[bool]
    """It can step ZeRO's flat 1-D partitions (several parameters in one tensor)."""

    def build(self, params: list[nn.Parameter], ctx: BuildContext,
              model: nn.Module | None = None, foreach: bool | None = None
              ) -> torch.optim.Optimizer:
        """The optimizer over ``params`` with ``train.lr`` / ``train.weight_decay``; ``foreach``:
        torch's multi-tensor implementation where the option has one (None: torch's default)."""
    def group_settings(self) -> dict[str, Any]:
        """The param-group values this configuration sets (resume applies them)."""


class Distributed(GroupOption, Protocol):
    """What every ``distributed=`` option provides (:mod:`memlab.distributed.base`)."""

    wraps_fake_tensors: ClassVar[bool]
    reduces_before_grad_hooks: ClassVar[bool]

    def processes(self, device: str, gpus: int = 0) -> int:
        """The processes the run needs on ``device`` with ``gpus`` visible GPUs (0: unknown)."""
    def setup(self, ctx: BuildContext) -> None: ...
    def teardown(self) -> None: ...
    def wrap(self, model: nn.Module, ctx: BuildContext) -> nn.Module: ...
    def sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager: ...
    def all_reduce_sum(self, values: list[float], device: str) -> list[float]: ...
    def generation(self, model: nn.Module) -> contextlib.AbstractContextManager: ...
    def gathered(self, param: torch.Tensor
                 ) -> contextlib.AbstractContextManager[torch.Tensor]: ...
    def memory_roles(self, model: nn.Module) -> dict[str, list[torch.Tensor]]: ...
    def describe(self, model: nn.Module) -> dict[str, Any]: ...
    def sharding(self) -> Sharding | None: ...
    def optimizer_tensors(self, ctx: BuildContext) -> OptimizerTensors:
        """What the optimizer steps in this run (:mod:`memlab.distributed.base`)."""
    def on_fake_group(self, ctx: BuildContext) -> contextlib.AbstractContextManager[list[str]]:
        ...
    def as_ranks(self) -> MultiProcess | None: ...
    def as_step_owner(self) -> StepOwner | None: ...
    def as_gathered_states(self) -> GatheredStates | None: ...
    def as_native_states(self) -> NativeStates | None: ...


class Model(GroupOption, Protocol):
    """A ``model=`` option: where the tokenizer, the architecture and the weights come from
    (:mod:`memlab.model.base`)."""

    def load_tokenizer(self, ctx: BuildContext) -> Any: ...
    def hf_config(self, tokenizer: Any) -> Any:
        """The transformers config of the architecture (no weights read)."""
    def load(self, ctx: BuildContext, tokenizer: Any, head: Head, extra: dict[str, Any]
             ) -> PreTrainedModel:
        """The model with the run's attention backend and dtype (``load_kwargs``), on the
        run's device; ``extra``: the PEFT option's load arguments (a quantization config)."""
    def inputs(self) -> dict[str, Inputs]:
        """What the weights, the tokenizer and the chat template are read from (``model``,
        ``tokenizer``, ``chat_template``: files, or a hub repository), fingerprinted by
        checkpoints so that a resumed run refuses them changed in place
        (:mod:`memlab.trainer.inputs`)."""


class DataSource(GroupOption, Protocol):
    """What every ``data=`` option provides (the fields of
    :class:`memlab.data.formats.RowOptions` included; its ``validate`` reads nothing;
    :mod:`memlab.data.base`)."""

    @property
    def columns(self) -> dict[str, str] | None: ...
    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def training_template(self) -> Literal["auto", "off"]: ...
    @property
    def on_unsplittable(self) -> Literal["error", "skip"]: ...
    @property
    def eval(self) -> float | str | None: ...
    @property
    def max_hollow_fraction(self) -> float: ...
    def eval_kind(self) -> Literal["fraction", "path", "split"] | None:
        """What ``eval`` names (:meth:`memlab.data.formats.RowOptions.eval_kind`)."""
    def as_split_source(self) -> SplitSource | None:
        """This source, when it has named splits (``data.eval=<split>`` reads one)."""
    def load(self, ctx: BuildContext) -> Any:
        """The rows as read, a ``datasets.Dataset``."""
    def convert(self, ds: Any) -> tuple[Any, dict[str, int]]:
        """``ds`` (what :meth:`load` returned) in memlab's row formats, row for row, and what
        was converted (:func:`memlab.data.formats.convert`)."""
    def locate(self, ds: Any, row: int) -> str:
        """Where row ``row`` of ``ds`` (what :meth:`load` returned) comes from, in words: a
        file and line, a hub dataset's row."""
    def place(self, index: int) -> str:
        """Where row ``index`` of the data as read (before any sample or shuffle) comes
        from."""
    def summary(self, ds: Any) -> dict[str, Any]:
        """Entries for the summary's ``data`` section about the rows ``ds`` (what :meth:`load`
        returned) holds (a mixture's rows per source); empty for most sources."""
    def inputs(self) -> dict[str, Inputs]:
        """What the rows are read from (files, a hub repository), by input name (``data``;
        ``data.<label>`` per mixture source), fingerprinted by checkpoints so that a resumed
        run refuses data changed in place (:mod:`memlab.trainer.inputs`); empty for data
        generated from the config."""


class SplitSource(DataSource, Protocol):
    """A source with named splits: ``data.eval=<split>`` reads one."""

    def load_split(self, ctx: BuildContext, split: str) -> Any:
        """The rows of ``split``, as :meth:`load` reads its own."""


class Logger(GroupOption, Protocol):
    """A ``logger=`` option (:mod:`memlab.logger.base`)."""

    def start(self, info: RunInfo, config: dict[str, Any]) -> LoggerRun:
        """Start logging the job (rank 0); ``config`` is the run's resolved config."""


@dataclass(frozen=True)
class RunInfo:
    """What a logger knows of the job it records: where it runs and what was chosen. A job
    that ended before it trained (an invalid configuration) has one too, so its logger still
    records it."""

    run_dir: Path
    choices: dict[str, str] = field(default_factory=dict)
    """Hydra's group choices of the job."""
    sweep_dir: Path | None = None
    """The sweep's directory (a multirun job), else None."""
    rank: int = 0

    @classmethod
    def of(cls, ctx: BuildContext, sweep_dir: str | Path | None) -> RunInfo:
        """The info of a validated run."""
        return cls(Path(ctx.run_dir), dict(ctx.choices), Path(sweep_dir) if sweep_dir else None,
                   ctx.rank)
