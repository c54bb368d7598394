"""generation=vllm, mode=server: a real `memlab vllm-serve` process (vLLM
in-process inside it), a client that generates through it and pushes the trainer's weights
after each step (chunked safetensors, committed at once): greedy completions equal
transformers' on those weights; a restarted server is an error, not silent drift. One server
for the module (starting one costs seconds)."""

from __future__ import annotations

import time

import pytest
import torch

from generation.vllm_helpers import (
    KV_GIB,
    PAD,
    SKIP_NO_VLLM,
    free_port,
    hf_greedy,
    prompts,
    start_server,
    stop_server,
    tiny_model,
    train_steps,
    trainer_logps,
)
from memlab.generation.base import SamplingParams

pytestmark = [pytest.mark.vllm, SKIP_NO_VLLM]
MAX_NEW = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from memlab.generation._vllm_engine import save_config
    from memlab.generation.vllm import Vllm
    from memlab.generation.vllm_client import ServerEngine

    model, tok = tiny_model()
    d = tmp_path_factory.mktemp("vllm_server")
    save_config(model, str(d / "model"))  # config only: the server starts with dummy weights
    port = free_port()
    log = open(d / "server.log", "w")
    proc = start_server(str(d / "model"), port, log)
    client = ServerEngine(Vllm(mode="server", port=port, server_timeout_s=300,
                               weight_chunk_mib=1))
    t0 = time.monotonic()
    try:
        client.connect()
    except Exception:
        log.flush()
        raise RuntimeError((d / "server.log").read_text()[-3000:]) from None
    ready_s = time.monotonic() - t0
    state = {"client": client, "proc": proc, "model": model, "tok": tok, "dir": d, "port": port,
             "log": log, "ready_s": ready_s}
    yield state
    stop_server(state["proc"], client)
    log.close()


def _greedy_equal(client, model, tok):
    ids, mask = prompts(tok)
    comp, cmask, finished = hf_greedy(model, ids, mask, MAX_NEW, None)
    eos = int(comp[0, 3])
    comp, cmask, finished = hf_greedy(model, ids, mask, MAX_NEW, eos)
    s = client.generate(model, ids, mask, SamplingParams(max_new_tokens=MAX_NEW, eos=eos,
                                                         pad=PAD, greedy=True))
    assert s.completion.tolist() == comp.tolist()
    assert s.mask.tolist() == cmask.tolist() and s.finished_list == finished.tolist()
    ref = trainer_logps(model, ids, mask, s.completion, s.mask)
    assert torch.allclose(s.logprobs, ref, atol=1e-4)
    return s


def test_server_generates_the_trainers_greedy_and_follows_weight_pushes(server):
    client, model, tok = server["client"], server["model"], server["tok"]
    first = _greedy_equal(client, model, tok)  # the first generate pushes the weights
    assert client.pushed == 1 and client.last_push["chunks"] > 1  # 1 MiB chunks of ~2.4 MB
    train_steps(model)
    seconds = client.sync_weights(model)
    after = _greedy_equal(client, model, tok)
    assert seconds > 0 and client.pushed == 2
    assert after.completion.tolist() != first.completion.tolist()
    health = client._call("/health")
    assert health["weight_version"] == 2
    mem = client.memory()
    assert mem["kv_cache_bytes"] == int(KV_GIB * 2**30)
    assert mem["weights_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())


def test_restarted_server_is_an_error_not_silent_drift(server):
    client = server["client"]
    if client.server_id is None:
        client.connect()
    t0 = time.monotonic()
    stop_server(server["proc"], client)
    assert server["proc"].returncode == 0  # /shutdown ends the process cleanly
    stopped_s = time.monotonic() - t0
    server["proc"] = start_server(str(server["dir"] / "model"), server["port"], server["log"])
    fresh = type(client)(client.cfg)
    fresh.connect()  # wait for the new process
    ids, mask = prompts(server["tok"])
    with pytest.raises(Exception, match="restarted .* lost the 1 weight update|restarted .* "
                                        "lost the 2 weight update"):
        client.generate(server["model"], ids, mask, SamplingParams(max_new_tokens=4, pad=PAD))
    assert stopped_s < 30
    server["client"] = fresh


def _rank(rank: int, port: int, init: str, out: str) -> None:
    """One of two gloo ranks with the same trained policy: rank 0 pushes, both generate."""
    import json

    import torch.distributed as dist

    from memlab.generation.vllm import Vllm
    from memlab.generation.vllm_client import ServerEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model, tok = tiny_model()
        train_steps(model, seed=7)  # the same steps on both ranks: replicas, as under DDP
        client = ServerEngine(Vllm(mode="server", port=port, server_timeout_s=120), rank=rank)
        client.sync_weights(model)
        ids, mask = prompts(tok)
        s = client.generate(model, ids, mask, SamplingParams(max_new_tokens=MAX_NEW, pad=PAD,
                                                             greedy=True))
        comp, _, _ = hf_greedy(model, ids, mask, MAX_NEW, None)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"equal": s.completion.tolist() == comp.tolist(),
                       "pushed_bytes": client.last_push.get("bytes", 0)}, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_share_a_server_rank0_pushes(server, tmp_path):
    import json

    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'pg'}"
    mp.spawn(_rank, args=(server["port"], init, str(tmp_path / "out")), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    assert r0["equal"] and r1["equal"]
    assert r0["pushed_bytes"] > 0 and r1["pushed_bytes"] == 0
