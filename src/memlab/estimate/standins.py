"""The stand-ins ``memlab estimate`` passes to :func:`memlab.pipeline.build` as seams.

- :class:`ModelStandin` loads a model from its *config* only (``model=tiny``: its sizes;
  ``model=hf``: ``AutoConfig``), on the ``meta`` device, with the same class, attention backend
  and dtype as the model group's ``load``; PEFT and checkpointing are applied there by the
  pipeline; :meth:`ModelStandin.place` then turns every parameter and buffer into a fake CPU
  tensor (tied weights stay tied). A quantized base (``peft=qlora``) is stored as bitsandbytes
  stores it: with bitsandbytes installed, a 4-bit base is laid out and computed by bitsandbytes
  itself (:class:`Bnb4bitStandin`: measured); otherwise, and for 8 bits, analytically
  (:class:`QuantizedLinearStandin`: modelled). No weight is ever read.
- :class:`HostStandin` is where offloaded activations go (a fake tensor on another device).
- :class:`WorstCaseEngine` generates with the model's own ``generate`` for exactly the maximum
  number of new tokens on every row (no early EOS) and hands back host token ids of that length;
  the decode steps between the first and the last are answered without the model
  (:mod:`memlab.estimate.decode`).
- :class:`NoDraw` makes every random draw 0 (GKD's on-policy coin: the student samples).
"""

from __future__ import annotations

import contextlib
import math
import random
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from memlab.data.assets import load_tokenizer as shipped_tokenizer
from memlab.estimate.decode import ShortDecode
from memlab.estimate.options import EstimateError
from memlab.generation.base import Samples, SamplingParams
from memlab.generation.hf import HFEngine
from memlab.measure import patches
from memlab.model.base import Head, auto_class, finish_load, load_kwargs
from memlab.offload.base import Placement

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from memlab.context import BuildContext
    from memlab.peft.base import QuantizedBase


