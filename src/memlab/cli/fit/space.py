"""The technique space ``memlab fit`` searches: dimensions of overrides, their product.

A :class:`Dimension` is one decision (gradient checkpointing, micro-batch size or the optimizer
step inside backward, padding-free, packing, chunked loss, activation offloading, attention
backend; with ``--allow``: PEFT, mixed precision, sharding, the optimizer), each option a list of Hydra overrides. A dimension is left out when the
user fixed it (any of its keys on the command line), when the configuration has nothing to
choose (a method without ``padding_free``), or when the device cannot run it (offloading and the
CUDA attention backends on CPU, said in ``notes``). ``exact`` dimensions keep the training the
same (the loss curve of every option equals the user's configuration's, up to float rounding):
checkpointing, the micro-batch split of the same effective batch, the step inside backward
(offered only where the configuration clips no gradient; as one micro-batch per step, the only
split it is exact with), padding-free, chunked loss, offloading; the others change what is trained or on which batches.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ALLOWABLE = ("peft", "precision", "sharding", "optimizer")
"""What ``--allow`` may add: they change what is trained (LoRA), the numerics (mixed
precision, 8-bit or factored optimizer states) or how many processes train (sharding), so fit
never chooses them unasked."""


QLORA_MIXED = (
    "QLoRA under mixed precision can need more than LoRA, or than full fine-tuning where "
    "activations dominate (no checkpointing, large micro-batches): as on a GPU, bitsandbytes "
    "returns each 4-bit layer's output in its input's dtype, fp32 here (the frozen embeddings "
    "and norms keep the residual stream fp32), where autocast's linear layers return bf16, so "
    "every activation after a quantized layer (the MLP's gate, up and activation, q / k / v) "
    "is twice as large; QLoRA saves weight memory, not activations (docs/fit.md)")
"""Why a QLoRA row may be above full fine-tuning (issue 45 item 3), in fit's notes."""


@dataclass(frozen=True)
class Dimension:
    name: str
    keys: tuple[str, ...]
    """The config keys / groups its overrides set (a user override of one fixes it)."""
    options: tuple[tuple[str, tuple[str, ...]], ...]
    """(label, overrides) per option."""
    exact: bool
    """Every option trains exactly like the others (same batches, same math)."""


@dataclass
class Candidate:
    """One point of the space: its overrides (on top of the user's) and a short label."""

    overrides: list[str]
    label: str
    exact: bool
    estimate: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] | None = None
    predicted_rank: int | None = None
    coords: dict[str, int] = field(default_factory=dict)
    """The option chosen in each searched dimension (its index in :attr:`Dimension.options`)."""
    pruned: dict[str, Any] | None = None
    """Why the search did not estimate it (:mod:`.prune`): ``reason`` (``no_fit``: a smaller
    micro-batch of the same settings does not fit; ``dominated``: a fitting candidate that
    differs only by less checkpointing / no offloading, one micro-batch a step or padding-free
    rows is predicted no slower and ranks first, ``lever`` says which) and ``by`` (that
    candidate's index)."""
    shared: int | None = None
    """The index of the candidate whose estimate this one shares (the same configuration on
    the target as far as the estimate can tell: :func:`.prune.estimate_key`)."""

    def run(self) -> dict[str, Any]:
        """:attr:`measured`: what the candidate's real run measured (it has been run)."""
        if self.measured is None:
            raise ValueError(f"candidate {self.label!r} has not been run")
        return self.measured


def user_keys(overrides: Iterable[str]) -> set[str]:
    """The keys / groups a command line sets (``+a.b=1`` -> ``a.b``; ``peft=lora`` -> ``peft``)."""
    keys = set()
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        keys.add(key)
    return keys


def _divisors_desc(n: int, most: int = 3) -> list[int]:
    """The micro-batch sizes tried for an effective batch ``n``: ``n``, ``n/2``, ``n/4``, ...
    and always 1 (the least memory), at most ``most`` of them."""
    out: list[int] = []
    b = n
    while b >= 1 and len(out) < most:
        if n % b == 0:
            out.append(b)
        b //= 2
    if 1 not in out and len(out) == most:
        out[-1] = 1
    return out


