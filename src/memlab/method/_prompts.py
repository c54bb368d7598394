"""The prompt side of the methods that sample their completions (``grpo``, ``rloo``,
``online_dpo``, ``ppo``, ``gkd``): prompt rows from conversations or preference rows, their
left-padded batches, and prompt + completion joined into padded training rows.

Not an option of its own (the registry skips modules whose name starts with ``_``).
"""

from __future__ import annotations

from typing import Any

import torch

from memlab.data.base import DataError, check_messages, check_text
from memlab.method import _rows
from memlab.method.base import IGNORE, Batch, DataStats


def prompt_rows(ds, tokenizer, limit: int | None) -> tuple[Any, DataStats]:
    """Prompt tokens (chat template with the generation prompt, cut from the left to ``limit``
    tokens) and the reference answer text, from conversations or preference rows."""
    cols = set(ds.column_names)
    if "messages" not in cols and "prompt" not in cols:
        raise DataError(f"method=grpo needs rows with 'messages' (a conversation ending in "
                        f"an assistant turn) or 'prompt' (+ optional 'chosen'); this "
                        f"dataset has columns {sorted(cols)}")

    def fn(row: dict, idx: int) -> list[dict]:
        prompt, reference = prompt_and_reference(row, idx)
        ids = _rows.encode_prompt(tokenizer, prompt, idx, row.get("tools"))
        n_in = len(ids)
        if limit is not None and len(ids) > limit:
            ids = ids[len(ids) - limit:]
        return [{"prompt_ids": ids, "reference": reference, "n_in": n_in,
                 "prompt_text": tokenizer.decode(ids, skip_special_tokens=False)}]

    key = ("grpo", limit, tokenizer.name_or_path, len(tokenizer))
    out = _rows.map_rows(ds, fn, ["prompt_ids", "reference", "n_in", "prompt_text"], key,
                         "tokenize prompts")
    n_in = sum(out["n_in"])
    kept = sum(len(x) for x in out["prompt_ids"])
    out = out.remove_columns(["n_in"])
    stats = DataStats(examples=len(ds), rows=len(out), tokens_in=n_in,
                      tokens_dropped=n_in - kept)
    return out, stats


def prompt_batch(rows: list[dict], tokenizer, generations: int) -> Batch:
    """Left-padded prompts ``[B, P]`` (generation appends to the right end of every row) and,
    in ``meta``, their token lists, texts and reference answers; ``generations`` completions
    are sampled per prompt."""
    pad = tokenizer.pad_token_id
    width = max(len(r["prompt_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["prompt_ids"])
        ids[i, width - n:] = torch.tensor(r["prompt_ids"], dtype=torch.long)
        mask[i, width - n:] = 1
    real = int(mask.sum())
    # the prompts' tokens drive the training rows (shared / padding-free: their sum)
    return Batch({"prompt_ids": ids, "prompt_mask": mask}, num_items=0, real_tokens=real,
                 total_tokens=ids.numel(), size_key=(len(rows), width, real),
                 meta={"samples": len(rows) * generations,
                       "prompt_ids": [list(r["prompt_ids"]) for r in rows],
                       "references": [r["reference"] for r in rows],
                       "prompts": [r["prompt_text"] for r in rows],
                       "eos": tokenizer.eos_token_id, "pad": pad,
                       "decode": tokenizer.batch_decode})


def join(prompt: torch.Tensor, prompt_mask: torch.Tensor, completion: torch.Tensor,
         completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded completions -> the training tensors: input_ids,
    attention_mask, position_ids (counting real tokens only) and labels on the completion
    tokens (``labels[t] = input_ids[t+1]``, aligned with input_ids)."""
    ids = torch.cat([prompt, completion.to(prompt.device)], 1)
    attn = torch.cat([prompt_mask, completion_mask.to(prompt_mask.device)], 1)
    labels = torch.full_like(ids, IGNORE)
    p = prompt.shape[1]
    labels[:, p - 1: -1] = completion.masked_fill(completion_mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": attn,
            "position_ids": (attn.cumsum(1) - 1).clamp(min=0), "labels": labels}


def prompt_and_reference(row: dict, idx: int) -> tuple[Any, str]:
    """(prompt, reference answer) of a conversation or a preference row."""
    if "messages" in row and row["messages"] is not None:
        msgs = row["messages"]
        check_messages(msgs, idx, "messages")
        last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last is None:
            raise DataError(f"row {idx}: field 'messages' has no user turn to prompt with")
        answer = next((m["content"] or "" for m in msgs[last + 1:] if m["role"] == "assistant"),
                      "")
        return msgs[: last + 1], answer
    prompt = row.get("prompt")
    chosen = row.get("chosen")
    if isinstance(prompt, list):
        check_messages(prompt, idx, "prompt")
    elif prompt is not None:
        check_text(prompt, idx, "prompt")
    else:
        raise DataError(f"row {idx}: field 'prompt' is empty")
    if isinstance(chosen, list):
        answer = " ".join(m.get("content") or "" for m in chosen if isinstance(m, dict))
    else:
        answer = chosen or ""
    return prompt, answer
