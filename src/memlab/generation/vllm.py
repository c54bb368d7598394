"""`generation=vllm`: the online methods sample their completions with vLLM instead of
transformers' ``generate``, as TRL's ``use_vllm=True`` does, in one of two modes:

- ``mode=colocate``: an in-process ``vllm.LLM`` in the training process (vLLM's
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` engine, so weights pass by reference). It is built from the
  policy's own config with dummy weights, then loaded with the policy's weights; after every
  optimizer step the trainer's weights are reloaded in place (``reload_weights``; LoRA: merged
  ``W + scale * B A``, computed without touching the model). With ``enable_sleep_mode`` (CUDA) the
  engine's weights and KV cache are released after each generation and restored for the next.
- ``mode=server``: a vLLM server in its own process and Python environment
  (``memlab vllm-serve model=...``, :mod:`memlab.generation.vllm_server`); the trainer talks to
  it over HTTP (:mod:`memlab.generation.vllm_client`, standard library only: the trainer needs
  no vLLM), pushes its weights as safetensors chunks, staged and committed atomically, and
  generates through it.

Sampling maps one to one from :class:`SamplingParams` (temperature, top-p, top-k, max new
tokens, stop at EOS; greedy = temperature 0); prompts go in as token ids; vLLM's own log-probs of
the sampled tokens come back (``logprobs_mode=raw_logprobs``: the model's log-softmax at
temperature 1, the quantity the trainer's forward computes) for the truncated importance
sampling correction (:meth:`Vllm.importance_weights`, TRL's
``vllm_importance_sampling_correction``, off by default).

Importing this module never imports vLLM; the colocated engine imports it when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

import torch

from memlab.generation._vllm_engine import INSTALL, ColocateEngine
from memlab.generation.base import EngineMemory, register
from memlab.generation.vllm_client import ServerEngine
from memlab.registry import Option, PositiveFloat, PositiveInt, Range, Seed

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("vllm")
@dataclass(kw_only=True)
class Vllm(Option):
    """vLLM generation; knobs named as TRL's ``vllm_*`` options and vLLM's engine arguments."""

    mode: Literal["colocate", "server"] = "colocate"
    """colocate: an engine in the training process; server: a `memlab vllm-serve` process."""
    # ---- the colocated engine (the server takes the same knobs on its own command line)
    gpu_memory_utilization: Annotated[float, Range(gt=0, le=1)] = 0.3
    """Share of the GPU's memory vLLM may take for weights + KV cache (TRL's colocate default
    0.3). On CPU vLLM reads it as a share of host memory, used only without kv_cache_space_gib."""
    kv_cache_space_gib: PositiveFloat | None = None
    """KV-cache size in GiB (vLLM's ``kv_cache_memory_bytes``; on CPU what VLLM_CPU_KVCACHE_SPACE
    sets). None: 1 GiB on CPU, gpu_memory_utilization decides on CUDA."""
    max_model_len: PositiveInt | None = None
    """Longest prompt + completion the engine holds; None = the model's context length."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs one engine is split over (server mode; colocate runs one engine per rank)."""
    enable_sleep_mode: bool = False
    """CUDA only: release the engine's weights and KV cache during the training step."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; auto = the policy's parameter dtype."""
    enforce_eager: bool | None = None
    """No CUDA graphs / torch.compile; None = on for CPU (compiling costs more than it saves on
    short runs), off on CUDA."""
    model_impl: Literal["auto", "vllm", "transformers"] = "vllm"
    """vLLM's own model code or the transformers backend (TRL's ``vllm_model_impl``)."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Log-probs vLLM returns: of the model (temperature 1, as the trainer computes them) or of
    the sampling distribution after temperature / top-p / top-k."""
    seed: Seed | None = None
    """Sampling seed of the engine; None = train.seed (+ rank)."""
    # ---- server mode
    host: str = "127.0.0.1"
    """Address of the `memlab vllm-serve` server (mode=server)."""
    port: Annotated[int, Range(ge=1, le=65535)] = 8000
    """Port of the `memlab vllm-serve` server (mode=server)."""
    server_timeout_s: PositiveFloat = 240.0
    """How long the client waits for the server to answer its first health check."""
    request_timeout_s: PositiveFloat = 600.0
    """Longest one request (a generation batch, a weight chunk) may take."""
    weight_chunk_mib: PositiveInt = 64
    """Size of one weight upload (safetensors bytes) to the server."""
    # ---- sampler / trainer mismatch
    importance_sampling_correction: bool = False
    """Weight each token by the truncated ratio trainer-prob / vLLM-prob (TRL's
    ``vllm_importance_sampling_correction``)."""
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                      "sequence_mask"] = "token_truncate"
    importance_sampling_cap: PositiveFloat = 3.0
    """Ratios above the cap are cut to it (truncate) or zeroed (mask)."""

    # ------------------------------------------------------------------ validation
    def validate(self, ctx: BuildContext) -> list[str]:
        """Every problem with its fix; on CPU, sleep mode is refused with vLLM's reason."""
        errors: list[str] = []
        online = ctx.method.as_generating()
        if online is None:
            errors.append(f"generation=vllm samples the completions of online methods; method="
                          f"{ctx.method.name} trains on its dataset as configured: use "
                          "generation=hf (the default)")
        elif (self.importance_sampling_correction
              and not online.supports_sampling_correction):
            errors.append(f"generation.importance_sampling_correction=true reweights the "
                          f"clipped surrogate of grpo / rloo; method={ctx.method.name} has none: "
                          "set it false")
        if self.mode == "colocate" and not ctx.platform.has("vllm"):
            errors.append(f"generation=vllm (mode=colocate) runs vLLM in the training process, "
                          f"but the 'vllm' package is not importable here; {INSTALL}; or use "
                          "generation.mode=server with a server started from an environment "
                          "that has it")
        if self.enable_sleep_mode:
            if self.mode == "server":
                errors.append("generation.enable_sleep_mode applies to mode=colocate (a server "
                              "keeps its GPUs to itself); set it false")
            elif not ctx.is_cuda:
                errors.append("generation.enable_sleep_mode=true needs CUDA: vLLM's sleep mode "
                              "releases the engine's weights and KV cache through its CUDA "
                              "memory allocator, and the CPU backend refuses it ('Sleep mode is "
                              "not supported on current platform'); set it false on CPU")
        if not 0 < self.gpu_memory_utilization <= 1:
            errors.append(f"generation.gpu_memory_utilization must be in (0, 1] (got "
                          f"{self.gpu_memory_utilization})")
        if self.kv_cache_space_gib is not None and self.kv_cache_space_gib <= 0:
            errors.append(f"generation.kv_cache_space_gib must be > 0 or null (got "
                          f"{self.kv_cache_space_gib})")
        if self.max_model_len is not None and self.max_model_len < 1:
            errors.append(f"generation.max_model_len must be >= 1 or null (got "
                          f"{self.max_model_len})")
        if self.tensor_parallel_size < 1:
            errors.append("generation.tensor_parallel_size must be >= 1")
        elif self.mode == "colocate" and self.tensor_parallel_size != 1:
            errors.append(f"generation.tensor_parallel_size={self.tensor_parallel_size}: the "
                          "colocated engine runs one unsplit copy per training rank; split a "
                          "large model over GPUs with mode=server (`memlab vllm-serve "
                          "tensor_parallel_size=N`)")
        if self.mode == "colocate" and ctx.world_size > 1 and not ctx.is_cuda:
            errors.append(f"generation.mode=colocate with {ctx.world_size} ranks needs CUDA "
                          "(one engine per rank over vLLM's external launcher); on CPU use "
                          "generation.mode=server")
        if ctx.peft.as_quantized_base() is not None:
            errors.append(f"generation=vllm with peft={ctx.peft.name}: merging LoRA into a "
                          "quantized base is not supported by this engine; use peft=lora or "
                          "generation=hf")
        if not 0 < self.port < 65536:
            errors.append(f"generation.port must be in 1..65535 (got {self.port})")
        for knob, value in (("server_timeout_s", self.server_timeout_s),
                            ("request_timeout_s", self.request_timeout_s),
                            ("importance_sampling_cap", self.importance_sampling_cap)):
            if value <= 0:
                errors.append(f"generation.{knob} must be > 0 (got {value})")
        if self.weight_chunk_mib < 1:
            errors.append(f"generation.weight_chunk_mib must be >= 1 (got "
                          f"{self.weight_chunk_mib})")
        return errors

    # ------------------------------------------------------------------ engines
    def build(self, ctx: BuildContext, tokenizer, policy) -> ColocateEngine | ServerEngine:
        """The engine of this run (nothing starts until its first use)."""
        seed = (self.seed if self.seed is not None else ctx.train.seed) + ctx.rank
        if self.mode == "colocate":
            return ColocateEngine(self, device=ctx.device, seed=seed, world_size=ctx.world_size)
        return ServerEngine(self, rank=ctx.rank)

    def engine_memory(self, ctx: BuildContext, weight_elements: int, dtype: torch.dtype,
                      device_bytes: int | None) -> EngineMemory | None:
        """The colocated engine's weights copy (``dtype`` knob, else the policy's) and KV cache:
        ``kv_cache_space_gib`` when set; else on CPU vLLM's 1 GiB default; on CUDA vLLM sizes
        the cache to fill ``gpu_memory_utilization`` of the device with weights + cache (its
        profiling activations come out of the same share, so weights + cache is the share). A
        server holds nothing on the trainer's devices."""
        if self.mode == "server":
            return None
        size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(
            self.dtype, torch.empty((), dtype=dtype).element_size())
        weights = int(weight_elements) * size
        gib = 1 << 30
        if self.kv_cache_space_gib is not None:
            kv = int(self.kv_cache_space_gib * gib)
            how = f"generation.kv_cache_space_gib={self.kv_cache_space_gib:g}"
        elif not ctx.is_cuda:
            kv, how = gib, "1 GiB, vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE), in host memory"
        elif device_bytes is None:
            kv, how = 0, ("NOT counted: the share depends on the device's memory; give --card or "
                          "--budget, or set generation.kv_cache_space_gib")
        else:
            share = int(self.gpu_memory_utilization * device_bytes)
            kv = max(0, share - weights)
            how = (f"gpu_memory_utilization={self.gpu_memory_utilization:g} of "
                   f"{device_bytes / gib:.2f} GiB less the weights")
            if share < weights:
                how += (" - the share is smaller than the weights: vLLM will refuse to start; "
                        "raise generation.gpu_memory_utilization or set kv_cache_space_gib")
        note = (f"generation=vllm colocate: the engine's weights copy ({weight_elements:,} "
                f"elements x {size} B) and KV cache ({how}) beside the trainer's tensors"
                + ("; sleep mode: held only in the generate phase" if self.enable_sleep_mode
                   else ", through every phase")
                + "; the generate phase keeps the fake step's transformers generate (an upper "
                  "bound: vLLM needs no KV cache of the trainer's)")
        return EngineMemory(weights, kv, bool(self.enable_sleep_mode), note)

    def importance_weights(self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor,
                           mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Truncated importance sampling (TIS / masked IS) weights ``[N, L]`` (no gradient) for
        the mismatch between the trainer's log-probs and vLLM's: ``rho = exp(trainer - vllm)``
        per token (``token_*``) or per sequence (``sequence_*``: the product over its tokens),
        cut to the cap (``*_truncate``) or zeroed above it (``*_mask``). ``mask`` marks the
        completion tokens. Also returns the ratio's mean / max and the share of capped tokens."""
        m = mask.to(torch.bool)
        log_rho = (trainer_logps.detach().float() - sampler_logps.float()).masked_fill(~m, 0.0)
        if self.importance_sampling_mode.startswith("sequence"):
            log_rho = log_rho.sum(1, keepdim=True).expand_as(log_rho)
        rho = torch.exp(log_rho)
        over = rho > self.importance_sampling_cap
        if self.importance_sampling_mode.endswith("truncate"):
            w = rho.clamp(max=self.importance_sampling_cap)
        else:
            w = rho.masked_fill(over, 0.0)
        w = w.masked_fill(~m, 0.0)
        n = m.sum().clamp(min=1)
        metrics = {"vllm/is_ratio_mean": float(rho.masked_fill(~m, 0).sum() / n),
                   "vllm/is_ratio_max": float(rho.masked_fill(~m, 0).max()) if m.any() else 0.0,
                   "vllm/is_capped_fraction": float((over & m).sum() / n)}
        return w, metrics
