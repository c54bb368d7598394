#!/usr/bin/env python
"""Train memlab's shipped tokenizer on the synthetic corpus and write it to the package assets.

A byte-level BPE (HF ``tokenizers``) with 4096 entries, special tokens included, trained on a
fixed-seed sample of :mod:`memlab.data.synthetic` (chat, plain text and preference rows). The
output directory is loadable with ``transformers.AutoTokenizer.from_pretrained``:

* ``tokenizer.json``: the fast tokenizer (no BOS/EOS is added automatically).
* ``tokenizer_config.json``: special tokens, ``model_max_length`` and a ChatML ``chat_template``
  that supports ``add_generation_prompt`` and marks each assistant turn (content and its
  ``<|im_end|>``) with ``{% generation %}`` so ``return_assistant_tokens_mask=True`` works.
* ``special_tokens_map.json``: for older ``transformers`` versions.

Special tokens (ids in this order, from 0): ``<|pad|>``, ``<|bos|>``, ``<|eos|>``,
``<|im_start|>``, ``<|im_end|>``. ``eos_token`` is ``<|im_end|>``: every assistant turn of the
chat template ends with it, so generation stops at the end of a turn and trainers that append
``eos_token`` to plain-text or prompt/completion rows end them the same way. ``<|eos|>`` stays
available as a document separator; ``<|bos|>`` is declared but never added automatically.

The output is byte-for-byte deterministic (single-threaded training, fixed seeds, fixed JSON
layout). Run from the repository root::

    python scripts/train_tokenizer.py            # writes src/memlab/assets/tokenizer/
    python scripts/train_tokenizer.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

# Deterministic, single-threaded training (must be set before ``tokenizers`` is imported).
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tokenizers import (  # noqa: E402
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from memlab.data import synthetic  # noqa: E402

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
PAD, BOS, EOS, IM_START, IM_END = SPECIAL_TOKENS
CORPUS_SEED = 1234
MODEL_MAX_LENGTH = 1_000_000

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
"""ChatML. ``{% generation %}`` covers the assistant content and its ``<|im_end|>`` only."""


def corpus(seed: int = CORPUS_SEED) -> Iterator[str]:
    """Training texts: messages of chat and preference rows (with role lines) and documents."""
    for row in synthetic.generate_chat(3000, seed=seed):
        for m in row["messages"]:
            yield f"{m['role']}\n{m['content']}\n"
    for row in synthetic.generate_text(1000, seed=seed + 1):
        yield row["text"]
    for row in synthetic.generate_preference(1000, seed=seed + 2):
        for m in row["prompt"] + row["chosen"] + row["rejected"]:
            yield f"{m['role']}\n{m['content']}\n"


def train() -> Tokenizer:
    """Train the byte-level BPE on :func:`corpus`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    """Contents of tokenizer_config.json."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "extra_special_tokens": {},
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD,
        "padding_side": "right",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Train and write the tokenizer directory; print its size and special token ids."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "src/memlab/assets/tokenizer")
    args = ap.parse_args(argv)

    tok = train()
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(
            f"trained {tok.get_vocab_size()} entries, wanted {VOCAB_SIZE}; "
            "the corpus is too small for this vocabulary"
        )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    args.out.mkdir(parents=True, exist_ok=True)
    # Re-serialise with a fixed JSON layout so reruns give identical bytes.
    data = json.loads(tok.to_str())
    _write_json(args.out / "tokenizer.json", data)
    _write_json(args.out / "tokenizer_config.json", tokenizer_config())
    _write_json(
        args.out / "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": PAD,
            "additional_special_tokens": [EOS, IM_START, IM_END],
        },
    )
    size = (args.out / "tokenizer.json").stat().st_size
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()}, tokenizer.json {size} bytes)")
    print(f"special token ids: {ids}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
