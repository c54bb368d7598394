"""Plain-text rows -> token ids, with the special tokens a model expects around them.

A ``text`` row, and the string ``prompt`` of a prompt-completion, preference or prompt-only row,
starts with the tokenizer's BOS when the tokenizer adds one itself (Llama 3's
``<|begin_of_text|>``, Gemma's ``<bos>``; Qwen's tokenizers add none), exactly once: a text that
already begins with it gets no second one. A completion (and a ``text`` row) ends with the EOS
token, once. This is what ``tokenizer(text)`` gives a model at inference, and what TRL trains
on. Conversational rows get their special tokens from the chat template instead
(:mod:`memlab.data.chat`).
"""

from __future__ import annotations

import weakref
from typing import Any

_ADDS_BOS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def adds_bos(tok) -> bool:
    """Whether ``tok(text)`` puts the BOS token in front of the text (computed once)."""
    known = _ADDS_BOS.get(tok)
    if known is None:
        bos = tok.bos_token_id
        plain = list(tok("a", add_special_tokens=False)["input_ids"])
        added = list(tok("a")["input_ids"])
        known = bos is not None and added[:1] == [bos] and plain[:1] != [bos]
        _ADDS_BOS[tok] = known
    return known


def start_ids(tok, text: str) -> list[int]:
    """Ids of a text that starts a sequence (a ``text`` row, a string prompt): BOS first when
    the tokenizer adds one and the text does not begin with it already."""
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if adds_bos(tok) and ids[:1] != [tok.bos_token_id]:
        ids.insert(0, tok.bos_token_id)
    return ids


def end_ids(tok, text: str) -> list[int]:
    """Ids of a text that ends a sequence (a string completion): EOS last, once."""
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if ids[-1:] != [tok.eos_token_id]:
        ids.append(tok.eos_token_id)
    return ids


def document_ids(tok, text: str) -> list[int]:
    """Ids of a whole text document: BOS as the tokenizer adds it, EOS last (both once)."""
    ids = start_ids(tok, text)
    if ids[-1:] != [tok.eos_token_id]:
        ids.append(tok.eos_token_id)
    return ids
