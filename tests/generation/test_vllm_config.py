"""generation=vllm without a vLLM engine: validation (sleep mode on CPU, a missing vllm package,
knob ranges), the weights the engines push (LoRA merged as PEFT merges, tied and chunked for
the server), the importance-sampling weights, and a server that is not there or never answers
(a clear error within the timeout, no hang). Runs with or without vllm installed."""

from __future__ import annotations

import copy
import socket
import threading
import time

import pytest
import torch

from generation.vllm_helpers import free_port, tiny_model
from memlab import _guards
from memlab.context import validate
from memlab.generation._vllm_engine import policy_weights, sampling_kwargs
from memlab.generation.base import SamplingParams
from memlab.generation.vllm import Vllm
from memlab.generation.vllm_client import ServerEngine, VllmServerError, _chunks
from memlab.registry import ConfigErrors
from memlab_testing import FAST, compose


def _validate(*overrides: str):
    from omegaconf import OmegaConf, open_dict

    fast = [o for o in FAST if not o.startswith("method.")]
    cfg = compose(fast + ["method=grpo", "generation=vllm", *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.to_container(cfg, resolve=True))


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigErrors) as e:
        _validate(*overrides)
    return str(e.value)


def test_sleep_mode_on_cpu_is_invalid_with_the_reason():
    msg = _errors("generation.enable_sleep_mode=true")
    assert "enable_sleep_mode=true needs CUDA" in msg and "CPU backend refuses it" in msg
    assert "applies to mode=colocate" in _errors("generation.enable_sleep_mode=true",
                                                 "generation.mode=server")


@pytest.mark.skipif(_guards.has("vllm"), reason="vllm is installed here")
def test_colocate_without_vllm_names_the_install_route():
    msg = _errors()
    assert "'vllm' package is not importable" in msg
    assert "memlab[vllm]" in msg and "scripts/setup_vllm.sh" in msg
    assert _validate("generation.mode=server").generation.mode == "server"  # client: stdlib


def test_bad_knobs_are_reported_together():
    msg = _errors("generation.mode=server", "generation.gpu_memory_utilization=1.5",
                  "generation.port=0", "generation.server_timeout_s=0",
                  "generation.weight_chunk_mib=0", "generation.kv_cache_space_gib=-1")
    for knob in ("gpu_memory_utilization", "port", "server_timeout_s", "weight_chunk_mib",
                 "kv_cache_space_gib"):
        assert f"generation (vllm).{knob}: must be" in msg
    assert "use mode=server" not in msg
    assert "mode=server" in _errors("generation.tensor_parallel_size=2")


def test_sampling_params_map_one_to_one():
    kw = sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5,
                                        eos=4))
    assert kw["max_tokens"] == 7 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["top_k"] == 5 and kw["stop_token_ids"] == [4] and kw["logprobs"] == 0
    assert kw["ignore_eos"]  # stop at the named EOS only (test_vllm_colocate checks it runs so)
    greedy = sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.7, greedy=True))
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["stop_token_ids"] == []


@pytest.mark.parametrize("save", [None, ["lm_head"]])
def test_lora_weights_are_peft_merged_weights_and_the_model_is_untouched(save):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            modules_to_save=save))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn_like(p) * 0.05)
    before = {n: p.clone() for n, p in peft.named_parameters()}
    got = policy_weights(peft)
    want = copy.deepcopy(peft).merge_and_unload().state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6), k
    assert all(torch.equal(p, before[n]) for n, p in peft.named_parameters())
    plain = tiny_model()[0].state_dict()
    assert not torch.equal(got["model.layers.0.mlp.down_proj.weight"],
                           plain["model.layers.0.mlp.down_proj.weight"])  # merged, not base


def test_weight_chunks_cover_every_tensor_once_within_the_limit():
    from safetensors.torch import load, save

    from memlab.model.tiny import Tiny

    model, tok = tiny_model()
    tied = type(model)(Tiny(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                            num_kv_heads=1, tie_word_embeddings=True).hf_config(tok))
    for m, dropped in ((model, set()), (tied, {"lm_head.weight"})):
        weights = policy_weights(m)
        limit = 300_000
        chunks = list(_chunks(weights, limit, torch.bfloat16))
        names = [k for c in chunks for k in c]
        assert len(names) == len(set(names)) and set(names) == set(weights) - dropped
        for c in chunks:
            size = sum(t.numel() * t.element_size() for t in c.values())
            assert size <= limit or len(c) == 1
            back = load(save(c))  # what the server reads
            for k, t in back.items():
                assert t.dtype == torch.bfloat16 and torch.equal(t, weights[k].bfloat16())


def test_importance_weights_truncate_or_mask_per_token_or_sequence():
    trainer = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.0]]))
    sampler = torch.log(torch.tensor([[0.1, 0.5, 0.25], [0.3, 0.9, 1.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rho = torch.tensor([[5.0, 1.0, 2.0], [3.0, 1.0, 0.0]])
    w, m = Vllm(importance_sampling_mode="token_truncate",
                importance_sampling_cap=2.5).importance_weights(trainer, sampler, mask)
    assert torch.allclose(w, rho.clamp(max=2.5) * mask)
    assert m["vllm/is_capped_fraction"] == pytest.approx(2 / 5)
    w, _ = Vllm(importance_sampling_mode="token_mask",
                importance_sampling_cap=2.5).importance_weights(trainer, sampler, mask)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 0.0]]))
    seq = torch.tensor([10.0, 3.0])  # products over each row's tokens
    w, _ = Vllm(importance_sampling_mode="sequence_truncate",
                importance_sampling_cap=4.0).importance_weights(trainer, sampler, mask)
    assert torch.allclose(w, seq.clamp(max=4.0)[:, None] * mask)
    w, _ = Vllm(importance_sampling_mode="sequence_mask",
                importance_sampling_cap=4.0).importance_weights(trainer, sampler, mask)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.0], [3.0, 3.0, 0.0]]))


def test_unreachable_server_fails_clearly_within_the_timeout():
    port = free_port()  # nothing listens there
    client = ServerEngine(Vllm(mode="server", port=port, server_timeout_s=2))
    t0 = time.monotonic()
    with pytest.raises(VllmServerError) as e:
        client.connect()
    took = time.monotonic() - t0
    assert took < 5, took
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "within 2 s" in msg
    assert "memlab vllm-serve model=" in msg and "generation.mode=colocate" in msg


def test_a_server_that_never_answers_times_out():
    """A listener that accepts connections and says nothing: the health check and a request
    give up at their timeouts instead of hanging."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        client = ServerEngine(Vllm(mode="server", port=port, server_timeout_s=2,
                                   request_timeout_s=1))
        t0 = time.monotonic()
        with pytest.raises(VllmServerError, match="no vLLM server answered"):
            client.connect()
        assert time.monotonic() - t0 < 6
        t0 = time.monotonic()
        with pytest.raises(VllmServerError, match="no answer .* within 1 s"):
            client._call("/generate", {"prompts": [[5]], "sampling": {}})
        assert time.monotonic() - t0 < 4
    finally:
        stop.set()
        thread.join()
        for c in held:
            c.close()
        listener.close()