class ModelStandin:
    """The model-loading seams of an estimate (module docstring). ``overrides``: fields of the
    HF config to change (``--set``), applied to every model built."""

    def __init__(self, overrides: dict[str, Any], notes: list[str], fake_mode,
                 layers: int | None = None):
        self.overrides = dict(overrides)
        self.notes = notes
        self.fake_mode = fake_mode
        self.layers = layers
        """Build every model with this many decoder layers (:mod:`memlab.estimate.layers`)."""
        self.loaded_layers: list[int | None] = []
        """The depth each model built would have had (with the ``--set`` overrides)."""

    def load_tokenizer(self, ctx: BuildContext):
        try:
            return ctx.model.load_tokenizer(ctx)
        except Exception as e:  # noqa: BLE001 - offline hub model: the ids do not matter
            note = (f"tokenizer of the model unavailable ({type(e).__name__}); memlab's shipped "
                    "tokenizer builds the synthetic batch (token ids do not change memory)")
            if note not in self.notes:
                self.notes.append(note)
            return shipped_tokenizer(None)

    def config(self, model_cfg, tokenizer):
        """``model_cfg``'s transformers config with the ``--set`` overrides."""
        cfg = model_cfg.hf_config(tokenizer)
        for k, v in self.overrides.items():
            if not hasattr(cfg, k):
                raise EstimateError(f"model config has no field {k!r} (config class "
                                    f"{type(cfg).__name__}); check --set {k}=...")
            setattr(cfg, k, v)
        cfg.use_cache = False
        if self.layers is not None:  # (memlab.estimate.layers: a shallow build)
            self.loaded_layers.append(getattr(cfg, "num_hidden_layers", None))
            cfg.num_hidden_layers = self.layers
            types = getattr(cfg, "layer_types", None)
            if isinstance(types, list):
                cfg.layer_types = types[:self.layers]
        return cfg

    def load(self, ctx: BuildContext, tokenizer: Any, head: Head, extra: dict[str, Any]
             ) -> PreTrainedModel:
        """The seam ``load_model``: built from the config on the current (meta) device."""
        quantized = extra.get("quantization_config") is not None
        kw = load_kwargs(ctx, {k: v for k, v in extra.items()
                               if k not in ("quantization_config", "device_map")})
        cfg = self.config(ctx.model, tokenizer)
        if head == "seq_cls" and "num_labels" not in self.overrides:
            cfg.num_labels = 1  # as model=hf passes num_labels=1 to from_pretrained
        model = auto_class(head).from_config(cfg, **kw)
        if quantized:
            layout = ctx.peft.as_quantized_base()
            if layout is None:  # (the peft option's load_kwargs gave a quantization config)
                raise EstimateError(f"peft={ctx.peft.name} asked for a quantized load but "
                                    "declares no quantized base")
            _, measured = quantize_standin(model, layout)
            note = ("qlora: the 4-bit base laid out and computed by bitsandbytes itself "
                    "(quantize_4bit on meta tensors, Linear4bit's training forward); the "
                    "run's tracker counts the same bytes on CPU. A 4-bit matmul is one "
                    "bitsandbytes op: a temporary inside it is not counted (on CUDA, inputs of "
                    "more than a few rows dequantize the weight into one), and bitsandbytes "
                    "repacks CPU weights into another layout for no-grad eval forwards, which "
                    "memlab turns off on CPU: a no-grad or generate phase on CPU may differ "
                    "from CUDA's" if measured else
                    "qlora: base linear weights stored as bitsandbytes packs them (4-bit: n/2 "
                    "bytes + absmax state; 8-bit: n bytes + row scales), computed analytically "
                    "(modelled: bitsandbytes " + ("not installed here" if layout.bits == 4
                                                   else "8-bit layers") + "); dequantized "
                    "weights are temporaries in forward and backward"
                    + ("" if layout.bits == 4 else
                       " (bitsandbytes' CPU 8-bit training path keeps each dequantized weight "
                       "for backward instead: measured +11% activations over this model on a "
                       "small CPU run; its CUDA path is another)"))
            if note not in self.notes:
                self.notes.append(note)
        return finish_load(model, tokenizer, head)

    @contextlib.contextmanager
    def build_context(self):
        """Models are built on the meta device, outside the fake mode (PEFT cannot swap in
        parameters created inside it)."""
        with unset_fake_temporarily(), torch.device("meta"):
            yield

    def place(self, model: nn.Module) -> nn.Module:
        """The seam ``place_model``: every parameter and buffer a fake CPU tensor."""
        return fakeify(model, self.fake_mode)


class _DequantMatmul(torch.autograd.Function):
    """``x @ dequant(W).T`` as bitsandbytes computes it: the dequantized weight is a temporary
    in forward and again in backward; nothing but the packed weight is kept for backward."""

    @staticmethod
    def forward(ctx, x, packed, shape, bias):
        w = torch.empty(shape, dtype=x.dtype, device=x.device)
        ctx.shape = shape
        return nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return grad @ w, None, None, None


