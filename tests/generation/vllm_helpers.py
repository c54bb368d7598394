"""Shared pieces of the vLLM tests: a tiny model vLLM's CPU backend can run, a few optimizer
steps that change its weights, transformers' greedy completions as the reference, and a
`memlab vllm-serve` process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from memlab import _guards

SKIP_NO_VLLM = pytest.mark.skipif(
    not _guards.has("vllm"),
    reason="vllm is not installed in this environment; `make test` runs these tests in vLLM's "
           "own (.venv-vllm: scripts/setup_vllm.sh; `make test-vllm` runs them alone)")
PAD = 0
KV_GIB = 0.25


def tiny_model(seed: int = 0):
    """A 2-layer llama; head size 32 (vLLM's CPU attention has no head size 16)."""
    from transformers import AutoModelForCausalLM

    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    tok = load_tokenizer()
    cfg = Tiny(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
               num_kv_heads=1).hf_config(tok)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg), tok


def prompts(tok, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt rows of different lengths."""
    texts = ["The cat sat on", "Numbers: 1 2 3", "hello", "A long prompt about memory and speed"]
    rows = [tok(texts[i % len(texts)], add_special_tokens=False)["input_ids"] for i in range(n)]
    width = max(map(len, rows))
    ids = torch.full((n, width), PAD, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def train_steps(model, steps: int = 3, lr: float = 1e-2, seed: int = 1) -> None:
    """A few AdamW steps of next-token loss on random tokens (the weights move a lot)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        x = torch.randint(5, 4096, (2, 16), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def hf_greedy(model, ids, mask, max_new: int, eos: int | None):
    """transformers' greedy completions -> (completion, mask up to the first EOS, finished)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    comp = out[:, ids.shape[1]:]
    if eos is None:
        return comp, torch.ones_like(comp), torch.zeros(len(comp), dtype=torch.bool)
    is_eos = comp == eos
    finished = is_eos.any(1)
    first = torch.where(finished, is_eos.int().argmax(1), comp.shape[1])
    cmask = (torch.arange(comp.shape[1])[None] <= first[:, None]).long()
    return comp.masked_fill(cmask == 0, PAD), cmask, finished


def trainer_logps(model, ids, mask, comp, cmask) -> torch.Tensor:
    """The trainer's log-probs of the completion tokens (one forward, temperature 1)."""
    full = torch.cat([ids, comp], 1)
    attn = torch.cat([mask, cmask], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=attn,
                       position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    p = ids.shape[1]
    lp = logits[:, p - 1:-1].float().log_softmax(-1)
    return lp.gather(-1, comp[..., None])[..., 0] * cmask


def free_port() -> int:
    """A loopback port nothing listens on (just now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int, log) -> subprocess.Popen:
    """`memlab vllm-serve` (through ``python -m memlab``, this interpreter) on ``port``, with
    random weights of ``model_dir``'s architecture (the trainer pushes its own), fp32, a small KV
    cache; output to ``log``."""
    cmd = [sys.executable, "-m", "memlab", "vllm-serve", f"model={model_dir}", f"port={port}",
           "load_format=dummy", f"kv_cache_space_gib={KV_GIB}", "device=cpu",
           "dtype=float32"]  # vLLM's auto would downcast fp32 to bf16
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def stop_server(proc: subprocess.Popen, client) -> None:
    """Ask whichever server answers at ``client``'s address to shut down; kill it after 30 s."""
    if proc.poll() is None:
        try:  # a fresh client: whichever server process answers
            type(client)(client.cfg)._call("/shutdown", {}, timeout=10)
        except Exception:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
