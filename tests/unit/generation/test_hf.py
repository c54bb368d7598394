"""``generation=hf``: each prompt is prefilled once for its group (``SamplingParams.n``): the KV
cache of all but each left-padded row's last token is computed on the prompts, repeated to the
group's rows, and ``generate`` continues from it. Greedy decoding gives the completions of the
prompts repeated and prefilled one by one (what memlab did before); sampled completions of one
prompt differ from each other (the rows are not copies of one sample)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from memlab.distributed.single import Single
from memlab.generation.base import SamplingParams
from memlab.generation.hf import HFEngine


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      pad_token_id=0, eos_token_id=1)
    return Qwen2ForCausalLM(cfg).train()  # the engine switches to eval and back


def _prompts():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in ((0, 4), (2, 8)):  # left-padded; the last prompt has one token
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def test_greedy_group_equals_the_repeated_prompts(model):
    ids, mask = _prompts()
    engine = HFEngine(Single())
    params = SamplingParams(max_new_tokens=12, eos=1, pad=0, greedy=True)
    once = engine.generate(model, ids, mask, SamplingParams(**{**params.__dict__, "n": 4}))
    repeated = engine.generate(model, ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0),
                               params)
    assert once.completion.shape == repeated.completion.shape == (12, 12)
    assert torch.equal(once.completion, repeated.completion)
    assert once.token_ids == repeated.token_ids and model.training
    assert len({tuple(t) for t in once.token_ids}) == 3  # greedy: one completion per prompt


def test_sampled_group_members_differ(model):
    ids, mask = _prompts()
    torch.manual_seed(0)
    out = HFEngine(Single()).generate(model, ids, mask, SamplingParams(
        max_new_tokens=8, eos=1, pad=0, temperature=1.0, n=4))
    assert out.completion.shape[0] == 12
    for p in range(3):
        assert len({tuple(t) for t in out.token_ids[4 * p: 4 * p + 4]}) == 4
