"""Synthetic plain-text documents: notes with a title, paragraphs, lists, code and Q/A."""

from __future__ import annotations

from memlab.data.synthetic._filler import prose, python_function
from memlab.data.synthetic._qa import answer, question
from memlab.data.synthetic._random import Sampler, draw_rows
from memlab.data.synthetic._tokens import est
from memlab.data.synthetic._words import ALL_TOPICS


def document(g: Sampler, total: int) -> dict:
    """One document ``{"text": str}`` of about ``total`` tokens."""
    topic = g.pick(ALL_TOPICS)
    key = g.pick(topic.nouns)
    title = g.pick(
        (
            f"Notes on the {key}",
            f"A short guide to {topic.name}",
            f"{topic.name.capitalize()}: the {key}",
        )
    )
    blocks = [title.capitalize() if title[0].islower() else title]
    rest = total - est(title) - 2
    while rest > 12:
        kind = g.weighted(("prose", "qa", "code"), (0.55, 0.35, 0.1))
        budget = min(rest, g.randint(40, 400))
        if kind == "prose":
            text, used = prose(g, topic, key, budget)
        elif kind == "qa":
            qtext, q = question(g, topic, 0, budget - 16)
            atext = answer(g, q, max(12, budget - est(qtext) - 4))
            text = f"Q: {qtext}\nA: {atext}"
            used = est(text)
        else:
            verb = g.pick(topic.verbs)
            code = python_function(g, topic, key, verb, max(50, budget - 6))
            text = "```python\n" + code + "\n```"
            used = est(text)
        if not text or used > rest:
            break
        blocks.append(text)
        rest -= used + 2
    return {"text": "\n\n".join(blocks)}


def generate_text(
    n: int,
    seed: int = 0,
    median_tokens: int = 300,
    max_tokens: int = 6000,
    sigma: float | None = None,
) -> list[dict]:
    """``n`` plain-text documents ``{"text": str}`` with the length distribution of
    :func:`generate_chat`: notes with a title, paragraphs, lists, code and Q/A sections."""
    return draw_rows(Sampler(seed, median_tokens, max_tokens, sigma), n, document)