def dimensions(cfg: Mapping[str, Any], device: str, allow: Iterable[str] = (),
               fixed: Iterable[str] = (), precision: str | None = None
               ) -> tuple[list[Dimension], list[str]]:
    """The dimensions fit searches for the composed ``cfg`` (a plain dict) on ``device``, and
    notes on what it leaves out and why. ``precision``: the configured precision as it resolves
    on ``device`` (:func:`resolved_precision`); an option equal to it is not searched twice."""
    allow, fixed = set(allow), set(fixed)
    unknown = allow - set(ALLOWABLE)
    if unknown:
        raise ValueError(f"--allow {','.join(sorted(unknown))}: choose from "
                         f"{', '.join(ALLOWABLE)}")
    method, train = cfg.get("method", {}), cfg.get("train", {})
    cuda = device == "cuda"
    dims: list[Dimension] = []
    notes: list[str] = []

    def add(dim: Dimension) -> None:
        hit = sorted(k for k in dim.keys if k in fixed)
        if hit:
            notes.append(f"{dim.name}: fixed by the command line ({', '.join(hit)})")
        elif len(dim.options) > 1:
            dims.append(dim)

    add(Dimension("checkpointing", ("train.gradient_checkpointing", "train.checkpoint_every"), (
        ("no checkpointing", ("train.gradient_checkpointing=false",)),
        ("checkpoint every 2nd layer", ("train.gradient_checkpointing=true",
                                        "train.checkpoint_every=2")),
        ("checkpoint every layer", ("train.gradient_checkpointing=true",
                                    "train.checkpoint_every=1")),
    ), exact=True))
    effective = int(train.get("batch_size", 1)) * int(train.get("grad_accum", 1))
    micro: list[tuple[str, tuple[str, ...]]] = [
        (f"{b} x {effective // b} accumulated", (f"train.batch_size={b}",
                                                 f"train.grad_accum={effective // b}"))
        for b in _divisors_desc(effective)]
    optimizer = cfg.get("optimizer", {})
    if "in_backward" in optimizer and train.get("max_grad_norm") is None \
            and "optimizer.in_backward" not in fixed:
        # exact with one micro-batch per step and no clipping (optimizer.base): the whole
        # effective batch at once, each parameter stepped as its gradient is ready
        micro.append((f"{effective} x 1, stepped in backward", (
            f"train.batch_size={effective}", "train.grad_accum=1",
            "optimizer.in_backward=true")))
    add(Dimension("micro_batch", ("train.batch_size", "train.grad_accum"), tuple(micro),
                  exact=True))
    if "padding_free" in method:
        add(Dimension("padding_free", ("method.padding_free",), (
            ("padded", ("method.padding_free=false",)),
            ("padding-free", ("method.padding_free=true",))), exact=True))
    if "loss_impl" in method:
        add(Dimension("loss", ("method.loss_impl", "method.chunk_size"), (
            ("full logits", ("method.loss_impl=standard",)),
            ("chunked loss", ("method.loss_impl=chunked",))), exact=True))
    add(Dimension("packing", ("packing",), (
        ("unpacked", ("packing=none",)), ("packed (bfd_split)", ("packing=bfd_split",))),
        exact=False))
    if cuda:
        add(Dimension("offload", ("offload",), (
            ("no offload", ("offload=none",)),
            ("activations offloaded", ("offload=activations",))), exact=True))
        backends = [("sdpa", ("attention=sdpa",)), ("flex", ("attention=flex_attention",))]
        if importlib.util.find_spec("flash_attn") is not None:
            backends.append(("flash-attn 2", ("attention=flash_attention_2",)))
        add(Dimension("attention", ("attention",), tuple(backends), exact=False))
    else:
        notes.append("offload and the CUDA attention backends: not searched on cpu (CUDA only)")
    if "peft" in allow:
        opts = [("full fine-tuning", ("peft=none",)), ("LoRA", ("peft=lora",))]
        if cuda:
            opts.append(("QLoRA", ("peft=qlora",)))
            if precision in ("bf16_mixed", "fp16_mixed") or "precision" in allow:
                notes.append(QLORA_MIXED)
        add(Dimension("peft", ("peft",), tuple(opts), exact=False))
    if "precision" in allow and precision == "bf16_mixed":
        # the one option --allow precision adds is the configuration itself: searching it would
        # estimate every candidate twice
        notes.append("precision: not searched, the configuration trains in bf16 autocast with "
                     "fp32 master weights already (the option --allow precision adds)")
    elif "precision" in allow:
        add(Dimension("precision", ("precision",), (
            ("as configured", ()), ("bf16 autocast, fp32 master weights",
                                    ("precision=bf16_mixed",))), exact=False))
    if "sharding" in allow:
        add(Dimension("sharding", ("distributed",), (
            ("one process", ("distributed=single",)),
            ("FSDP2", ("distributed=fsdp2",)),
            ("DeepSpeed ZeRO-3", ("distributed=deepspeed", "distributed.zero_stage=3"))),
            exact=False))
    if "optimizer" in allow:
        states = [("as configured", ()),
                  ("Adafactor (factored second moments)", ("optimizer=adafactor",))]
        if importlib.util.find_spec("bitsandbytes") is not None:
            states.insert(1, ("8-bit AdamW (bitsandbytes)", ("optimizer=adamw_8bit",)))
        else:
            notes.append("optimizer: 8-bit AdamW not searched (bitsandbytes is not installed)")
        add(Dimension("optimizer", ("optimizer",), tuple(states), exact=False))
    left = sorted(set(ALLOWABLE) - allow)
    if left:
        notes.append(f"not searched unless allowed (--allow): {', '.join(left)}")
    return dims, notes


