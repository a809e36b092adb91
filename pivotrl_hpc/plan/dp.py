"""Candidate set construction: Algorithm 1 with the semantics of appendix D.

Pair i offers its first e of r_i shift-up replicas (1 <= e <= r_i) for a penalty φ_i paid
once however many are used. D[j] is the least penalty for exactly j replicas; on equal
penalty the later transition in the traversal order (pairs in order, j ascending, e
ascending) is kept; one candidate per count k. Plans are kept as back-pointer chains so a
transition costs O(1), and the whole construction is O(K·I).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

_INF = float("inf")


@dataclass(frozen=True)
class Candidate:
    shift_up_count: int                   # k: shift-up replicas
    penalty: float                        # D[k]
    picks: tuple[tuple[int, int], ...]    # (pair index, e): the first e replicas of pair i


def construct_candidates(sizes: Sequence[int], penalties: Sequence[float],
                         max_count: int | None = None) -> list[Candidate]:
    """Algorithm 1 over ordered pairs (r_i = sizes[i], φ_i = penalties[i]).

    `max_count` is K; by default the number of eligible shift-up replicas, Σ r_i.
    """
    if len(sizes) != len(penalties):
        raise ValueError("sizes and penalties differ in length")
    if any(r < 1 for r in sizes) or any(not p >= 0.0 for p in penalties):
        raise ValueError("every shift pair needs r_i >= 1 replicas and a penalty >= 0")
    big_k = sum(sizes) if max_count is None else max_count
    dp = [0.0] + [_INF] * big_k
    plan: list[tuple | None] = [None] * (big_k + 1)  # (previous node, pair, e)
    for i, (r, phi) in enumerate(zip(sizes, penalties)):
        dp_next, plan_next = dp[:], plan[:]
        for j in range(big_k + 1):
            if dp[j] == _INF:
                continue
            d = dp[j] + phi
            node = plan[j]
            for e in range(1, min(r, big_k - j) + 1):
                if d <= dp_next[j + e]:  # min(D̂, d) == d: take it, later wins ties
                    dp_next[j + e] = d
                    plan_next[j + e] = (node, i, e)
        dp, plan = dp_next, plan_next
    return [Candidate(k, dp[k], _picks(plan[k])) for k in range(1, big_k + 1) if dp[k] < _INF]


def _picks(node: tuple | None) -> tuple[tuple[int, int], ...]:
    out = []
    while node is not None:
        node, i, e = node
        out.append((i, e))
    return tuple(reversed(out))
