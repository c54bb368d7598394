"""Predict the peak memory of a configuration without running it: one training step on fake
tensors, measured by the same tracker a real run uses.

How (and why this is not a formula)
    The estimate runs the *real* code of a run - :func:`memlab.pipeline.load_model` (model with
    attention + dtype, PEFT, gradient checkpointing), the offload hooks, the method's own
    ``collate`` and ``loss``, and :meth:`memlab.trainer.loop.Trainer.run_step` (forward, loss,
    backward, gradient clipping, optimizer step) - on ``torch._subclasses.FakeTensorMode``
    tensors, under the same categorised :class:`~memlab.measure.memory.MemoryProbe` /
    MemTracker subclass. Fake tensors carry shapes, dtypes and devices but no data, so a 1B model
    costs nothing to "allocate" and every kernel is replaced by its shape function; the tracker
    still sees every storage come and go. The result has the categories (parameters, gradients,
    optimizer, activations, other) and per-phase peaks of ``summary.json``'s ``memory`` section.
    A technique changes the estimate exactly as it changes a run, because it *is* the run's code.

    Two steps run (like a real run tracked with ``measure.memory_steps=all``): step 0 creates the
    AdamW state in its optimizer phase (while the gradients are still alive), step 1 is the
    steady state with optimizer state alive through forward and backward. With gradient
    accumulation, two micro-batches per step are enough: from the second on, every micro-batch
    repeats the same memory (gradients exist during its forward).

The model
    Built on the ``meta`` device (``torch.device("meta")``), PEFT applied there (PEFT cannot
    swap in parameters created inside fake mode), then every parameter and buffer is replaced by
    a fake CPU tensor of the same shape, dtype and ``requires_grad`` (tied weights stay tied).
    ``model=tiny`` is built from its sizes; ``model=hf`` from its config only (``AutoConfig``:
    a hub name, a local directory or a ``config.json``); ``config_overrides`` change any field of
    the HF config (``hidden_size=2048`` ...). No weights are ever read or allocated.

The batch (worst case)
    Synthetic rows of the right lengths go through the method's own ``collate`` (and, for
    packing, the packing strategy's own ``apply``), so shapes cannot drift from real runs:
    padded: ``[batch_size, L]``; padding-free / packed: one ``[1, batch_size * L]`` row whose
    documents restart position_ids (``docs_per_row`` documents per packed row, default 1: the
    worst case for per-document attention). ``L`` = ``method.max_length`` unless ``length`` is
    given or ``from_data`` finds a shorter longest row in the real prepared data.

Data-dependent decisions
    A few decisions of the forward read *values* (is the padding mask all ones? where do the
    documents of a packed row start?). Transformers treats fake inputs as tracing and always
    materialises a full mask; memlab's varlen attention cannot split a fake row. Because the
    estimator built the batch itself it knows the real values: with ``exact_masks`` (default)
    those few functions are evaluated on the real (small, integer) batch tensors, so the fake
    step takes the same branches as the real one. ``exact_masks=False`` measures what the
    discrepancy would be (a materialised [B, 1, L, L] mask for unpadded batches).

Online methods (generation)
    A method that samples its training batches (``rollout``) runs its ``generate`` phase on
    fake tensors too: the model's own ``generate`` for exactly the maximum number of new tokens
    on every row (its stop check reads a value; here it reads the length), then the method's
    own ``training_batch`` (reference / value passes, advantages) and loss. Reward functions,
    which read decoded text, are not run (zero rewards change no shape), and host-side counts
    of valid tokens answer "all" (:func:`worst_case_generation`).

Devices
    torch's CPU build has no fake CUDA tensors, so the step runs CPU kernels' shape functions
    (e.g. CPU sdpa = flash-attention-style, no [L, L] scores). ``device='cuda'`` is a *model*,
    not a measurement: every tracked allocation is rounded up to 512 bytes (the CUDA caching
    allocator's block size), the cuBLAS workspace is added to "other", AdamW runs its foreach
    implementation (CUDA's default, which keeps extra whole-model temporaries in the optimizer
    phase), CUDA-only attention backends run as sdpa, QLoRA's packed 4/8-bit base weights are
    computed analytically (bitsandbytes is not needed), and the configuration is validated as a
    CUDA run. The CUDA context (~0.3-0.6 GiB outside PyTorch's allocator) and allocator
    fragmentation are not in the peak; the verdict reports the context separately.

Distributed
    ``world_size`` / ``zero_stage`` post-process the categories: stage 1 divides optimizer
    state, stage 2 also gradients, stage 3 / FSDP also parameters by the world size (plus the
    gathered parameters of two layers in forward/backward); stage 0 with world > 1 is DDP, whose
    gradient buckets add one gradient-sized buffer. Stated in ``assumptions`` of every result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from memlab.measure.memory import CATEGORIES

GiB = 1024**3
MiB = 1024**2
PHASES = ("forward", "backward", "optimizer")
ALL_PHASES = ("generate", *PHASES)  # generate: online methods only

CUDA_BLOCK = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes."""

CARDS: dict[str, dict[str, Any]] = {
    # total memory as nvidia-smi reports it (MiB), compute capability major version
    "t4": {"name": "NVIDIA T4 16GB", "mib": 15360, "sm": 7},
    "a10g": {"name": "NVIDIA A10G 24GB", "mib": 23028, "sm": 8},
    "l4": {"name": "NVIDIA L4 24GB", "mib": 23034, "sm": 8},
    "rtx4090": {"name": "NVIDIA GeForce RTX 4090 24GB", "mib": 24564, "sm": 8},
    "a100-40gb": {"name": "NVIDIA A100 40GB", "mib": 40960, "sm": 8},
    "a100-80gb": {"name": "NVIDIA A100 80GB", "mib": 81920, "sm": 8},
    "h100-80gb": {"name": "NVIDIA H100 80GB", "mib": 81559, "sm": 9},
    "h200": {"name": "NVIDIA H200 141GB", "mib": 143771, "sm": 9},
}
"""Cards ``--card`` knows: usable memory as ``nvidia-smi`` shows it."""

CUDA_CONTEXT_BYTES = 512 * MiB
"""CUDA context + loaded kernels, outside PyTorch's allocator (varies 0.3-0.6 GiB with driver,
architecture and libraries). Counted in the verdict, not in the allocator peak."""


def cublas_workspace_bytes(sm_major: int = 8) -> int:
    """torch's default cuBLAS workspace: ``:4096:8`` (32 MiB) on Hopper, else ``:4096:2:16:8``."""
    return 4096 * 1024 * 8 if sm_major == 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


class EstimateError(RuntimeError):
    """The configuration cannot be estimated (the message says why and what to do)."""


@dataclass(kw_only=True)
class EstimateOptions:
    """How to estimate (everything else comes from the composed configuration)."""

    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: the tracker's byte-exact CPU peak; cuda: the CUDA model described in the module
    docstring (validated as a CUDA run)."""
    card: str | None = None
    """A key of :data:`CARDS` (sets the budget and the cuBLAS workspace size)."""
    budget_bytes: int | None = None
    """Memory available per device; None = the card's, or no verdict."""
    world_size: int = 1
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage (3 = FSDP full shard) applied to the categories when world_size > 1."""
    length: int | None = None
    """Tokens per row; None = method.max_length (or the longest real row with from_data)."""
    from_data: bool = False
    """Load and prepare the real data and use its longest row if shorter than max_length."""
    docs_per_row: int = 1
    """Documents per packed row (position_ids restart at each)."""
    exact_masks: bool = True
    """Evaluate value-dependent mask / document-split decisions on the real batch (see module
    docstring); False keeps transformers' fake-tensor (tracing) behaviour."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """HF config fields to change (``hidden_size``, ``num_hidden_layers``, ...)."""
    run_first_step: bool = False
    """Run (and track) step 0 as well. Default: the optimizer state is created by the
    optimizer's own ``step`` on fake zero gradients, then only the steady-state step 1 runs
    (half the time; step 0 never peaks higher: it has no optimizer state in forward/backward
    and the same gradients + state + temporaries in its optimizer phase as step 1)."""


