"""The vLLM server of ``generation.mode=server``: ``memlab vllm-serve model=<dir or hub id>
[knob=value ...]`` (or ``python -m memlab.generation.vllm_server ...``), in its own process and
possibly its own Python environment (the trainer's client needs neither vLLM nor this module's
dependencies beyond the standard library).

One in-process vLLM engine behind a small HTTP server (standard library, threaded; engine calls
are serialised). Endpoints, all JSON unless said:

- ``GET /health``: server id (new for every process: the client detects a restart), model,
  dtype, weight version, the engine's weights and KV-cache bytes.
- ``POST /generate`` ``{prompts: [[ids]], sampling: {vLLM SamplingParams}}`` ->
  ``{tokens: [[ids]], logprobs: [[float]], weight_version}``.
- ``POST /weights/begin`` -> ``{version}`` (the next one); ``POST /weights/chunk?version=N``
  (body: safetensors bytes of whole tensors, checkpoint names); ``POST /weights/commit``
  ``{version, count}``: the staged tensors are loaded in one ``reload_weights`` call (a fused
  vLLM layer, e.g. qkv_proj, must get all its parts in one call: loading them in two calls
  leaves the layer half garbage), the prefix cache is reset, the version moves on.
- ``POST /shutdown``.

On GPU the weight push would go over NCCL rather than HTTP (vLLM's weight-transfer engine /
TRL's communicator: the trainer's rank 0 joins a process group with the server's workers and
broadcasts each tensor); HTTP keeps this path device- and environment-independent.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

USAGE = """usage: memlab vllm-serve model=<checkpoint dir or hub id> [knob=value ...]
knobs: host port dtype max_model_len gpu_memory_utilization kv_cache_space_gib
       tensor_parallel_size enforce_eager model_impl logprobs_mode seed load_format device"""


@dataclass(kw_only=True)
class ServeConfig:
    """Knobs of `memlab vllm-serve`, named as vLLM's / `trl vllm-serve`'s."""

    model: str
    """Checkpoint dir or hub id with the policy's architecture (the trainer pushes its own
    weights before the first generation, so any weights of that architecture do)."""
    host: str = "127.0.0.1"
    """Address the server listens on (127.0.0.1: this machine only)."""
    port: int = 8000
    """Port the server listens on (the trainer's generation.port)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_space_gib: float | None = None
    """KV cache GiB (vLLM's kv_cache_memory_bytes); None: 1 GiB on CPU, gpu_memory_utilization
    on CUDA."""
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    model_impl: Literal["auto", "vllm", "transformers"] = "vllm"
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    seed: int = 0
    load_format: Literal["auto", "dummy", "safetensors", "pt"] = "auto"
    """dummy: random weights of the architecture (the trainer's first push replaces them)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"


def parse(argv: list[str]) -> ServeConfig:
    """``key=value`` arguments (values read as YAML scalars) -> the typed config; every
    problem reported at once."""
    import yaml

    from memlab.registry import ConfigErrors, from_mapping

    data: dict[str, Any] = {}
    errors: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            errors.append(f"argument {arg!r} is not key=value")
            continue
        data[key.lstrip("-").replace("-", "_")] = yaml.safe_load(value) if value else None
    if isinstance(data.get("model"), (int, float)):
        data["model"] = str(data["model"])
    cfg, errs = from_mapping(ServeConfig, data, "vllm-serve")
    errors += errs
    if errors:
        raise ConfigErrors(errors)
    assert cfg is not None
    return cfg


class Server:
    """The engine, its weight staging area and version, shared by the request threads."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.id = uuid.uuid4().hex[:12]
        self.version = 0
        self.staged: dict[str, Any] = {}
        self.staging_version: int | None = None
        self.lock = threading.Lock()  # one engine call (or staging change) at a time
        self.llm: Any = None
        self.dtype = ""

    def start(self) -> None:
        import torch

        from memlab.generation._vllm_engine import engine_kwargs

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if self.cfg.tensor_parallel_size == 1:  # in-process engine: weights pass by reference
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        device = self.cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        kw = engine_kwargs(
            model=self.cfg.model, dtype=self.cfg.dtype, max_model_len=self.cfg.max_model_len,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            kv_cache_space_gib=self.cfg.kv_cache_space_gib,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            enforce_eager=self.cfg.enforce_eager, model_impl=self.cfg.model_impl,
            logprobs_mode=self.cfg.logprobs_mode, seed=self.cfg.seed, device=device,
            load_format=self.cfg.load_format)
        self.llm = vllm.LLM(**kw)
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    # -- requests
    def health(self) -> dict[str, Any]:
        from memlab.generation._vllm_engine import engine_memory

        with self.lock:
            memory = self.llm.collective_rpc(engine_memory)[0]
        return {"status": "ok", "model": self.cfg.model, "dtype": self.dtype,
                "weight_version": self.version, "memory": memory}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        from memlab.generation._vllm_engine import read_outputs

        prompts = [{"prompt_token_ids": p} for p in body["prompts"]]
        with self.lock:
            outs = self.llm.generate(prompts, SamplingParams(**body["sampling"]),
                                     use_tqdm=False)
        tokens, lps = read_outputs(outs)
        return {"tokens": tokens, "logprobs": lps, "weight_version": self.version}

    def begin(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start staging the next weight version (anything staged before is dropped)."""
        with self.lock:
            self.staged, self.staging_version = {}, self.version + 1
        return {"version": self.staging_version}

    def chunk(self, version: int, data: bytes) -> dict[str, Any]:
        from safetensors.torch import load

        tensors = load(data)
        with self.lock:
            if version != self.staging_version:
                raise LookupError(f"weight chunk for version {version}, but version "
                                  f"{self.staging_version} is being staged; call begin first")
            self.staged.update(tensors)
            return {"staged": len(self.staged)}

    def commit(self, body: dict[str, Any]) -> dict[str, Any]:
        version, count = int(body["version"]), int(body["count"])
        with self.lock:
            if version != self.staging_version or len(self.staged) != count:
                raise LookupError(f"commit of version {version} with {count} tensors, but "
                                  f"{len(self.staged)} tensors of version "
                                  f"{self.staging_version} are staged")
            t0 = time.perf_counter()
            weights = list(self.staged.items())
            self.staged, self.staging_version = {}, None
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": weights, "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
            del weights
            seconds = time.perf_counter() - t0
            self.version = version
        return {"weight_version": version, "load_s": seconds}


def handler(server: Server, stop: threading.Event) -> type[BaseHTTPRequestHandler]:
    """The request handler bound to ``server``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per error only
            pass

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            body = json.dumps({**payload, "server_id": server.id}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _run(self, fn: Any) -> None:
            try:
                self._send(200, fn())
            except (LookupError, ValueError, TypeError) as e:
                self._send(409 if isinstance(e, LookupError) else 400,
                           {"error": f"{type(e).__name__}: {e}"})
            except Exception as e:  # the engine failed: tell the client why
                traceback.print_exc()
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if urlparse(self.path).path == "/health":
                self._run(server.health)
            else:
                self._send(404, {"error": f"no endpoint GET {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            data = self._body()
            if url.path == "/weights/chunk":
                version = int(parse_qs(url.query).get("version", ["-1"])[0])
                self._run(lambda: server.chunk(version, data))
                return
            routes = {"/generate": server.generate, "/weights/begin": server.begin,
                      "/weights/commit": server.commit}
            if url.path == "/shutdown":
                self._send(200, {"status": "stopping"})
                stop.set()
            elif url.path in routes:
                self._run(lambda: routes[url.path](json.loads(data or b"{}")))
            else:
                self._send(404, {"error": f"no endpoint POST {self.path}"})

    return Handler


def serve(cfg: ServeConfig) -> int:
    """Start the engine, then answer requests until ``/shutdown`` or Ctrl-C."""
    t0 = time.perf_counter()
    server = Server(cfg)
    server.start()
    stop = threading.Event()
    httpd = ThreadingHTTPServer((cfg.host, cfg.port), handler(server, stop))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    print(f"[memlab vllm-serve] {cfg.model} on http://{cfg.host}:{cfg.port} (server id "
          f"{server.id}, dtype {server.dtype}, ready in {time.perf_counter() - t0:.1f} s); "
          f"knobs: {json.dumps(asdict(cfg))}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    httpd.shutdown()
    httpd.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`memlab vllm-serve` entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    from memlab.registry import ConfigErrors

    try:
        cfg = parse(argv)
    except ConfigErrors as e:
        print(f"{e}\n{USAGE}", file=sys.stderr)
        return 2
    from memlab import _guards
    from memlab.generation._vllm_engine import INSTALL

    if not _guards.has("vllm"):
        print(f"memlab vllm-serve needs the 'vllm' package in this environment; {INSTALL}",
              file=sys.stderr)
        return 2
    return serve(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
