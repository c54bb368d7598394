"""The contracts, in one place: what every option of each group provides, and the run's context
they are built in (as torchtitan keeps its interfaces in one ``protocols/`` folder).

- :mod:`memlab.protocols.groups`: :class:`BuildContext` and each group's Protocol
  (:class:`Method`, :class:`Generation`, :class:`PackingOption`, :class:`Attention`,
  :class:`Precision`, :class:`Offload`, :class:`Peft`, :class:`Optimizer`,
  :class:`Distributed`, :class:`Model`, :class:`DataSource`, :class:`Logger`), with the
  capabilities that read the context (:class:`Generating`, :class:`GroupPacked`,
  :class:`LigerUser`, :class:`ExtraModels`, :class:`Pinnable`, :class:`SplitSource`) and the
  logger's :class:`RunInfo`. One module: they name each other.
- :mod:`memlab.protocols.method`: a method's :class:`RowLayout` (names no context).
- :mod:`memlab.protocols.parts`: what they are made of that names no context (a generation
  engine, the offload handle, a logging run, a distributed option's checkpoint states...).

Below them, and naming neither: :class:`memlab.registry.Option`, :mod:`memlab.config`, the
batch and data types. Above them: :mod:`memlab.context` (:func:`~memlab.context.validate`
builds the context; ``memlab.context.BuildContext`` is this one) and each group's
``base.py``, which re-exports its names and registers its options against its Protocol. So
the import graph has no cycle, counting the imports made for annotations only
(``tests/unit/core/test_layers.py`` checks it), and importing this package imports no torch.
"""

from memlab.protocols.groups import (
    Attention,
    BuildContext,
    DataSource,
    Distributed,
    ExtraModels,
    Generating,
    Generation,
    GroupOption,
    GroupPacked,
    LigerUser,
    Logger,
    Method,
    Model,
    Offload,
    Optimizer,
    PackingOption,
    Peft,
    Pinnable,
    Precision,
    RunInfo,
    SplitSource,
)
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
    Samples,
    SamplingParams,
    Sharding,
    StepOwner,
)

__all__ = [
    "Attention", "BuildContext", "DataSource", "Distributed", "Engine", "EngineMemory",
    "ExtraModels", "GatheredStates", "Generating", "Generation", "GenerationEnv", "GroupOption",
    "GroupPacked", "Head", "LigerUser", "Logger", "LoggerRun", "Method", "Model",
    "ModelFactory", "MultiProcess", "NativeStates", "Offload", "OffloadHandle", "Optimizer",
    "OptimizerTensors", "PackingOption", "Peft", "Pinnable", "Placement", "Precision",
    "QuantizedBase", "RowLayout", "RunInfo", "Samples", "SamplingParams", "Sharding",
    "SplitSource", "StepOwner",
]