# ----------------------------------------------------------------------------- configuration


@contextlib.contextmanager
def _pretend_cuda():
    """Validate a configuration as a CUDA run on a machine without CUDA: torch reports a bf16
    capable device and GPU-only extras (flash-attn, bitsandbytes, ...) count as installed.
    Only :func:`memlab.run.validate` runs inside; nothing is built here."""
    import memlab._guards as guards

    gpu_only = {m for m, extra in guards.EXTRAS.items() if extra.startswith("gpu")}
    saved = (torch.cuda.is_available, torch.cuda.is_bf16_supported, guards.has)
    orig_has = guards.has
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.is_bf16_supported = lambda *a, **k: True  # type: ignore[assignment]
    guards.has = lambda module: module in gpu_only or orig_has(module)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.is_bf16_supported, guards.has = saved


def validate_for(cfg, device: str, choices: dict[str, str] | None = None):
    """:func:`memlab.run.validate` of ``cfg`` as a run on ``device`` (cpu | cuda)."""
    from omegaconf import OmegaConf, open_dict

    from memlab.run import validate

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)) if OmegaConf.is_config(
        cfg) else OmegaConf.create(dict(cfg))
    with open_dict(cfg):
        cfg.train.device = device
        cfg.measure.memory = True
    if device == "cuda" and not torch.cuda.is_available():
        with _pretend_cuda():
            return validate(cfg, ".", choices)
    return validate(cfg, ".", choices)


class _ModelFromConfig:
    """Stands in for the ``model`` group while estimating: the same model class, attention
    backend and dtype as the group's ``load`` (via ``load_kwargs``), built from its *config*
    only (tiny: its sizes; hf: ``AutoConfig``), on whatever device context is active (meta)."""

    def __init__(self, inner, overrides: dict[str, Any], notes: list[str]):
        self.inner = inner
        self.overrides = dict(overrides)
        self.notes = notes
        self.name = getattr(inner, "name", "?")
        self.hf: Any = None

    def with_overrides(self, model_overrides: dict[str, Any]) -> _ModelFromConfig:
        """Another model of the same group (a GKD teacher of another size)."""
        return _ModelFromConfig(dataclasses.replace(self.inner, **model_overrides),
                                self.overrides, self.notes)

    def load_tokenizer(self, ctx):
        try:
            return self.inner.load_tokenizer(ctx)
        except Exception as e:  # noqa: BLE001 - offline hub model: the ids do not matter
            from memlab.data.assets import load_tokenizer

            self.notes.append(f"tokenizer of the model unavailable ({type(e).__name__}); "
                              "memlab's shipped tokenizer builds the synthetic batch (token ids "
                              "do not change memory)")
            return load_tokenizer(None)

    def config(self, tokenizer):
        if self.hf is not None:
            return self.hf
        if hasattr(self.inner, "hf_config"):
            cfg = self.inner.hf_config(tokenizer)
        else:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(
                self.inner.name_or_path, revision=self.inner.revision,
                trust_remote_code=self.inner.trust_remote_code,
                local_files_only=self.inner.local_files_only,
            )
        for k, v in self.overrides.items():
            if not hasattr(cfg, k):
                raise EstimateError(f"model config has no field {k!r} (config class "
                                    f"{type(cfg).__name__}); check --set {k}=...")
            setattr(cfg, k, v)
        cfg.use_cache = False
        self.hf = cfg
        return cfg

    def load(self, ctx, tokenizer, head, extra: dict[str, Any]) -> nn.Module:
        from memlab.model.base import auto_class, finish_load, load_kwargs

        quant = extra.pop("memlab_quantized", None)
        kw = load_kwargs(ctx, extra)
        cfg = self.config(tokenizer)
        if head == "seq_cls" and "num_labels" not in self.overrides:
            cfg.num_labels = 1  # as model=hf passes num_labels=1 to from_pretrained
        model = auto_class(head).from_config(cfg, **kw)
        if quant is not None:
            quantize_standin(model, quant)
        return finish_load(model, tokenizer, head)


class _QuantizedPeft:
    """Stands in for ``peft=qlora`` while estimating: the base is quantized by
    :func:`quantize_standin` instead of bitsandbytes; adapters come from the real
    ``apply`` (``prepare_model_for_kbit_training`` + LoRA)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def load_kwargs(self, ctx) -> dict[str, Any]:
        return {"memlab_quantized": self.inner}

    def apply(self, model, ctx, task):
        return self.inner.apply(model, ctx, task)

    def has_adapter(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self.inner, name)


# ----------------------------------------------------------------------------- quantized base


class _DequantMatmul(torch.autograd.Function):
    """``x @ dequant(W).T`` as bitsandbytes computes it: the dequantized weight is a temporary
    in forward and again in backward; nothing but the packed weight is kept for backward."""

    @staticmethod
    def forward(ctx, x, packed, shape, bias):  # type: ignore[override]
        w = torch.empty(shape, dtype=x.dtype, device=x.device)
        ctx.shape = shape
        return nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        w = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return grad @ w, None, None, None


class QuantizedLinearStandin(nn.Linear):
    """A frozen linear layer whose weight is stored like bitsandbytes stores it.

    4-bit (NF4/FP4): ``uint8 [ceil(out*in / 2), 1]`` (``Params4bit``), plus the quantization
    state (absmax per 64-weight block: fp32, or with double quantization uint8 per block + fp32
    per 256 blocks + two 256-entry code books) as a buffer. 8-bit (LLM.int8): ``int8 [out, in]``
    plus fp32 ``SCB`` per output row. Forward casts the input to the compute dtype and
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
            qbytes = (blocks + math.ceil(blocks / 256) * 4 + 2 * 256 * 4 if double_quant
                      else blocks * 4)
        else:
            w = torch.empty((base.out_features, base.in_features), dtype=torch.int8, device=dev)
            qbytes = base.out_features * 4
        self.weight = nn.Parameter(w, requires_grad=False)
        self.register_buffer("quant_state", torch.empty(qbytes, dtype=torch.uint8, device=dev),
                             persistent=False)
        self.bias = base.bias
        self.logical_numel = n
        self.compute_dtype = compute_dtype

    def forward(self, x):
        inp = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _DequantMatmul.apply(x, self.weight, (self.out_features, self.in_features),
                                    bias).to(inp)


def quantize_standin(model: nn.Module, qcfg) -> int:
    """Replace every linear layer bitsandbytes would quantize (all but the output head, tied
    and last modules: transformers' ``get_keys_to_not_convert``) with
    :class:`QuantizedLinearStandin`. Returns how many were replaced."""
    from transformers.quantizers.base import get_keys_to_not_convert

    skip = set(get_keys_to_not_convert(model))
    bits = int(getattr(qcfg, "bits", 4))
    compute = getattr(torch, getattr(qcfg, "compute_dtype", "bfloat16")) if bits == 4 \
        else torch.float16
    double = bool(getattr(qcfg, "double_quant", True))
    todo = []
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and not any(
                name == k or name.endswith("." + k) or name.startswith(k + ".") for k in skip):
            todo.append(name)
    for name in todo:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinearStandin(getattr(parent, child), bits, double,
                                                      compute))
    if hasattr(model, "config"):
        model.is_loaded_in_4bit = bits == 4
        model.is_loaded_in_8bit = bits == 8
    return len(todo)


# ----------------------------------------------------------------------------- fake parameters


