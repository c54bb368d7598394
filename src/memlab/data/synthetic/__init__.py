"""Deterministic synthetic chat, plain-text and preference data (no network, no global state).

Every generator draws from its own ``random.Random(seed)``: the same ``(n, seed, ...)`` always
gives the same rows, and the first ``k`` rows of ``n > k`` rows equal the rows of ``n = k``.

Two properties matter for memlab's measurements and tests:

* **Realistic lengths.** The total token length of a row (under the shipped tokenizer, chat
  template included) is lognormal: median ``median_tokens`` (a few hundred by default), a tail
  to several thousand (p99 about 13x the median with the default ``sigma``), capped at
  ``max_tokens``. Padding waste, packing gains and peak memory therefore look like they do on
  real chat data.
* **Learnable content.** Text comes from a small grammar over ~750 words in 20 topics: how-to
  steps, explanations, numbered lists, python snippets, arithmetic and comparisons. Answers echo
  the topic and the key noun of the question, so a tiny causal LM's loss falls within tens of
  steps, also with a completion-only loss. In preference pairs the chosen answer is always
  polite, on topic and names the key noun with a "careful" vocabulary (and correct arithmetic
  or item counts); the rejected one is hedging, careless and off the point. A tiny DPO or
  reward model picks this up within a few hundred steps.

Lengths are budgeted with a cheap word/punctuation count (``_tokens.est``) that tracks the
shipped byte-level BPE tokenizer (trained on this very text) to within a few percent.

Modules: ``chat``, ``text`` and ``preference`` build the rows of each kind; ``_qa`` asks
questions and answers them carefully or carelessly; ``_filler`` writes filler paragraphs and
code; ``_random`` holds the one random source and the row-length loop; ``_words`` the word and
template tables; ``_tokens`` the token estimate.
"""

from __future__ import annotations

from memlab.data.synthetic._words import TOPICS
from memlab.data.synthetic.chat import generate_chat
from memlab.data.synthetic.preference import generate_preference
from memlab.data.synthetic.text import generate_text

__all__ = ["TOPICS", "generate_chat", "generate_preference", "generate_text"]
