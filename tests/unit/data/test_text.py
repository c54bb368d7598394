"""Plain-text rows get the BOS token as the tokenizer adds it, once, for every method that reads
them (memlab.data.text): with a tokenizer that adds BOS (Llama 3 style) every sequence that a
text or a string prompt starts begins with exactly one BOS, a text that already starts with it
included; with one that adds none (Qwen style) no sequence has one."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memlab.data import text
from memlab.data.assets import load_tokenizer
from memlab.data.local import Local
from memlab.pipeline import prepare_rows

ROWS = {  # method -> string rows of every type it takes
    "sft": [{"text": "The sky is blue."}, {"text": "<|bos|>Already has one."}],
    "sft-pc": [{"prompt": "The sky is", "completion": " blue."}],
    "dpo": [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}],
    "dpo-implicit": [{"chosen": "The sea is deep.", "rejected": "The sea is dry."}],
    "kto": [{"prompt": "The sky is", "completion": " blue.", "label": True}],
    "reward": [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}],
    "reward-implicit": [{"chosen": "The sea is deep.", "rejected": "The sea is dry."}],
    "grpo": [{"prompt": "The sky is"}],
}
STARTS = {  # the columns of prepared rows that start a sequence
    "sft": ["input_ids"], "sft-pc": ["input_ids"], "dpo": ["prompt_ids"],
    "dpo-implicit": ["prompt_ids"], "kto": ["prompt_ids"], "reward": ["chosen_ids", "rejected_ids"],
    "reward-implicit": ["chosen_ids", "rejected_ids"], "grpo": ["prompt_ids"],
}
ENDS = {"sft-pc": ["input_ids"], "dpo": ["chosen_ids", "rejected_ids"],
        "dpo-implicit": ["chosen_ids", "rejected_ids"], "kto": ["completion_ids"]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bos")
    load_tokenizer(add_bos_token=True).save_pretrained(folder / "llama3-style")
    return {"adds BOS": folder / "llama3-style", "adds none": None}


@pytest.mark.parametrize("kind", ["adds BOS", "adds none"])
@pytest.mark.parametrize("method", sorted(ROWS))
def test_bos_once_where_the_tokenizer_adds_it(tokenizers, tmp_path, method, kind):
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab_testing import compose, with_fast

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[method]))
    extra = [f"model.tokenizer={tokenizers[kind]}"] if tokenizers[kind] else []
    cfg = compose(with_fast([f"method={method.split('-')[0]}", "data=local", f"data.path={path}",
                             *extra]))
    cfg = OmegaConf.to_container(cfg)
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    tok = ctx.model.load_tokenizer(ctx)
    bos = tok.bos_token_id
    assert text.adds_bos(tok) == (kind == "adds BOS")
    assert (tok("x")["input_ids"][0] == bos) == (kind == "adds BOS")  # as the tokenizer does
    _, ds, _, _ = prepare_rows(dataclasses.replace(ctx, data=Local(path=str(path))), tok)
    assert len(ds) == len(ROWS[method])
    for i, row in enumerate(ds):
        own = "<|bos|>" in json.dumps(ROWS[method][i])  # the text starts with BOS itself
        for col in STARTS[method]:
            ids = row[col]
            assert ids.count(bos) == (1 if kind == "adds BOS" or own else 0), (col, ids)
            assert (ids[0] == bos) == (kind == "adds BOS" or own)
        for col in ENDS.get(method, []):  # completions: no BOS, one EOS at the end
            ids = row[col]
            if col in STARTS[method]:
                continue
            assert bos not in ids and ids[-1] == tok.eos_token_id
            assert ids.count(tok.eos_token_id) == 1