def fakeify(model: nn.Module, fake_mode) -> nn.Module:
    """Replace every parameter and buffer (meta or real) by a fake CPU tensor of the same
    shape / dtype / requires_grad. Tied parameters stay tied. Allocates nothing."""
    memo: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(fake_of(p), requires_grad=p.requires_grad)
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = fake_of(b)
            mod._buffers[name] = memo[id(b)]
    return model


# ----------------------------------------------------------------------------- the batch


def _token_rows(lengths: list[int], token: int) -> list[dict[str, list[int]]]:
    """Prepared SFT-style rows (``input_ids`` + per-document shifted ``labels``); every token
    trains (the worst case: the loss covers all of them)."""
    from memlab.method.base import shifted_labels

    rows = []
    for n in lengths:
        ids = [token] * n
        rows.append({"input_ids": ids, "labels": shifted_labels(ids, [1] * n)})
    return rows


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _longest_real_row(ctx, tokenizer) -> int:
    from memlab.pipeline import prepare_data

    ds, _ = prepare_data(ctx, tokenizer)
    col = "input_ids" if "input_ids" in ds.column_names else None
    if col is None:
        raise EstimateError("from_data needs prepared rows with input_ids (method=sft-style)")
    return max(len(x) for x in ds[col])


def synthetic_rows(ctx, tokenizer, length: int, docs_per_row: int = 1
                   ) -> tuple[list[dict], str]:
    """The worst-case prepared rows of one micro-batch (what ``method.collate`` gets): for
    SFT-style methods ``batch_size`` rows of ``length`` tokens (packed by the packing strategy's
    own ``apply``); otherwise generated rows of the method's data kind through its own
    ``prepare``; a method may define ``estimate_rows(length, n, tokenizer, ctx)``."""
    import datasets

    from memlab.method.base import DataStats

    method, packing, bs = ctx.method, ctx.packing, ctx.train.batch_size
    rows_for = getattr(method, "estimate_rows", None)
    token = min(100, len(tokenizer) - 1)
    if callable(rows_for):
        return rows_for(length, bs, tokenizer, ctx), "method.estimate_rows"
    if "input_ids" not in _prepared_columns(method):
        rows = _generic_rows(ctx, tokenizer, length)
        return rows, (f"{len(rows)} longest generated {ctx.method.data_kinds[0]} rows through "
                      f"method.prepare (max_length={length})")
    if packing.name == "none":
        return _token_rows([length] * bs, token), f"{bs} rows of {length} tokens"
    docs = [n for _ in range(bs) for n in _split(length, docs_per_row)]
    ds = datasets.Dataset.from_list(_token_rows(docs, token))
    ds, _ = packing.apply(ds, DataStats(rows=len(ds), examples=len(ds)), ctx)
    rows = [ds[i] for i in range(min(bs, len(ds)))]
    while len(rows) < bs:
        rows.append(rows[len(rows) % len(ds)])
    return rows, (f"{bs} packed rows of {length} tokens, {docs_per_row} document(s) each "
                  f"(packing={packing.name})")


def describe_batch(batch, ctx, rows_desc: str, length: int) -> dict[str, Any]:
    return {
        "rows": rows_desc,
        "shapes": {k: list(v.shape) for k, v in batch.tensors.items()},
        "tokens": int(batch.total_tokens),
        "real_tokens": int(batch.real_tokens),
        "length": int(length),
        "batch_size": int(ctx.train.batch_size),
        "collate": "padding-free (one flat row)" if _is_flat(ctx) else "padded",
    }


def _prepared_columns(method) -> set[str]:
    """Columns the method's prepared rows carry: SFT-style methods train on input_ids/labels."""
    cols = getattr(method, "prepared_columns", None)
    if cols:
        return set(cols)
    return {"input_ids", "labels"} if getattr(method, "supports_packing", False) else set()


def _is_flat(ctx) -> bool:
    flat = getattr(ctx.method, "flat", None)
    if callable(flat):
        return bool(flat(ctx))
    return bool(getattr(ctx.method, "padding_free", False))


def _generic_rows(ctx, tokenizer, length: int) -> list[dict]:
    """Any method: generated rows of its data kind around ``length`` tokens through its own
    ``prepare`` (format, tokenize, truncate or drop); the ``batch_size`` longest prepared rows
    (repeated if fewer survive)."""
    import datasets

    from memlab.data import synthetic

    kind = ctx.method.data_kinds[0]
    gen = {"chat": synthetic.generate_chat, "text": synthetic.generate_text,
           "preference": synthetic.generate_preference}[kind]
    bs = ctx.train.batch_size
    parts = []
    for median in (2 * length, length):  # longer than max_length (truncated) and around it
        raw = datasets.Dataset.from_list(gen(max(32, 4 * bs), seed=0, median_tokens=median,
                                             max_tokens=4 * length, sigma=0.3))
        part, _ = ctx.method.prepare(raw, tokenizer, ctx)
        if len(part):
            parts.append(part)
    if not parts:
        raise EstimateError(f"method={ctx.method.name} kept none of the generated rows at "
                            f"length {length}; pass --length")
    from memlab.method.base import generates

    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ids = [c for c in ds.column_names if c.endswith("_ids") or c == "input_ids"]
    if generates(ctx.method) and "prompt_ids" in ids:  # completions come from generation
        ids = ["prompt_ids"]
    size = [sum(len(ds[i][c]) for c in ids) for i in range(len(ds))]
    order = sorted(range(len(ds)), key=lambda i: -size[i])[:bs]
    rows = [ds[i] for i in order]
    while len(rows) < bs:
        rows.append(rows[len(rows) % len(order)])
    return rows


# ----------------------------------------------------------------------------- value hooks


def _candidates(real: dict[str, torch.Tensor], suffix: str, fake: Any) -> list[torch.Tensor]:
    """The batch's real tensors named ``*suffix`` that ``fake`` can be (same shape, or the same
    after ``expand``, as transformers does with position_ids)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not isinstance(fake, torch.Tensor):
        return []
    out = []
    with unset_fake_temporarily():
        for name, r in real.items():
            if not name.endswith(suffix):
                continue
            if tuple(r.shape) == tuple(fake.shape):
                out.append(r)
            elif r.dim() == fake.dim():
                try:
                    out.append(r.expand(tuple(fake.shape)))
                except RuntimeError:
                    pass
    return out


def _same(values: list[Any]) -> bool:
    first = values[0]
    for v in values[1:]:
        if isinstance(first, torch.Tensor) or isinstance(v, torch.Tensor):
            if not (isinstance(first, torch.Tensor) and isinstance(v, torch.Tensor)
                    and first.shape == v.shape and torch.equal(first, v)):
                return False
        elif v != first:
            return False
    return True


_MISSING = object()


@contextlib.contextmanager
def _patching():
    """``with _patching() as patch: patch(obj, name, value)``: set attributes for the block;
    each is restored on exit (removed where ``obj`` itself had none)."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, value)

    try:
        yield patch
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


