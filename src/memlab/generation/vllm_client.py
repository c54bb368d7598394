"""The trainer's side of ``generation=vllm``, ``mode=server``: a client of a `memlab vllm-serve`
process (:mod:`memlab.generation.vllm_server`). Standard library only (urllib, json): the
training environment needs no vLLM. Every request has a timeout; the server's id (new for each
process) is checked on every answer, so a restarted server is an error, not silent drift."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from memlab.generation._vllm_engine import (
    policy_weights,
    prompt_lists,
    sampling_kwargs,
    to_samples,
)
from memlab.generation.base import Samples, SamplingParams


class VllmServerError(RuntimeError):
    """The vLLM server is unreachable, restarted, out of step or failed a request."""


class NoAnswer(VllmServerError):
    """Nothing answered (connection refused, reset, or the timeout passed)."""


class ServerEngine:
    """Client of a `memlab vllm-serve` process: generates through it and pushes the policy's
    weights after each optimizer step. Every rank calls :meth:`sync_weights` (sharded weights
    are gathered together); rank 0 pushes, then the ranks meet at a barrier, so no rank
    generates with the old weights."""

    syncs_weights: ClassVar[bool] = True
    placeholder_samples: ClassVar[bool] = False

    def __init__(self, cfg: Any, *, rank: int = 0):
        self.cfg, self.rank = cfg, rank
        self.url = f"http://{cfg.host}:{cfg.port}"
        self.server_id: str | None = None
        self.info: dict[str, Any] = {}
        self.pushed = 0  # weight pushes this client made (rank 0) or waited for
        self.last_push: dict[str, float] = {}

    # -- transport
    def _call(self, path: str, payload: dict | None = None, data: bytes | None = None,
              timeout: float | None = None) -> dict[str, Any]:
        if payload is not None:
            data, ctype = json.dumps(payload).encode(), "application/json"
        else:
            ctype = "application/octet-stream"
        req = urllib.request.Request(self.url + path, data=data,
                                     method="GET" if data is None else "POST",
                                     headers={"Content-Type": ctype})
        limit = timeout or self.cfg.request_timeout_s
        try:
            with urllib.request.urlopen(req, timeout=limit) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read()).get("error", "")
            except ValueError:
                msg = ""
            raise VllmServerError(f"vLLM server {self.url}{path} answered {e.code}: "
                                  f"{msg or e.reason}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise NoAnswer(f"vLLM server {self.url}{path}: no answer ({reason}) within "
                           f"{limit:.0f} s") from None
        sid = out.get("server_id")
        if self.server_id is not None and sid != self.server_id:
            raise VllmServerError(
                f"the vLLM server at {self.url} restarted (server id {self.server_id} -> {sid}): "
                f"it lost the {self.pushed} weight update(s) pushed so far and serves the "
                "checkpoint it started from. Restart the training run (resume from a checkpoint) "
                "against the new server")
        return out

    def connect(self) -> dict[str, Any]:
        """Wait (at most server_timeout_s) for the server's health check; its description."""
        deadline = time.monotonic() + self.cfg.server_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                info = self._call("/health", timeout=max(1.0, min(10.0, left)))
                break
            except NoAnswer as e:  # a server that answers with an error: raised as it is
                if time.monotonic() + 1 > deadline:
                    raise VllmServerError(
                        f"no vLLM server answered at {self.url} within "
                        f"{self.cfg.server_timeout_s:.0f} s (generation.server_timeout_s); last "
                        f"error: {e}. Start one with `memlab vllm-serve model=<the policy's "
                        f"checkpoint> port={self.cfg.port}` (its own environment may hold "
                        "vLLM), or use generation.mode=colocate") from None
                time.sleep(1.0)
        self.server_id, self.info = info["server_id"], info
        return info

    # -- engine
    def sync_weights(self, model: torch.nn.Module) -> float:
        """Push the policy's weights (rank 0) as safetensors chunks of about weight_chunk_mib,
        staged by the server and loaded in one step at commit; every rank then waits at a
        barrier (when a process group is up). Seconds taken."""
        t0 = time.perf_counter()
        if self.server_id is None:
            self.connect()
        weights = policy_weights(model)  # every rank: sharded tensors are gathered together
        if self.rank == 0:
            from safetensors.torch import save

            dtype = getattr(torch, self.info.get("dtype", ""), None)
            version = self._call("/weights/begin", {})["version"]
            count = nbytes = chunks = 0
            for chunk in _chunks(weights, self.cfg.weight_chunk_mib * 2**20, dtype):
                data = save(chunk)
                self._call(f"/weights/chunk?version={version}", data=data)
                count, nbytes, chunks = count + len(chunk), nbytes + len(data), chunks + 1
            load = self._call("/weights/commit", {"version": version, "count": count})
            self.last_push = {"bytes": nbytes, "chunks": chunks, "server_load_s": load["load_s"]}
        del weights
        _barrier()
        self.pushed += 1
        return time.perf_counter() - t0

    def start(self, model: torch.nn.Module, untracked=None) -> None:
        """Connect and push the policy's weights, once (the server may have started from
        another checkpoint or random weights). The gathered weights and upload buffers are
        the trainer process's own memory: tracked."""
        if self.pushed == 0:
            self.sync_weights(model)

    def generate(self, model: torch.nn.Module, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor, params: SamplingParams) -> Samples:
        """Sample through the server; the first call pushes the policy's weights (the server
        may have started from another checkpoint or random weights)."""
        if self.pushed == 0:
            self.sync_weights(model)
        prompts = prompt_lists(prompt_ids, prompt_mask, params.n)
        out = self._call("/generate", {"prompts": prompts,
                                       "sampling": sampling_kwargs(params)})
        return to_samples(out["tokens"], out["logprobs"], params, prompt_ids.device)

    def corrects_sampling(self) -> bool:
        return self.cfg.importance_sampling_correction

    def importance_weights(self, trainer_logps, sampler_logps, mask):
        return self.cfg.importance_weights(trainer_logps, sampler_logps, mask)

    def memory(self) -> dict[str, int | None]:
        """The server's engine weights and KV cache in bytes (its own process and devices)."""
        return dict(self._call("/health").get("memory", {}))

    def close(self) -> None:
        """Nothing to release: the server belongs to whoever started it."""
        self.server_id = None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _chunks(weights: dict[str, torch.Tensor], limit: int, dtype: torch.dtype | None
            ) -> Iterator[dict[str, torch.Tensor]]:
    """Groups of whole tensors of at most ``limit`` bytes (a larger tensor goes alone), cast to
    the server's dtype, contiguous, a tensor sharing storage with an earlier one left out
    (tied embeddings: vLLM ties them itself)."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[tuple[int, int]] = set()
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen:
            continue
        seen.add(key)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = t
        size += nbytes
    if chunk:
        yield chunk
