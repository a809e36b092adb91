"""Candidate set construction: Algorithm 1 with appendix D's semantics."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl_hpc.plan import construct_candidates

pairs_st = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 30).map(float)),
                    min_size=1, max_size=7)


def _brute(sizes, penalties):
    """min penalty for exactly k replicas over all subsets of pairs (each used pair gives
    between 1 and r_i replicas and costs φ_i once)."""
    best: dict[int, float] = {}
    for mask in itertools.product((0, 1), repeat=len(sizes)):
        used = [i for i, b in enumerate(mask) if b]
        if not used:
            continue
        lo, hi = len(used), sum(sizes[i] for i in used)
        cost = sum(penalties[i] for i in used)
        for k in range(lo, hi + 1):
            best[k] = min(best.get(k, float("inf")), cost)
    return best


@settings(max_examples=200, deadline=None)
@given(pairs_st)
def test_dp_penalty_equals_brute_force_minimum(pairs):
    sizes, penalties = [p[0] for p in pairs], [p[1] for p in pairs]
    cands = construct_candidates(sizes, penalties)
    brute = _brute(sizes, penalties)
    assert [c.shift_up_count for c in cands] == sorted(brute)    # one candidate per count k
    for c in cands:
        assert c.penalty == pytest.approx(brute[c.shift_up_count])
        # the plan is consistent: picks are distinct pairs, e within 1..r_i, sum e = k,
        # and each pair's penalty is paid once however many of its replicas are used
        idx = [i for i, _ in c.picks]
        assert len(set(idx)) == len(idx)
        assert all(1 <= e <= sizes[i] for i, e in c.picks)
        assert sum(e for _, e in c.picks) == c.shift_up_count
        assert c.penalty == pytest.approx(sum(penalties[i] for i in idx))


@settings(max_examples=50, deadline=None)
@given(pairs_st, st.integers(1, 6))
def test_dp_respects_max_count(pairs, cap):
    sizes, penalties = [p[0] for p in pairs], [p[1] for p in pairs]
    cands = construct_candidates(sizes, penalties, max_count=cap)
    brute = _brute(sizes, penalties)
    assert [c.shift_up_count for c in cands] == [k for k in sorted(brute) if k <= cap]


def test_equal_penalty_keeps_the_later_candidate():
    # two pairs of one replica and equal penalty: k=1 is reachable through either; the
    # later transition (pair 1) is kept
    cands = construct_candidates([1, 1], [5.0, 5.0])
    assert [(c.shift_up_count, c.penalty, c.picks) for c in cands] == [(1, 5.0, ((1, 1),)),
                                                          (2, 10.0, ((0, 1), (1, 1)))]


def test_penalty_paid_once_per_pair():
    # Figure 8's shape: training pair (2 reward replicas, φ=0), rollout pairs (φ 706, 1843)
    cands = construct_candidates([2, 1, 1], [0.0, 706.0, 1843.0])
    assert [(c.shift_up_count, c.penalty) for c in cands] == [(1, 0.0), (2, 0.0), (3, 706.0),
                                                              (4, 2549.0)]
    assert cands[1].picks == ((0, 2),)
    assert cands[2].picks == ((0, 2), (1, 1))


def test_dp_rejects_bad_pairs():
    with pytest.raises(ValueError, match="r_i >= 1"):
        construct_candidates([0], [1.0])
    with pytest.raises(ValueError, match="differ in length"):
        construct_candidates([1, 2], [1.0])
