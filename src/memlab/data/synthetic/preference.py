"""Synthetic conversational preference pairs: a careful chosen and a careless rejected answer."""

from __future__ import annotations

from memlab.data.synthetic._qa import answer
from memlab.data.synthetic._random import Sampler, draw_rows
from memlab.data.synthetic._tokens import MSG_OVERHEAD, est_messages
from memlab.data.synthetic.chat import conversation

GENERATION_PROMPT = 3
"""Estimated tokens of the generation prompt (``<|im_start|>assistant\\n``)."""


def preference_row(g: Sampler, total: int) -> dict:
    """One pair ``{"prompt", "chosen", "rejected"}``; prompt + chosen about ``total`` tokens."""
    prompt_budget = max(12, int(total * (0.15 + 0.6 * g.rnd())))
    prompt, q = conversation(
        g, prompt_budget, final_answer=False, answer_hint=total - prompt_budget - MSG_OVERHEAD
    )
    used = est_messages(prompt) + GENERATION_PROMPT
    chosen_budget = max(12, total - used - MSG_OVERHEAD)
    rejected_budget = max(12, int(chosen_budget * (0.5 + g.rnd())))
    rejected_budget = min(rejected_budget, max(12, g.cap - used - MSG_OVERHEAD))
    chosen = answer(g, q, chosen_budget, good=True)
    rejected = answer(g, q, rejected_budget, good=False)
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def _tokens(row: dict) -> int:
    """Estimated length of the longer of prompt + chosen and prompt + rejected."""
    longest = max(est_messages(row["chosen"]), est_messages(row["rejected"]))
    return est_messages(row["prompt"]) + GENERATION_PROMPT + longest


def generate_preference(
    n: int,
    seed: int = 0,
    median_tokens: int = 300,
    max_tokens: int = 6000,
    sigma: float | None = None,
) -> list[dict]:
    """``n`` conversational preference pairs ``{"prompt", "chosen", "rejected"}``.

    ``prompt`` is a list of messages ending with a user turn; ``chosen`` and ``rejected`` are one
    assistant message each, of independent lengths. Prompt + chosen follows the length
    distribution of :func:`generate_chat`; prompt + rejected also stays within ``max_tokens``.
    The chosen answer is polite, on topic, names the question's key noun and gets arithmetic and
    item counts right; the rejected one hedges, drifts off topic and never names the key noun.
    """
    return draw_rows(
        Sampler(seed, median_tokens, max_tokens, sigma), n, preference_row, tokens=_tokens
    )
