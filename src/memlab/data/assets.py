"""The tokenizer shipped inside the package (no download needed).

A 4096-entry byte-level BPE trained on :mod:`memlab.data.synthetic` text by
``scripts/train_tokenizer.py``. Special tokens (ids 0-4): ``<|pad|>`` (pad), ``<|bos|>`` (declared,
never added automatically), ``<|eos|>`` (document separator), ``<|im_start|>``, ``<|im_end|>``
(``eos_token``: ends every assistant turn, so generation stops there). Its ChatML chat template
supports ``add_generation_prompt`` and ``return_assistant_tokens_mask=True`` (the mask covers
each assistant content and its ``<|im_end|>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_DIR = "tokenizer"


def tokenizer_path() -> Path:
    """Directory of the shipped tokenizer (``memlab/assets/tokenizer``)."""
    try:
        from importlib.resources import files

        path = Path(str(files("memlab") / "assets" / TOKENIZER_DIR))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - unusual import setups
        path = Path(__file__).resolve().parents[1] / "assets" / TOKENIZER_DIR
    if not (path / "tokenizer.json").is_file():
        fallback = Path(__file__).resolve().parents[1] / "assets" / TOKENIZER_DIR
        if (fallback / "tokenizer.json").is_file():
            return fallback
        raise FileNotFoundError(
            f"shipped tokenizer missing at {path}; run `python scripts/train_tokenizer.py`"
        )
    return path


def load_tokenizer(path: str | Path | None = None, **kwargs: Any):
    """``AutoTokenizer.from_pretrained(path or tokenizer_path())`` (extra kwargs passed on)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or tokenizer_path()), **kwargs)