@contextlib.contextmanager
def exact_value_hooks(real: dict[str, torch.Tensor], fake_mode, notes: list[str]):
    """Evaluate the forward's few value-dependent decisions on the real batch tensors (see the
    module docstring): transformers' causal-mask skip and packed-sequence detection, and
    memlab's per-document attention split. The fake argument is matched to the batch tensors of
    the same kind (``*attention_mask`` / ``*position_ids``) and shape; when several match and
    disagree, the fake-tensor behaviour (a materialised mask: the larger memory) is kept.
    Scoped: everything is restored on exit."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from transformers import masking_utils as mu

    def decide(orig, suffix, fake, *args, convert=None, **kwargs):
        """orig(real, ...) if every real candidate gives the same answer, else orig(fake)."""
        cands = _candidates(real, suffix, fake)
        if not cands:
            return orig(fake, *args, **kwargs)
        with unset_fake_temporarily():
            answers = [orig(convert(c) if convert else c, *args, **kwargs) for c in cands]
            if not _same(answers):
                return orig(fake, *args, **kwargs)
        ans = answers[0]
        return fake_mode.from_tensor(ans) if isinstance(ans, torch.Tensor) else ans

    orig_find = mu.find_packed_sequence_indices
    orig_skip = mu._ignore_causal_mask_sdpa

    def find_packed(position_ids):
        return decide(orig_find, "position_ids", position_ids)

    def ignore_causal(padding_mask, *args, **kwargs):
        if padding_mask is None:
            return orig_skip(padding_mask, *args, **kwargs)
        return decide(orig_skip, "attention_mask", padding_mask, *args,
                      convert=lambda t: t.bool(), **kwargs)

    with _patching() as patch:
        patch(mu, "find_packed_sequence_indices", find_packed)
        patch(mu, "_ignore_causal_mask_sdpa", ignore_causal)
        _patch_segments(real, patch)
        yield


def _patch_segments(real: dict[str, torch.Tensor], patch) -> None:
    """memlab's per-document attention split, decided on the real batch's position_ids."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        from memlab.attention import _varlen
    except ImportError:
        _varlen = None
    if _varlen is not None and hasattr(_varlen, "_segments"):
        orig_seg = _varlen._segments

        def segments(position_ids):
            cands = _candidates(real, "position_ids", position_ids)
            if not cands:  # no position_ids in the batch: the model counts 0..n-1 per row
                n = position_ids.shape[-1]
                return [[(0, n)] for _ in range(position_ids.shape[0])]
            with unset_fake_temporarily():
                answers = [orig_seg(c) for c in cands]
            if not _same(answers):
                raise EstimateError("several packed rows of this shape split into documents "
                                    "differently; set attention.varlen=false to estimate")
            return answers[0]

        patch(_varlen, "_segments", segments)


@contextlib.contextmanager
def _offload_accepts_fake():
    """Let memlab's activation offloader work on fake tensors while estimating: it keys tensors
    by storage data pointer (fake storages all report 0: keyed by storage identity here, same
    meaning for live objects) and leaves tensor subclasses alone (fake tensors count as plain
    tensors here). Scoped; restored on exit."""
    try:
        from memlab.offload import hooks
    except ImportError:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    saved = (hooks._storage_key, hooks.Tensor)
    hooks._storage_key = lambda t: (str(t.untyped_storage().device), id(t.untyped_storage()))
    hooks.Tensor = FakeTensor
    try:
        yield
    finally:
        hooks._storage_key, hooks.Tensor = saved


class _HostStandin:
    """Offload storage for estimates: the host copy is a fake tensor on the ``meta`` device, so
    the tracker books it under another device than the (cpu-standing-for-GPU) device memory."""

    def offload(self, tensor):
        return torch.empty_like(tensor, device="meta")

    def reload(self, handle, device):
        return torch.empty_like(handle, device=device)


# ----------------------------------------------------------------------------- generation


def _new_tokens(method) -> int:
    return int(getattr(method, "max_completion_length", None)
               or getattr(method, "max_new_tokens", 0))


