"""Synthetic chat conversations: 1-3 user/assistant turns, sometimes a system message."""

from __future__ import annotations

from memlab.data.synthetic._qa import answer, question
from memlab.data.synthetic._random import Sampler, draw_rows
from memlab.data.synthetic._tokens import MSG_OVERHEAD, Message, est, est_messages
from memlab.data.synthetic._words import ALL_TOPICS, GOOD_ADVERBS, SYSTEMS


def conversation(
    g: Sampler, total: int, final_answer: bool = True, answer_hint: int = 0
) -> tuple[list[Message], dict]:
    """Messages of about ``total`` tokens (chat template included).

    Without ``final_answer`` the last user turn is left unanswered, ``total`` covers the
    prompt only and ``answer_hint`` is the budget of the answer to come. Returns the messages
    and the info of the last question.
    """
    topic = g.pick(ALL_TOPICS)
    msgs: list[Message] = []
    rest = total
    if g.rnd() < 0.3:
        system = g.pick(SYSTEMS).format(t=topic.name, adv=g.pick(GOOD_ADVERBS))
        msgs.append({"role": "system", "content": system})
        rest -= est(system) + MSG_OVERHEAD
    turns = g.weighted((1, 2, 3), (0.6, 0.25, 0.15))
    turns = max(1, min(turns, rest // 60))
    weights = [0.4 + g.rnd() for _ in range(turns)]
    scale = (rest - 2 * MSG_OVERHEAD * turns) / sum(weights)
    q: dict = {}
    for i in range(turns):
        budget = max(16, int(weights[i] * scale))
        last = i == turns - 1
        if i > 0 and g.rnd() < 0.2:
            topic = g.pick(ALL_TOPICS)
        if last and not final_answer and g.rnd() < 0.5:
            user_budget = budget + MSG_OVERHEAD  # the rest goes to the answer otherwise
        elif budget > 120 and g.rnd() < 0.2:
            user_budget = int(budget * (0.5 + 0.35 * g.rnd()))  # pasted notes
        else:
            user_budget = int(budget * 0.04 * g.rnd())
        answer_budget = answer_hint if last and not final_answer else budget - user_budget
        text, q = question(g, topic, user_budget, answer_budget, followup=i > 0)
        msgs.append({"role": "user", "content": text})
        if last and not final_answer:
            break
        answer_budget = budget - est(text)
        msgs.append({"role": "assistant", "content": answer(g, q, answer_budget)})
    return msgs, q


def generate_chat(
    n: int,
    seed: int = 0,
    median_tokens: int = 300,
    max_tokens: int = 6000,
    sigma: float | None = None,
) -> list[dict]:
    """``n`` conversations ``{"messages": [{"role", "content"}, ...]}``.

    1-3 user/assistant turns, a system message in ~30% of rows; the total length (chat template
    included) is lognormal with median ``median_tokens`` and log-std ``sigma`` (default 1.1:
    p90 ~4x, p99 ~13x the median), capped at ``max_tokens``.
    """
    return draw_rows(
        Sampler(seed, median_tokens, max_tokens, sigma),
        n,
        lambda g, total: {"messages": conversation(g, total)[0]},
        tokens=lambda row: est_messages(row["messages"]),
    )