def _is_configured(overrides: tuple[str, ...], cfg: Mapping[str, Any],
                   choices: Mapping[str, str]) -> bool:
    """Whether ``overrides`` only restate the configuration (group choices and values)."""
    for o in overrides:
        key, _, value = o.partition("=")
        if "." not in key:
            if str(choices.get(key)) != value:
                return False
            continue
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if str(node).lower() != value.lower():
            return False
    return True


def candidates(dims: list[Dimension], cfg: Mapping[str, Any],
               choices: Mapping[str, str]) -> list[Candidate]:
    """Every combination of one option per dimension. A candidate is ``exact`` when every
    dimension that changes the training (``exact=False``) keeps the configured option."""
    out = []
    for idx in itertools.product(*(range(len(d.options)) for d in dims)):
        combo = [d.options[i] for d, i in zip(dims, idx, strict=True)]
        overrides = [o for _, opts in combo for o in opts]
        label = ", ".join(lbl for lbl, _ in combo) or "as configured"
        exact = all(d.exact or _is_configured(opts, cfg, choices)
                    for d, (_, opts) in zip(dims, combo, strict=True))
        out.append(Candidate(overrides=overrides, label=label, exact=exact,
                             coords={d.name: i for d, i in zip(dims, idx, strict=True)}))
    return out


def resolved_precision(choice: str | None, device: str) -> str | None:
    """The precision option ``choice`` is on ``device``: ``auto`` resolves as the estimate's
    validation resolves it (a CUDA device: bf16 mixed, as on the CUDA machine an estimate
    assumes; a CPU: bf16 mixed where it has bf16 kernels), the others are themselves."""
    if choice != "auto":
        return choice
    from memlab.config import Platform

    platform = Platform.detect()
    if device == "cuda":
        bf16 = platform.bf16 if platform.cuda else Platform.cuda_machine().bf16
    else:
        bf16 = platform.cpu_bf16
    return "bf16_mixed" if bf16 else "fp32"
