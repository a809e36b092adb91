"""Exact arg-max of ΔT_i over eligible replicas without scanning every replica.

Replicas are bucketed by (sequence count n, KV capacity). Inside a bucket the model's gain
depends only on the token count t: with u = A*t + max(B, C*n) + D and
δ = max(B, C*(n+1)) - max(B, C*n) + A*l, the gain (n+1)/(u+δ) - n/u rises while
n*(u+δ)^2 > (n+1)*u^2 and falls after, so it is unimodal in t with its peak at
u* = δ / (sqrt((n+1)/n) - 1). Eligible replicas (t <= capacity - l) are a prefix of the
bucket sorted by t, and the bucket's best is one of the two neighbours of t*. Usually the
peak lies below the bucket's fewest-token replica (its head), which then wins outright; each
bucket caches its head pre-digested so that case costs one division. A query costs
O(buckets · log I) instead of O(I): buckets are few when replicas are balanced, and at worst
it is the paper's O(I). Ties go to the lowest position in the replica list, as a scan would.

Models other than `ThroughputModel` (the vanilla 0/1 model) use a plain scan.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

from pivotrl_hpc.sched.model import ReplicaThroughput, ThroughputModel
from pivotrl_hpc.sched.state import Replica

_INF = float("inf")


@dataclass
class OpCounter:
    """Counted operations, for checking the O(I·N + I log I) bound of appendix C.2."""

    gain_evals: int = 0     # ΔT_i evaluations
    heap_ops: int = 0       # pushes and pops on replica heaps
    migrations: int = 0     # sequences moved by ShiftUpMigration's loop
    dispatched: int = 0     # sequences placed by Dispatch

    def total(self) -> int:
        return self.gain_evals + self.heap_ops


class DispatchIndex:
    """The replica set R of one Dispatch(Q, R) call, kept current under moves."""

    def __init__(self, model: ReplicaThroughput, replicas: list[Replica],
                 counter: OpCounter | None = None) -> None:
        self.model = model
        self.replicas = replicas
        self.counter = counter
        self._fast = isinstance(model, ThroughputModel) and model.A > 0.0
        self._state = [(r.n_seq, r.n_tok) for r in replicas]
        self._buckets: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for pos, r in enumerate(replicas):
            self._buckets.setdefault((r.n_seq, r.capacity), []).append((r.n_tok, pos))
        # Per bucket, its first (fewest tokens) replica pre-digested for the common case.
        self._heads: dict[tuple[int, int], tuple] = {}
        self._const: dict[tuple[int, int], tuple] = {}
        for key, lst in self._buckets.items():
            lst.sort()
            self._refresh(key)
        self._room = [(-r.remaining, pos) for pos, r in enumerate(replicas)]
        heapq.heapify(self._room)
        self.best = self._best_bucketed if self._fast else self._best_scan

    def _refresh(self, key: tuple[int, int]) -> None:
        """Cache the bucket's fewest-token replica, pre-digested for `_best_bucketed`.

        Gain at x = A*l is (n+1)/(a0 + x) - T; the bucket is decreasing in t from its head
        on (so the head is its best eligible replica) as long as x <= x_max.
        """
        if not self._fast:
            self._heads[key] = ()
            return
        const = self._const.get(key)
        if const is None:
            const = self._const[key] = self._bucket_constants(key)
        c0, c1, kn, dm, peak = const
        t, pos = self._buckets[key][0]
        at = self.model.A * t  # type: ignore[attr-defined]
        u = at + c0
        thr = key[0] / u if key[0] else 0.0  # u may be 0 for an empty replica if B = D = 0
        self._heads[key] = (key[1] - t, u * kn - dm, key[0] + 1, at + c1, thr, pos, peak)

    def _bucket_constants(self, key: tuple[int, int]) -> tuple:
        """Per (n, capacity): c0 = max(B, C n) + D, c1 = max(B, C (n+1)) + D, and the
        factor sqrt((n+1)/n) - 1 locating the gain's peak (module docstring)."""
        m: ThroughputModel = self.model  # type: ignore[assignment]
        n = key[0]
        mn, mn1 = max(m.B, m.C * n), max(m.B, m.C * (n + 1))
        kn = math.sqrt((n + 1) / n) - 1.0 if n else 0.0
        dm = (mn1 - mn) if n else -_INF  # n = 0: gain falls with t, the head always wins
        return (mn + m.D, mn1 + m.D, kn, dm, (key, mn + m.D, mn1 + m.D, kn))

    def max_remaining(self) -> int:
        """Largest free KV capacity among R. Every replica keeps a heap entry at least its
        free capacity (adds leave it stale-high, removals push a fresh one), so a top entry
        that is exact is the maximum; a stale top is corrected in place."""
        room, reps = self._room, self.replicas
        while room:
            neg, pos = room[0]
            actual = reps[pos].capacity - reps[pos].n_tok
            if -neg == actual:
                return actual
            heapq.heapreplace(room, (-actual, pos))
        return -1

    def moved(self, pos: int) -> None:
        """Replica `pos` gained or lost a sequence: refresh its bucket and free room."""
        r = self.replicas[pos]
        n_new, t_new, cap = len(r.seqs), r.n_tok, r.capacity
        n_old, t_old = self._state[pos]
        buckets = self._buckets
        old_key, new_key = (n_old, cap), (n_new, cap)
        old = buckets[old_key]
        i = bisect_left(old, (t_old, pos))
        del old[i]
        if not old:
            del buckets[old_key]
            del self._heads[old_key]
        elif i == 0:
            self._refresh(old_key)
        new = buckets.get(new_key)
        if new is None:
            buckets[new_key] = [(t_new, pos)]
            self._refresh(new_key)
        else:
            insort(new, (t_new, pos))
            if new[0][1] == pos:
                self._refresh(new_key)
        self._state[pos] = (n_new, t_new)
        if t_new < t_old:  # room grew: the old entry may now be too low
            heapq.heappush(self._room, (t_new - cap, pos))

    # `best(length)`: position of the eligible replica with the largest ΔT_i, or None.
    def _best_scan(self, length: int) -> int | None:
        gain = self.model.gain
        best_val, best_pos = -_INF, None
        for pos, r in enumerate(self.replicas):
            if r.remaining >= length:
                val = gain(r.n_seq, r.n_tok, length)
                if val > best_val:
                    best_val, best_pos = val, pos
        if self.counter is not None:
            self.counter.gain_evals += len(self.replicas)
        return best_pos

    def _best_bucketed(self, length: int) -> int | None:
        a = self.model.A  # type: ignore[attr-defined]
        x = a * length
        best_val, best_pos, evals = -_INF, -1, 0
        for room, x_max, p, a0, thr, pos, peak in self._heads.values():
            if room < length:
                continue  # the bucket's fewest-token replica is full: so is the rest
            evals += 1
            if x <= x_max:
                val = p / (a0 + x) - thr
            else:  # the gain peaks inside the bucket: look at the peak's two neighbours
                (n, cap), c0, c1, kn = peak
                lst = self._buckets[(n, cap)]
                hi = bisect_right(lst, (cap - length, _INF))
                t_star = ((c1 - c0 + x) / kn - c0) / a
                t = lst[hi - 1][0]
                if t <= t_star:  # all eligible ones rise with t: the last group wins
                    k = hi - 1
                    if k and lst[k - 1][0] == t:
                        k = bisect_left(lst, (t, -1))
                    pos = lst[k][1]
                    val = p / (a * t + c1 + x) - n / (a * t + c0)
                    if val > best_val or (val == best_val and pos < best_pos):
                        best_val, best_pos = val, pos
                    continue
                j = bisect_left(lst, (t_star, -1))
                val = -_INF
                if j < hi:
                    t, pos = lst[j]
                    val = p / (a * t + c1 + x) - n / (a * t + c0)
                if j > 0:
                    t = lst[j - 1 if j <= hi else hi - 1][0]
                    other = p / (a * t + c1 + x) - n / (a * t + c0)
                    evals += 1
                    if other >= val:  # equal: the lower t group may hold a lower position
                        cand = lst[bisect_left(lst, (t, -1))][1]
                        if other > val or cand < pos:
                            val, pos = other, cand
            if val > best_val or (val == best_val and pos < best_pos):
                best_val, best_pos = val, pos
        if self.counter is not None:
            self.counter.gain_evals += evals
        return None if best_pos < 0 else best_pos