class QuantizedLinearStandin(nn.Linear):
    """A frozen linear layer whose weight is stored like bitsandbytes stores it.

    4-bit (NF4/FP4): ``uint8 [ceil(out*in / 2), 1]`` (``Params4bit``), plus the quantization
    state as a frozen parameter: a 16-entry fp32 code book and an fp32 absmax per 64-weight
    block, or with double quantization a uint8 absmax per block, an fp32 one per 256 blocks,
    an fp32 offset and the 256-entry fp32 code book of the scales (bitsandbytes 0.50's layout,
    which :class:`Bnb4bitStandin` measures). 8-bit (LLM.int8): ``int8 [out, in]`` plus fp32
    ``SCB`` per output row. Forward casts the input to the compute dtype and
    dequantizes the weight into a temporary, as bitsandbytes does. Values are meaningless: this
    module exists only for fake-tensor estimates.
    """

    def __init__(self, base: nn.Linear, bits: int, double_quant: bool, compute_dtype):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        n = base.in_features * base.out_features
        dev = base.weight.device
        if bits == 4:
            w = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=dev)
            blocks = math.ceil(n / 64)
            qbytes = 16 * 4 + (blocks + math.ceil(blocks / 256) * 4 + 4 + 256 * 4
                               if double_quant else blocks * 4)
        else:
            w = torch.empty((base.out_features, base.in_features), dtype=torch.int8, device=dev)
            qbytes = base.out_features * 4
        self.weight = nn.Parameter(w, requires_grad=False)
        # a frozen parameter: a run's tracker counts the quantization state as parameters
        self.quant_state = nn.Parameter(torch.empty(qbytes, dtype=torch.uint8, device=dev),
                                        requires_grad=False)
        self.bias = base.bias
        self.logical_numel = n
        self.compute_dtype = compute_dtype

    def forward(self, x):
        inp = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _DequantMatmul.apply(x, self.weight, (self.out_features, self.in_features),
                                    bias).to(inp)


class Bnb4bitStandin(QuantizedLinearStandin):
    """A frozen 4-bit linear layer laid out and computed by bitsandbytes itself (measured, not
    modelled): ``bitsandbytes.functional.quantize_4bit`` on the meta device gives the packed
    weight and its quant state (bitsandbytes' own shapes: block scales, code book, nested
    scales), and the forward is ``Linear4bit``'s training forward (``bnb.matmul_4bit``: one
    fused op, then a dequantized temporary in backward). The quant state's tensors are frozen
    parameters here, as a run's tracker counts them
    (:func:`memlab.measure.memory.quantization_state`)."""

    def __init__(self, base: nn.Linear, quant_type: str, double_quant: bool, compute_dtype):
        import bitsandbytes.functional as bnbf

        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.logical_numel = base.in_features * base.out_features
        self.compute_dtype = compute_dtype
        with torch.device("cpu"):
            # bitsandbytes caches the double quantization's code book on the device of its
            # first call: a real CPU one, never this meta weight's (a later run would fail)
            bnbf.quantize_blockwise(torch.zeros(256))
            packed, state = bnbf.quantize_4bit(
                base.weight.detach(), compress_statistics=double_quant, quant_type=quant_type,
                quant_storage=torch.uint8)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = base.bias
        self.state = state
        """bitsandbytes' QuantState, whose tensors are rebound to this module's parameters
        at every forward (they become fake tensors after :meth:`ModelStandin.place`)."""
        frozen = {"absmax": state.absmax, "code": state.code}
        if state.nested:
            frozen |= {"offset": state.offset, "absmax2": state.state2.absmax,
                       "code2": state.state2.code}
        for name, t in frozen.items():
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    def forward(self, x):
        import bitsandbytes as bnb

        state = self.state
        state.absmax, state.code = self.absmax, self.code
        if state.nested:
            state.offset = self.offset
            state.state2.absmax, state.state2.code = self.absmax2, self.code2
        inp = x.dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return bnb.matmul_4bit(x.to(self.compute_dtype), self.weight.t(), bias=bias,
                               quant_state=state).to(inp)


def quantize_standin(model: PreTrainedModel, qcfg: QuantizedBase) -> tuple[int, bool]:
    """Replace every linear layer bitsandbytes would quantize (all but the output head, tied
    and last modules: transformers' ``get_keys_to_not_convert``) with :class:`Bnb4bitStandin`
    (4 bits, bitsandbytes installed) or :class:`QuantizedLinearStandin`. Returns how many were
    replaced and whether bitsandbytes laid them out (measured) rather than memlab's model."""
    from transformers.quantizers.base import get_keys_to_not_convert

    from memlab import _guards

    skip = set(get_keys_to_not_convert(model))
    bits = int(qcfg.bits)
    compute = getattr(torch, qcfg.compute_dtype) if bits == 4 else torch.float16
    double = bool(qcfg.double_quant)
    measured = bits == 4 and _guards.has("bitsandbytes")
    todo = []
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and not any(
                name == k or name.endswith("." + k) or name.startswith(k + ".") for k in skip):
            todo.append(name)
    for name in todo:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        setattr(parent, child,
                Bnb4bitStandin(base, qcfg.quant_type, double, compute) if measured
                else QuantizedLinearStandin(base, bits, double, compute))
    # transformers' own marks of a quantized model (torch types nn.Module.__setattr__ for
    # tensors and modules only; any value is accepted)
    model.is_loaded_in_4bit = bits == 4  # type: ignore[assignment]
    model.is_loaded_in_8bit = bits == 8  # type: ignore[assignment]
    return len(todo), measured