def _worst_case_rollout_tensors(method, real: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The real values of the worst-case generated training batch (every completion runs to its
    full length): the candidates :func:`exact_value_hooks` evaluates the training forward's mask
    decisions on, as it does for collated batches."""
    from memlab.method._online import join

    if "prompt_ids" not in real:
        return {}
    g = int(getattr(method, "num_generations", 1) or 1)
    prompt = real["prompt_ids"].repeat_interleave(g, 0)
    pmask = real["prompt_mask"].repeat_interleave(g, 0)
    comp = torch.zeros(prompt.shape[0], _new_tokens(method), dtype=torch.long)
    t = join(prompt, pmask, comp, torch.ones_like(comp))
    return {f"rollout_{k}": v for k, v in t.items()}


class _NoDraw:
    """``random.Random`` stand-in whose draws are 0.0: GKD's draw picks on-policy sampling."""

    def random(self) -> float:
        return 0.0


@contextlib.contextmanager
def worst_case_generation(method, notes: list[str]):
    """Online methods on fake tensors: the generate phase runs the model's real ``generate``
    (prefill, KV cache, sampling) for exactly the maximum number of new tokens on every row
    (no early EOS: the worst case; the loop's stop check reads a value, here it reads the
    length instead); reward functions are not called (they read decoded text; rewards are
    zeros, which changes no shape); host-side counts of valid tokens answer "all of them".
    Everything after - the reference / value passes of ``advantages_for``, the join into
    ``[prompts x generations, prompt + completion]`` rows, the losses - is the method's own code.
    Scoped: everything is restored on exit."""
    from transformers.generation import utils as gen_utils
    from transformers.utils import logging as hf_logging

    from memlab.method import _online

    state = {"stop_at": 0}
    orig_generate = _online._generate

    def generate(model, **kwargs):
        state["stop_at"] = kwargs["input_ids"].shape[1] + kwargs["max_new_tokens"]
        return orig_generate(model, **kwargs)

    def stop(self, unfinished, tokens, length):
        return length >= state["stop_at"]

    def score(self, batch, comp, cmask, finished, models=None, ctx=None):
        # reward models read re-tokenized text: run them on prompt + completion tokens
        n = comp.shape[0]
        width = batch.tensors["prompt_ids"].shape[1] + comp.shape[1]
        for i in range(len(getattr(self, "reward_models", ()) or ())):
            ids = torch.zeros(n, width, dtype=torch.long, device=comp.device)
            with torch.no_grad():
                models[f"reward_model_{i}"](input_ids=ids, attention_mask=torch.ones_like(ids))
        return torch.zeros(n, dtype=torch.float32), {}

    n = _new_tokens(method)
    notes.append(f"generation: every completion runs to {n} new tokens (no early EOS), with "
                 "the model's own generate (KV cache, sampling); the training batch is the "
                 "prompts x completions it makes; reward functions are not run (they read "
                 "text and allocate no device memory); reward models score prompt + completion "
                 "tokens (the real run re-tokenizes the text, which may differ in length)")
    if getattr(method, "lmbda", 0) > 0:
        notes.append("gkd: the on-policy path (the student samples); a step on the dataset's "
                     "own completions is estimated with method.lmbda=0")
    # generate's sanity warnings read token values (answered without them): not the user's
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with _patching() as patch:
            patch(_online, "_generate", generate)
            patch(gen_utils.StopCheck, "__call__", stop)
            patch(_online.Online, "score", score)
            patch(_online, "count", lambda mask: mask.numel())
            if hasattr(method, "lmbda"):  # GKD: on-policy (the student samples) if lmbda > 0
                patch(method, "_rng", _NoDraw())
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


# ----------------------------------------------------------------------------- the tracker


def _estimate_tracker(round_to: int = 0):
    """The run's tracker class, optionally rounding each storage up to ``round_to`` bytes
    (the CUDA caching allocator's 512-byte blocks) while the fake tensors live on the CPU."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _UpdateType

    from memlab.measure.memory import _tracker_class

    base = _tracker_class()

    class EstimateTracker(base):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state) -> None:
            # Only the global peak (what MemoryProbe reads). MemTracker also keeps a per-module
            # peak, walking every tracked module after every op: 2/3 of the time of a 1B
            # estimate, and memlab never reads it.
            for dev, snap in self._curr_mem_snap.items():
                total = snap[_TOTAL_KEY]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)

        if round_to:
            def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
                if u_type in (_UpdateType.ADD, _UpdateType.SIZE):
                    raw = winfo.size * winfo.element_size
                    winfo.mem_consumed = math.ceil(raw / round_to) * round_to if raw > 0 else 0
                return super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    return EstimateTracker()


# ----------------------------------------------------------------------------- the estimate


def _param_info(model: nn.Module) -> dict[str, Any]:
    total = trainable = 0
    by_dtype: dict[str, int] = {}
    quant = 0
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, QuantizedLinearStandin):
            quant += 1
            total += mod.logical_numel
            key = f"{'uint8(4-bit)' if mod.weight.dtype == torch.uint8 else 'int8'}"
            by_dtype[key] = by_dtype.get(key, 0) + mod.weight.numel() * mod.weight.element_size()
            seen.add(id(mod.weight))
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
        key = str(p.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
    out = {"total": int(total), "trainable": int(trainable), "bytes_by_dtype": by_dtype}
    if quant:
        out["quantized_linears"] = quant
    return out


def _hf_summary(cfg) -> dict[str, Any]:
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    return {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}


def _fake_mode():
    """A FakeTensorMode that answers the value reads a training step makes *after* the
    decisions :func:`exact_value_hooks` resolves from the real batch - in practice loss values
    and logging metrics: a floating scalar read (``float(t)``, ``.item()``, ``.tolist()``) gives
    NaN, a boolean read gives True, and a data-dependent shape (``nonzero``, boolean indexing,
    ``masked_select``) keeps every element (the upper bound). Integer reads still fail. The
    answers are counted in ``mode.assumed`` and reported."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten

    class EstimateFakeMode(FakeTensorMode):
        assumed: dict[str, int]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten._local_scalar_dense.default:
                x = args[0]
                if x.is_floating_point() or x.dtype == torch.bool:
                    kind = "float reads (NaN)" if x.is_floating_point() else \
                        "boolean reads (True)"
                    self.assumed[kind] = self.assumed.get(kind, 0) + 1
                    return float("nan") if x.is_floating_point() else True
            if func in (aten.nonzero.default, aten.masked_select.default):
                key = "data-dependent shapes (all elements kept)"
                self.assumed[key] = self.assumed.get(key, 0) + 1
                x = args[0]
                if func is aten.nonzero.default:
                    shape, dtype = (x.numel(), x.dim()), torch.long
                else:
                    shape = (torch.broadcast_shapes(x.shape, args[1].shape).numel(),)
                    dtype = x.dtype
                return super().__torch_dispatch__(
                    aten.empty.memory_format, types, (shape,),
                    {"dtype": dtype, "device": x.device})
            return super().__torch_dispatch__(func, types, args, kwargs)

    mode = EstimateFakeMode()
    mode.assumed = {}
    return mode


@contextlib.contextmanager
def _skip_weight_checks():
    """Checks that compare weight *values* (a DPO / KTO reference must equal the initial policy)
    cannot run on fake tensors; they are skipped while estimating (the check runs in real runs)."""
    try:
        from memlab.method import _preference
    except ImportError:
        yield
        return
    orig = _preference.check_same_weights
    _preference.check_same_weights = lambda policy, reference: 0
    try:
        yield
    finally:
        _preference.check_same_weights = orig


def run_fake_step(ctx, opts: EstimateOptions, notes: list[str]) -> dict[str, Any]:
    """Build the configured models, method and optimizer on fake tensors and run the tracked
    training step(s) through :meth:`Trainer.run_step`; returns the raw probe result plus model /
    batch descriptions. ``ctx`` is the validated context (its device is replaced by cpu)."""
    import datasets

    from memlab.method.base import generates
    from memlab.pipeline import load_model
    from memlab.trainer.loop import Trainer

    cuda = opts.device == "cuda"
    model_standin = _ModelFromConfig(ctx.model, opts.config_overrides, notes)
    groups: dict[str, Any] = {"model": model_standin}
    if getattr(ctx.peft, "name", "") == "qlora":
        groups["peft"] = _QuantizedPeft(ctx.peft)
        notes.append("qlora: base linear weights stored as bitsandbytes packs them (4-bit: "
                     "n/2 bytes + absmax state; 8-bit: n bytes + row scales), computed "
                     "analytically; dequantized weights are temporaries in forward and backward")
    if not (ctx.attention.trains_on_cpu and "cpu" in ctx.attention.devices):
        from memlab.registry import lookup

        groups["attention"] = lookup("attention", "sdpa")()
        notes.append(f"attention={ctx.attention.name} is CUDA-only: estimated with per-document "
                     "sdpa (no [L, L] scores, per-document in packed rows, as flash attention)")
    bctx = dataclasses.replace(ctx, device="cpu", **groups)
    tokenizer = model_standin.load_tokenizer(bctx)

    online = generates(ctx.method)
    length = opts.length or getattr(ctx.method, "max_length", None)
    if online and not opts.length and getattr(ctx.method, "max_prompt_length", None):
        length = ctx.method.max_prompt_length  # the prompts; completions come from generation
    if length is None:
        raise EstimateError("method.max_length is null: give the row length with --length N "
                            "(or set method.max_length)")
    if opts.from_data:
        longest = _longest_real_row(bctx, tokenizer)
        if longest < length:
            notes.append(f"from_data: the longest prepared row has {longest} tokens "
                         f"(< {length}); estimated at {longest}")
            length = longest
    rows, rows_desc = synthetic_rows(bctx, tokenizer, length, opts.docs_per_row)
    real_tensors = dict(bctx.method.collate(rows, tokenizer, bctx).tensors)
    if online:
        real_tensors.update(_worst_case_rollout_tensors(bctx.method, real_tensors))

    fake_mode = _fake_mode()
    meta_ctx = dataclasses.replace(bctx, device="meta")

    def build(model_overrides: dict | None = None, trainable: bool = True, **kw):
        from memlab.pipeline import with_model_overrides

        with torch.device("meta"):
            m = load_model(with_model_overrides(meta_ctx, model_overrides), tokenizer,
                           trainable=trainable, **kw)
        return fakeify(m, fake_mode)

    hooks = (lambda: exact_value_hooks(real_tensors, fake_mode, notes)) if opts.exact_masks \
        else contextlib.nullcontext
    t0 = time.perf_counter()
    policy = build()
    build_s = time.perf_counter() - t0
    with _offload_accepts_fake():
        offload_handle = bctx.offload.build(policy, bctx)
    if offload_handle is not None and hasattr(offload_handle, "storage"):
        offload_handle.storage = _HostStandin()
    with _skip_weight_checks():
        extra = bctx.method.extra_models(
            policy, bctx, lambda overrides=None, head=None, trainable=False:
            build(overrides, trainable=trainable, head=head, peft=False))
    models = {"policy": policy, **extra}
    built = sorted(extra)
    # the method's one-off pass (e.g. DPO's precomputed reference log-probs) over these rows,
    # untracked, as the pipeline runs it before training (values are NaN; shapes are right)
    with fake_mode, hooks():
        prepared = bctx.method.before_training(models, datasets.Dataset.from_list(rows), bctx)
    if prepared is not None:
        rows = [prepared[i] for i in range(len(prepared))]
        notes.append("method.before_training ran on the synthetic rows (untracked, as before "
                     f"step 0); models kept for training: {', '.join(sorted(models))}")

    def make_batch():
        b = bctx.method.collate(rows, tokenizer, bctx)
        b.tensors = {k: fake_mode.from_tensor(v) for k, v in b.tensors.items()}
        return b

    micro = min(max(1, ctx.train.grad_accum), 2)
    batches = [make_batch() for _ in range(micro)]
    if ctx.train.grad_accum > 2:
        notes.append(f"grad_accum={ctx.train.grad_accum} estimated with 2 micro-batches per "
                     "step (from the second on, every micro-batch repeats the same memory)")

    trainer = Trainer(bctx, bctx.method, models, None, logger=None,
                      offload_handle=offload_handle)
    trainer.probe.tracker = _estimate_tracker(CUDA_BLOCK if cuda else 0)
    if trainer.scaler is not None:
        trainer.scaler = None
        notes.append("fp16 loss scaling (GradScaler) is left out: a few scalars")
    if cuda and ctx.train.optimizer == "adamw":
        for group in trainer.opt.param_groups:
            group["foreach"] = True
    for m in models.values():
        m.train(m is policy)

    t1 = time.perf_counter()
    if ctx.train.steps == 1 or opts.run_first_step:
        step_ids = list(range(min(2, ctx.train.steps)))
    else:
        step_ids = [1]
        with fake_mode:  # step 0's optimizer update, by the optimizer itself: creates its state
            for p in trainer.params:
                p.grad = torch.zeros_like(p)
            trainer.opt.step()
            trainer.opt.zero_grad(set_to_none=True)
    generation = (lambda: worst_case_generation(bctx.method, notes)) if online \
        else contextlib.nullcontext
    try:
        with fake_mode, hooks(), _offload_accepts_fake(), generation():
            for step in step_ids:
                trainer.step_idx = step
                trainer.run_step(batches, tracked=True)
    except (torch._subclasses.fake_tensor.DataDependentOutputException,
            torch._subclasses.fake_tensor.DynamicOutputShapeException) as e:
        raise EstimateError(
            f"the training step reads tensor values ({e}); the estimator resolves only the "
            "value-dependent decisions it knows (masks, document splits): add a hook in "
            "memlab.measure.estimate.exact_value_hooks for this one") from e
    step_s = time.perf_counter() - t1
    if fake_mode.assumed:
        notes.append("value reads answered without values (metrics, logging): " + ", ".join(
            f"{n} {k}" for k, n in sorted(fake_mode.assumed.items())))
    raw = trainer.probe.result()
    offload = None
    if offload_handle is not None and hasattr(offload_handle, "stats"):
        offload = offload_handle.stats()
    return {
        "raw": raw,
        "offload": offload,
        "model": {**_param_info(policy), "config": _hf_summary(model_standin.config(tokenizer)),
                  "shard_units": shard_units(policy), "extra_models": built,
                  "models_in_training": sorted(models)},
        "batch": {**describe_batch(batches[0], bctx, rows_desc, length),
                  "micro_batches_per_step": micro, "grad_accum": ctx.train.grad_accum},
        "timing": {"build_s": build_s, "steps_s": step_s, "steps": step_ids},
    }


# ----------------------------------------------------------------------------- post-processing


def _deepspeed_info(ds, ctx, stage: int, model: dict[str, Any]) -> dict[str, int]:
    """What :func:`apply_sharding` adds for ``distributed=deepspeed`` (``ds``, the run's option):
    master copy, bucket, weight / gradient bytes, state factor and the live-parameter cap, from
    the model's trainable count and hidden size."""
    bf16 = getattr(ctx.precision, "name", "") == "bf16"
    hidden = int(model.get("config", {}).get("hidden_size") or 4096)
    elems = ds.reduce_bucket_size if ds.reduce_bucket_size is not None else hidden * hidden
    width = 2 if bf16 else 4  # bytes per weight / gradient element
    trainable = int(model["trainable"])
    return {"master_bytes": 4 * trainable if stage >= 1 else 0,
            "weight_bytes": width * trainable, "grad_bytes": width * trainable,
            "bucket_bytes": int(elems) * width if ds.contiguous_gradients and stage >= 1 else 0,
            "state_factor": 2 if bf16 else 1,
            "live_bytes": int(ds.stage3_max_live_parameters) * width}


def shard_units(model: nn.Module) -> dict[str, int]:
    """FSDP / ZeRO-3 wrapping units: each decoder layer (the model's ``_no_split_modules``) and
    the rest (embeddings, head, final norm) as the root unit. Returns the largest unit's
    parameter bytes and trainable (gradient) bytes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]

    def nbytes(params, trainable_only=False):
        seen, total = set(), 0
        for p in params:
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size()
        return total

    sizes = [(nbytes(m.parameters()), nbytes(m.parameters(), True)) for m in layers]
    in_layers = {id(p) for m in layers for p in m.parameters()}
    rest = [p for p in model.parameters() if id(p) not in in_layers]
    sizes.append((nbytes(rest), nbytes(rest, True)))
    return {"units": len(sizes), "largest_bytes": max(s[0] for s in sizes),
            "largest_grad_bytes": max(s[1] for s in sizes)}


def apply_sharding(mem: dict[str, Any], world: int, stage: int,
                   units: dict[str, int] | None = None,
                   notes: list[str] | None = None,
                   bucket_view: bool = False,
                   deepspeed: dict[str, int] | None = None,
                   gather_generation: bool = False) -> dict[str, Any]:
    """Divide what ZeRO / FSDP shard by the world size, per phase; the peak is then the largest
    phase. Stage 3 adds the gathered parameters of the two largest units in forward and backward
    (the current one and the prefetched next); stages 2-3 add one unit of unsharded gradients in
    backward (before its reduce-scatter). Stage 0 with world > 1 is DDP: its gradient buckets
    (allocated when the model is wrapped, resident for the whole run) add one gradient-sized
    buffer; with ``bucket_view`` (``gradient_as_bucket_view=True``) the gradients live inside
    them instead, so gradient memory is the full gradient size in every phase.

    ``deepspeed`` (``distributed=deepspeed``: ``master_bytes``, ``bucket_bytes``,
    ``state_factor``): stages >= 1 add DeepSpeed's fp32 master copy of the rank's slice of the
    trainable weights to the optimizer state and multiply the state by ``state_factor`` (2 when
    bf16 weights get fp32 moments); backward holds its contiguous reduce bucket; stage 0 is
    DeepSpeed's own all-reduce at the boundary, without DDP's resident buckets.

    ``gather_generation`` (stage 3, ``gather_for_generation``): the generate phase holds the
    whole weights gathered beside the rank's shards."""
    notes = notes if notes is not None else []
    if world <= 1 and deepspeed is None:
        return mem
    units = units or {}
    unit_p, unit_g = units.get("largest_bytes", 0), units.get("largest_grad_bytes", 0)
    div = {"optimizer": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    phases = {}
    for ph, snap in (mem.get("by_phase_category") or {}).items():
        new = {k: (math.ceil(v / world) if div.get(k) else v) for k, v in snap.items()}
        if deepspeed is not None:
            if stage >= 3 and ph in ("forward", "backward"):
                # gathered: at least two units in flight, at most stage3_max_live_parameters
                # (all of a model below it: measured, whatever stage3_max_reuse_distance)
                full = snap.get("parameters", 0)
                new["parameters"] += min(full, max(2 * unit_p, deepspeed["live_bytes"]))
            elif stage >= 3 and ph == "generate":  # no backward to reuse them for
                new["parameters"] += min(snap.get("parameters", 0), 2 * unit_p)
            if stage >= 1:
                master = math.ceil(deepspeed["master_bytes"] / world)
                new["optimizer"] = new.get("optimizer", 0) * deepspeed["state_factor"] + master
                if ph == "backward":
                    new["gradients"] += deepspeed["bucket_bytes"]
                if ph == "optimizer":  # the step's fp32 gradient slice, then the all-gather
                    new["optimizer"] += master  # of the updated weights
                    new["activations"] += math.ceil(deepspeed["weight_bytes"] / world)
            if stage >= 3:  # one flat gradient partition, allocated once, resident
                new["gradients"] = max(new["gradients"],
                                       math.ceil(deepspeed["grad_bytes"] / world))
        else:
            if stage == 0:
                full = (mem.get("by_phase_category") or {}).get("optimizer", {}).get(
                    "gradients", 0)
                g = snap.get("gradients", 0)
                new["gradients"] = max(g, full) if bucket_view else g + full
            if stage >= 3 and ph in ("generate", "forward", "backward"):
                new["parameters"] += 2 * unit_p
            if stage >= 2 and ph == "backward":
                new["gradients"] += unit_g
        if stage >= 3 and ph == "generate" and gather_generation:
            full = snap.get("parameters", 0)
            new["parameters"] = math.ceil(full / world) + full
        phases[ph] = new
    if deepspeed is not None:
        notes.append(f"world_size={world}, distributed=deepspeed zero_stage={stage}: "
                     + ("nothing sharded" if stage == 0 else
                        f"{', '.join(k for k in ('optimizer', 'gradients', 'parameters') if div[k])}"
                        f" divided by {world} per rank, plus DeepSpeed's fp32 master copy of the "
                        f"rank's slice ({fmt_bytes(math.ceil(deepspeed['master_bytes'] / world))})"
                        f" in optimizer (and an fp32 gradient slice of that size in the "
                        f"step), its reduce bucket ({fmt_bytes(deepspeed['bucket_bytes'])}) in "
                        f"backward, the all-gather of the updated slice after the step"
                        + ("; stage 3 keeps up to stage3_max_live_parameters gathered in "
                           "forward/backward (at least two units, at most all of them) and one "
                           "flat gradient partition for the whole run"
                           if stage >= 3 else ""))
                     + "; other communication buffers are not modelled")
    elif stage == 0:
        notes.append(f"world_size={world}, zero_stage=0 (DDP): nothing sharded; DDP's gradient "
                     "buckets hold one gradient-sized buffer for the whole run ("
                     + ("gradient_as_bucket_view=True: the gradients live in it)" if bucket_view
                        else "gradient_as_bucket_view=False: beside the gradients)"))
    else:
        what = [k for k in ("optimizer", "gradients", "parameters") if div[k]]
        extra = []
        if stage >= 3:
            extra.append(f"forward/backward gather two units' parameters (2 x "
                         f"{fmt_bytes(unit_p)}; units = decoder layers + the root)")
        if stage >= 2:
            extra.append(f"backward holds one unit's unsharded gradients "
                         f"({fmt_bytes(unit_g)}) before its reduce-scatter")
        notes.append(f"world_size={world}, zero_stage={stage}"
                     + (" (FSDP full shard)" if stage == 3 else "")
                     + f": {', '.join(what)} divided by {world} per rank; "
                     + "; ".join(extra) + ("; " if extra else "")
                     + "activations are per rank (each rank runs its own micro-batch); other "
                       "communication buffers are not modelled")
    by_phase = {ph: sum(s.values()) for ph, s in phases.items()}
    peak_phase = max(by_phase, key=by_phase.get) if by_phase else None
    out = dict(mem)
    out["by_phase_category"] = phases
    out["by_phase"] = {ph: int(by_phase[ph]) for ph in ALL_PHASES if ph in by_phase}
    out["by_category"] = dict(phases[peak_phase]) if peak_phase else mem["by_category"]
    out["peak_bytes"] = int(by_phase[peak_phase]) if peak_phase else mem["peak_bytes"]
    out["peak_at"] = {"step": (mem.get("peak_at") or {}).get("step"), "phase": peak_phase}
    return out


def _padding_mask_note(ctx, batch: dict[str, Any]) -> str | None:
    """What padding would add: the estimate's padded rows are all full length, so sdpa skips
    the attention mask (its causal kernel); a real batch whose rows differ in length also
    materialises a boolean ``[rows, 1, T, T]`` mask (eager builds one either way: estimated)."""
    shape = (batch.get("shapes") or {}).get("input_ids")
    if _is_flat(ctx) or getattr(ctx.attention, "name", "") != "sdpa" or not shape \
            or len(shape) != 2:
        return None
    rows, width = shape
    return (f"padding: these rows are all full length; a batch whose rows differ in length "
            f"also builds a boolean [{rows}, 1, {width}, {width}] attention mask on sdpa: "
            f"+{fmt_bytes(rows * width * width)} while the forward's activations are alive "
            "(not in the peak above)")


def _add_other(mem: dict[str, Any], nbytes: int) -> dict[str, Any]:
    out = dict(mem)
    out["by_category"] = {**mem["by_category"], "other": mem["by_category"]["other"] + nbytes}
    out["by_phase_category"] = {ph: {**s, "other": s.get("other", 0) + nbytes}
                                for ph, s in (mem.get("by_phase_category") or {}).items()}
    out["by_phase"] = {ph: v + nbytes for ph, v in mem["by_phase"].items()}
    out["peak_bytes"] = mem["peak_bytes"] + nbytes
    return out


def verdict(peak: int, budget: int | None, by_category: dict[str, int],
            overhead: int = 0) -> dict[str, Any] | None:
    """Fits / does not fit ``budget`` with ``peak + overhead`` (CUDA context on a card)."""
    if budget is None:
        return None
    need = peak + overhead
    top = max(by_category, key=by_category.get) if by_category else "?"
    fits = need <= budget
    if fits:
        text = f"fits with {fmt_bytes(budget - need)} headroom"
    else:
        text = (f"does not fit: over by {fmt_bytes(need - budget)}; dominated by {top} "
                f"({fmt_bytes(by_category.get(top, 0))})")
    return {"fits": fits, "budget_bytes": int(budget), "needed_bytes": int(need),
            "overhead_bytes": int(overhead), "headroom_bytes": int(budget - need),
            "dominant": top, "text": text}


def estimate(cfg, opts: EstimateOptions | None = None, choices: dict[str, str] | None = None,
             overrides: list[str] | None = None) -> dict[str, Any]:
    """Estimate one composed configuration; returns the ``estimate.json`` dict (``status`` ok /
    invalid / failed, ``error`` says why)."""
    from memlab.registry import ConfigErrors

    opts = opts or EstimateOptions()
    t0 = time.perf_counter()
    notes: list[str] = []
    out: dict[str, Any] = {
        "kind": "estimate", "status": "failed", "error": None,
        "choices": dict(choices or {}), "overrides": list(overrides or []),
        "options": {k: v for k, v in dataclasses.asdict(opts).items()},
    }
    if opts.card is not None and opts.card not in CARDS:
        out["status"] = "invalid"
        out["error"] = f"unknown card {opts.card!r}; choose one of: {', '.join(CARDS)}"
        return out
    try:
        ctx = validate_for(cfg, opts.device, choices)
    except ConfigErrors as e:
        out["status"] = "invalid"
        out["error"] = str(e)
        if opts.device == "cpu":
            try:
                validate_for(cfg, "cuda", choices)
                out["error"] += ("\n(valid as a CUDA run: estimate it with --device cuda or "
                                 "--card NAME)")
            except ConfigErrors:
                pass
        return out
    from memlab.distributed.single import Single

    procs = ctx.world_size
    wrapper = ctx.distributed  # the run's option, kept: the estimate runs a plain process
    deepspeed = getattr(wrapper, "zero_stage", None) is not None
    if procs > 1 or not isinstance(ctx.distributed, Single):
        # one rank of a multi-process run (or a one-rank wrapper): estimate it as one plain
        # process, then shard
        if opts.world_size == 1:
            opts = dataclasses.replace(opts, world_size=procs)
        if deepspeed and not opts.zero_stage:
            opts = dataclasses.replace(opts, zero_stage=wrapper.zero_stage)
        elif ctx.distributed.shards_states() and not opts.zero_stage:  # fsdp2: full shard
            opts = dataclasses.replace(opts, zero_stage=3)
        notes.append(f"distributed={choices.get('distributed', '?') if choices else '?'}: one "
                     f"rank of {procs}, train.batch_size rows per rank")
        ctx = dataclasses.replace(ctx, distributed=Single(), world_size=1, rank=0)
        out["options"]["world_size"] = opts.world_size
        out["options"]["zero_stage"] = opts.zero_stage
    try:
        res = run_fake_step(ctx, opts, notes)
    except EstimateError as e:
        out["error"] = str(e)
        return out
    raw = res["raw"]
    mem = {k: raw[k] for k in ("peak_bytes", "by_category", "by_phase", "by_phase_category",
                                "peak_at")}
    ran = res["timing"]["steps"]
    notes.insert(0, "measured: training step(s) " + ", ".join(map(str, ran)) + " on fake tensors "
                    "under the run's memory tracker (CPU kernels' shapes)"
                    + ("; optimizer state created by the optimizer's own step 0 update"
                       if ran == [1] else ""))
    unsharded = mem
    sm = CARDS[opts.card]["sm"] if opts.card else 8
    if opts.device == "cuda":
        ws = cublas_workspace_bytes(sm)
        mem = _add_other(mem, ws)
        notes.append(f"device=cuda is a model: each allocation rounded up to {CUDA_BLOCK} B, "
                     f"cuBLAS workspace {fmt_bytes(ws)} in other, AdamW foreach; allocator "
                     "fragmentation (reserved > allocated) is not included")
    else:
        notes.append("device=cpu: byte-exact for a CPU run of the same shapes")
    if opts.world_size > 1 or deepspeed:
        bucket_view = bool(getattr(wrapper, "gradient_as_bucket_view", False))
        ds_info = (_deepspeed_info(wrapper, ctx, opts.zero_stage, res["model"]) if deepspeed
                   else None)
        gather = bool(getattr(wrapper, "gather_for_generation", False))
        if gather and opts.zero_stage >= 3 and "generate" in mem.get("by_phase", {}):
            notes.append("gather_for_generation: the generate phase holds the whole weights "
                         "beside the rank's shards")
        mem = apply_sharding(mem, opts.world_size, opts.zero_stage, res["model"]["shard_units"],
                             notes, bucket_view=bucket_view, deepspeed=ds_info,
                             gather_generation=gather)
    budget = opts.budget_bytes
    overhead = 0
    if opts.card:
        budget = budget if budget is not None else CARDS[opts.card]["mib"] * MiB
        overhead = CUDA_CONTEXT_BYTES
        notes.append(f"verdict counts ~{fmt_bytes(CUDA_CONTEXT_BYTES)} of CUDA context outside "
                     "the allocator")
    mask_note = _padding_mask_note(ctx, res["batch"])
    if mask_note:
        notes.append(mask_note)
    offload = res["offload"]
    if offload is not None:
        notes.append(f"activation offload: {fmt_bytes(offload.get('offloaded_bytes', 0))} moved "
                     "to host memory per step (not in the device peak)")
    out.update({
        "status": "ok",
        "device": opts.device,
        "source": "estimate",
        **mem,
        "unsharded": unsharded if opts.world_size > 1 else None,
        "verdict": verdict(mem["peak_bytes"], budget, mem["by_category"], overhead),
        "card": {"key": opts.card, **CARDS[opts.card]} if opts.card else None,
        "sharding": {"world_size": opts.world_size, "zero_stage": opts.zero_stage},
        "model": res["model"],
        "batch": res["batch"],
        "offload": ({"host_peak_bytes": offload.get("peak_host_bytes"),
                     "offloaded_bytes": offload.get("offloaded_bytes"), "stats": offload}
                    if offload is not None else None),
        "assumptions": notes,
    })
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["estimator"] = {**res["timing"], "wall_s": time.perf_counter() - t0,
                        "max_rss_bytes": int(usage.ru_maxrss) * 1024}
    return out


# ----------------------------------------------------------------------------- presentation


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{sign}{n / 1024:.1f} KiB"
    return f"{sign}{int(n)} B"


def parse_bytes(text: str) -> int:
    """'24GiB' / '24G' (GiB) / '24GB' (10^9) / '512MiB' / '1.5T' / plain bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 24GiB, 80GB, 512MiB)")
    num, unit, i, b = m.groups()
    power = " kmgt".index(unit or " ")
    base = 1000 if (b and not i and unit) else 1024
    return int(float(num) * base**power)


def format_table(est: dict[str, Any]) -> str:
    """Categories x phases, the peak, the verdict and the assumptions."""
    lines = []
    ch = est.get("choices") or {}
    lines.append("memlab estimate: " + " ".join(f"{k}={v}" for k, v in ch.items()))
    if est.get("overrides"):
        lines.append("overrides: " + " ".join(est["overrides"]))
    if est.get("status") != "ok":
        lines.append(f"status: {est.get('status')}  {est.get('error') or ''}")
        return "\n".join(lines)
    m, b = est.get("model") or {}, est.get("batch") or {}
    lines.append(f"model: {m.get('total', 0) / 1e6:.1f}M params ({m.get('trainable', 0) / 1e6:.2f}M "
                 f"trainable)  batch: {b.get('rows')}; tensors "
                 + ", ".join(f"{k}{v}" for k, v in (b.get("shapes") or {}).items()))
    phc = est.get("by_phase_category") or {}
    phases = [ph for ph in ALL_PHASES if ph in PHASES or ph in phc]
    head = ["", *phases, "peak"]
    body = []
    for cat in CATEGORIES:
        body.append([cat, *(fmt_bytes(phc.get(ph, {}).get(cat)) if ph in phc else "-"
                            for ph in phases), fmt_bytes(est["by_category"].get(cat, 0))])
    body.append(["total", *(fmt_bytes(est["by_phase"].get(ph)) for ph in phases),
                 fmt_bytes(est["peak_bytes"])])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    for r in [head, *body]:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)))
    pa = est.get("peak_at") or {}
    lines.append(f"estimated peak: {fmt_bytes(est['peak_bytes'])} (device={est['device']}, "
                 f"{pa.get('phase')} of step {pa.get('step')})")
    if est.get("offload"):
        lines.append(f"host memory for offloaded activations: "
                     f"{fmt_bytes(est['offload'].get('host_peak_bytes'))}")
    v = est.get("verdict")
    if v:
        where = est["card"]["key"] if est.get("card") else fmt_bytes(v["budget_bytes"])
        lines.append(f"verdict vs {where}: {v['text']}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in est.get("assumptions", [])]
    e = est.get("estimator") or {}
    if e:
        lines.append(f"(estimated in {e.get('wall_s', 0):.1f} s, max RSS "
                     f"{fmt_bytes(e.get('max_rss_bytes'))})")
    return "\n".join(lines)


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """One line per estimate of a sweep: what was varied, the peak, the verdict."""
    varied: list[str] = []
    for est in rows:
        for o in est.get("sweep_point", []):
            k = o.split("=", 1)[0]
            if k not in varied:
                varied.append(k)
    head = [*varied, "peak", "dominant", "verdict"]
    body = []
    for est in rows:
        point = dict(o.split("=", 1) for o in est.get("sweep_point", []))
        if est.get("status") != "ok":
            body.append([*(point.get(k, "") for k in varied), "-", "-",
                         f"{est.get('status')}: {(est.get('error') or '').splitlines()[-1][:60]}"])
            continue
        cats = est["by_category"]
        top = max(cats, key=cats.get)
        v = est.get("verdict")
        body.append([*(point.get(k, "") for k in varied), fmt_bytes(est["peak_bytes"]), top,
                     v["text"] if v else "-"])
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(widths[i]) for i, c in enumerate(r))
                     for r in [head, *body])
