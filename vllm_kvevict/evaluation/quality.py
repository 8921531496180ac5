"""How far an eviction setting's next-token distributions are from the full
cache's: the KL divergence used by `kvevict eval` (``ruler_eval.py``).

Every sample is sent as a greedy completion (temperature 0) with logprobs.
The KL is KL(P_full || P_policy) at the first ``KL_POSITIONS`` generated
positions where the policy's greedy tokens so far equal the full cache's (so
both distributions condition on the same text); a sample contributes its
positions up to the first disagreement.

Distributions: the server runs with ``--max-logprobs -1`` and requests ask for
``logprobs=-1`` (the whole vocabulary, 49152 entries for SmolLM2; token ids as
keys via ``return_tokens_as_token_ids``, so tokens that decode to the same
string stay apart), which makes the KL exact. With ``logprobs > 0`` only the
top-k of each side are returned; the KL is then taken over the tokens present
in both top-k lists plus one bucket holding the remaining mass of each side,
a coarsening that can only lower the KL (data-processing inequality).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KL_POSITIONS = 8
TOKEN_ID_PREFIX = "token_id:"


@dataclass
class Completion:
    """One greedy completion: text, generated token ids, and (in memory only) the
    next-token log-distributions of its first positions, NaN where not returned."""

    text: str
    token_ids: list[int]
    seconds: float
    logprobs: np.ndarray | None = field(default=None, repr=False)  # [positions, vocab]


def parse_completion(choice: dict[str, Any], vocab_size: int, seconds: float) -> Completion:
    """Token ids and the first KL_POSITIONS log-distributions of one API choice."""
    logprobs = choice.get("logprobs") or {}
    token_ids = [int(t.removeprefix(TOKEN_ID_PREFIX)) for t in logprobs.get("tokens") or []]
    tops = (logprobs.get("top_logprobs") or [])[:KL_POSITIONS]
    dense = np.full((len(tops), vocab_size), np.nan, dtype=np.float32)
    for position, top in enumerate(tops):
        ids = np.fromiter((int(k.removeprefix(TOKEN_ID_PREFIX)) for k in top), dtype=np.int64, count=len(top))
        values = np.fromiter(top.values(), dtype=np.float64, count=len(top))
        keep = ids < vocab_size
        dense[position, ids[keep]] = values[keep]
    return Completion(choice["text"], token_ids, seconds, dense)


def kl_divergence(full: np.ndarray, policy: np.ndarray) -> float:
    """KL(P_full || P_policy) between two log-distributions over the vocabulary.

    Tokens known on one side only (top-k mode) fall into one tail bucket per
    side; with the whole vocabulary the bucket is empty and this is exact.
    """
    known = ~np.isnan(full) & ~np.isnan(policy)
    log_p = full[known].astype(np.float64)
    log_q = policy[known].astype(np.float64)
    p = np.exp(log_p)
    kl = float(np.sum(p * (log_p - log_q)))
    p_tail = max(0.0, 1.0 - float(p.sum()))
    q_tail = max(0.0, 1.0 - float(np.exp(log_q).sum()))
    if p_tail > 1e-6:
        kl += p_tail * (math.log(p_tail) - math.log(max(q_tail, 1e-12)))
    return max(kl, 0.0)


def compare_to_full(full: Completion, policy: Completion) -> tuple[int, float]:
    """(positions compared, summed KL) over the shared greedy prefix."""
    assert full.logprobs is not None and policy.logprobs is not None
    positions = min(len(full.logprobs), len(policy.logprobs))
    total, compared = 0.0, 0
    for position in range(positions):
        if full.token_ids[:position] != policy.token_ids[:position]:
            break
        total += kl_divergence(full.logprobs[position], policy.logprobs[position])
        compared += 1
    return compared, total