def fakeify(model: nn.Module, fake_mode) -> nn.Module:
    """Replace every parameter and buffer (meta or real) by a fake CPU tensor of the same
    shape / dtype / requires_grad. Tied parameters stay tied. Allocates nothing."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in params:
                params[id(p)] = nn.Parameter(fake_of(p), requires_grad=p.requires_grad)
            mod._parameters[name] = params[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in buffers:
                buffers[id(b)] = fake_of(b)
            mod._buffers[name] = buffers[id(b)]
    return model


class HostStandin:
    """Offload storage for estimates: the host copy is a fake tensor on the ``meta`` device, so
    the tracker books it under another device than the (cpu-standing-for-GPU) device memory."""

    def offload(self, tensor):
        return torch.empty_like(tensor, device="meta")

    def reload(self, handle, device):
        return torch.empty_like(handle, device=device)


def fake_storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Fake storages all report data pointer 0: a fake tensor's storage is known by identity
    (the same meaning for live objects)."""
    st = t.untyped_storage()
    return (str(st.device), id(st))


OFFLOAD = Placement(storage=HostStandin(), key=fake_storage_key, tensor_types=(FakeTensor,))
"""The offload seam of an estimate: fake tensors are offloaded to a fake host device."""


class WorstCaseEngine(HFEngine):
    """Generation in an estimate: the model's own ``generate`` (prefill, KV cache, sampling) for
    exactly ``max_new_tokens`` on every row (its stop check reads a value; here it reads the
    length), then host copies of that length (token ``token`` repeated), so that the method's
    scoring, counting and reward models run on the worst case."""

    placeholder_samples: ClassVar[bool] = True

    def __init__(self, dist: Any, token: int, steps: ShortDecode | None = None):
        super().__init__(dist)
        self.token = token
        self.steps = steps or ShortDecode(every_step=True)

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams) -> Samples:
        from transformers.utils import logging as hf_logging

        stop_at = prompt_ids.shape[1] + params.max_new_tokens
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # generate's sanity warnings read token values
        try:
            with patches.stop_at_length(lambda: stop_at), \
                    self.steps.around(model, params.max_new_tokens):
                comp = self.decode(model, prompt_ids, prompt_mask, params)
        finally:
            hf_logging.set_verbosity(verbosity)
        n, width = comp.shape
        return Samples(comp, torch.ones_like(comp),
                       torch.zeros(n, dtype=torch.bool, device=comp.device),
                       [[self.token] * width for _ in range(n)], [False] * n)


def round_trip_token(tokenizer, n: int = 8) -> int:
    """A token id whose repetition decodes to text that tokenizes back to the same number of
    tokens (a common word with its leading space), so that scoring the decoded worst-case
    completions (reward models re-tokenize text) sees ``max_new_tokens`` tokens per
    completion; falls back to a fixed id."""
    for text in (" the", " a", " of", " x", "."):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            continue
        again = tokenizer(tokenizer.decode(ids * n), add_special_tokens=False)["input_ids"]
        if again == ids * n:
            return ids[0]
    return min(100, len(tokenizer) - 1)


class NoDraw(random.Random):
    """Random draws that are all 0.0: GKD's on-policy coin always picks the student."""

    def random(self) -> float:
        return 0.0
