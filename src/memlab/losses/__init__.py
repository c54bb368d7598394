"""Pure-PyTorch, device-agnostic losses.

Token level (:mod:`memlab.losses.token`):

* :func:`token_logps` (:func:`forked_token_logps`: a second label at some positions),
  :func:`sequence_logps`, :func:`segment_logps` -- label log-probs per token, per (padded)
  sequence and per packed segment, without extra ``[..., V]`` copies.

The head and the loss together (:mod:`memlab.losses.linear_ce`):

* :func:`chunked_linear_cross_entropy` / :class:`ChunkedCrossEntropy` -- cross-entropy of
  ``hidden @ weight.T`` computed over token chunks, never materializing the ``[N, V]`` logits;
  :class:`TiedWeightGrad` hands its weight gradient to a tied input embedding's lookup.

Preference / reward (:mod:`memlab.losses.preference`):

* :func:`dpo_loss` (sigmoid / IPO / hinge), :func:`kto_loss` with :func:`kto_kl_estimate`,
  :func:`bradley_terry_loss`.
"""

IGNORE = -100
"""Label value that no loss counts (the ``ignore_index`` of every token loss here)."""

from memlab.losses.linear_ce import (  # noqa: E402
    ChunkedCrossEntropy,
    LinearCrossEntropyFunction,
    chunked_linear_cross_entropy,
)
from memlab.losses.preference import (  # noqa: E402
    bradley_terry_loss,
    dpo_loss,
    kto_kl_estimate,
    kto_loss,
)
from memlab.losses.tied import TiedWeightGrad  # noqa: E402
from memlab.losses.token import (  # noqa: E402
    forked_token_logps,
    segment_logps,
    sequence_logps,
    token_logps,
)

__all__ = [
    "IGNORE",
    "ChunkedCrossEntropy",
    "LinearCrossEntropyFunction",
    "TiedWeightGrad",
    "bradley_terry_loss",
    "chunked_linear_cross_entropy",
    "dpo_loss",
    "forked_token_logps",
    "kto_kl_estimate",
    "kto_loss",
    "segment_logps",
    "sequence_logps",
    "token_logps",
]
