"""Exact arg-max of ΔT_i over eligible replicas without scanning every replica.

Replicas are bucketed by (sequence count n, KV capacity). Inside a bucket the model's gain
depends only on the token count t: with u = A*t + max(B, C*n) + D and
δ = max(B, C*(n+1)) - max(B, C*n) + A*l, the gain (n+1)/(u+δ) - n/u rises while
n*(u+δ)^2 > (n+1)*u^2 and falls after, so it is unimodal in t with its peak at
u* = δ / (sqrt((n+1)/n) - 1). Eligible replicas (t <= capacity - l) are a prefix of the
bucket sorted by t, and the bucket's best is one of the two neighbours of t*. Usually the
peak lies below the bucket's fewest-token replica (its head), which then wins outright; each
bucket caches its head pre-digested so that case costs one comparison and one division. A
bucket whose peak lies inside is skipped when even the gain at the peak, over all t, cannot
reach the best found so far. A query costs O(buckets · log I) instead of O(I): buckets are
few when replicas are balanced, and at worst it is the paper's O(I). Ties go to the lowest
position in the replica list, as a scan would.

The index keeps its own copy of every replica's (n, t, capacity): `moved(pos)` re-reads a
`Replica`, while `place` / `update` let a caller without Replica objects (the planner's
migration simulation, plan.simulate) drive it from plain counts. Models other than
`ThroughputModel` (the vanilla 0/1 model) use a plain scan.
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
    """The replica set R of one Dispatch(Q, R) call, kept current under moves.

    `constants` may be shared by indices over the same model: it caches per-(n, capacity)
    constants, which many short-lived indices (one per simulated candidate) would otherwise
    recompute."""

    def __init__(self, model: ReplicaThroughput, replicas: list[Replica],
                 counter: OpCounter | None = None, constants: dict | None = None) -> None:
        self.replicas: list[Replica] | None = replicas
        self._setup(model, [r.n_seq for r in replicas], [r.n_tok for r in replicas],
                    [r.capacity for r in replicas], counter, constants)

    @classmethod
    def from_counts(cls, model: ReplicaThroughput, n: list[int], t: list[int],
                    cap: list[int], counter: OpCounter | None = None,
                    constants: dict | None = None) -> "DispatchIndex":
        """An index over plain (sequences, tokens, capacity) lists, which it takes over."""
        index = cls.__new__(cls)
        index.replicas = None
        index._setup(model, n, t, cap, counter, constants)
        return index

    def _setup(self, model: ReplicaThroughput, n: list[int], t: list[int], cap: list[int],
               counter: OpCounter | None, constants: dict | None) -> None:
        self.model = model
        self.counter = counter
        self.n, self.t, self.cap = n, t, cap   # current sequences, tokens, capacity per pos
        self._fast = isinstance(model, ThroughputModel) and model.A > 0.0
        self._a = model.A if self._fast else 0.0  # type: ignore[attr-defined]
        # Buckets hold (t, pos, head digest), sorted by t.
        self._const: dict[tuple[int, int], tuple] = {} if constants is None else constants
        self._buckets: dict[tuple[int, int], list[tuple]] = {}
        for pos, key in enumerate(zip(n, cap)):
            self._buckets.setdefault(key, []).append(self._entry(key, t[pos], pos))
        self._heads: dict[tuple[int, int], tuple] = {}  # per bucket, its head's digest
        for key, lst in self._buckets.items():
            lst.sort()
            self._heads[key] = _head(lst)
        self._room = [(t_ - c, pos) for pos, (t_, c) in enumerate(zip(t, cap))]
        heapq.heapify(self._room)
        self.best = self._best_bucketed if self._fast else self._best_scan

    def _entry(self, key: tuple[int, int], t: int, pos: int) -> tuple:
        """A replica's bucket entry, with its state pre-digested for `_best_bucketed` once,
        for whenever it heads its bucket.

        Gain at x = A*l is (n+1)/(a0 + x) - T; the bucket is decreasing in t from its head
        on (so the head is its best eligible replica) as long as x <= x_max. Sequences of at
        most `lim` tokens surely satisfy that and fit the head: one comparison per query.
        """
        if not self._fast:
            return (t, pos, ())
        const = self._const.get(key)
        if const is None:
            const = self._const[key] = self._bucket_constants(key)
        c0, c1, kn, dm, peak = const
        a = self._a
        at = a * t
        u = at + c0
        n = key[0]
        thr = n / u if n else 0.0  # u may be 0 for an empty replica if B = D = 0
        room = key[1] - t
        x_max = u * kn - dm
        q = x_max / a  # lim: x_max/A less a one-token margin for rounding (-1: unsure)
        if q >= 4.0 * room:
            lim = room
        elif 0.0 <= q < 1e15:
            lim = int(q) - 1
            if lim > room:
                lim = room
        else:
            lim = -1
        return (t, pos, (lim, room, n + 1, at + c1, thr, pos, x_max, peak))

    def _bucket_constants(self, key: tuple[int, int]) -> tuple:
        """Per (n, capacity): c0 = max(B, C n) + D, c1 = max(B, C (n+1)) + D (the FFN term
        of the model at n and n + 1: `ffn_seconds`), and the
        factor sqrt((n+1)/n) - 1 locating the gain's peak (module docstring)."""
        m: ThroughputModel = self.model  # type: ignore[assignment]
        n = key[0]
        mn, mn1 = m.ffn_seconds(n), m.ffn_seconds(n + 1)   # an MoE model's grows with n
        kn = math.sqrt((n + 1) / n) - 1.0 if n else 0.0
        dm = (mn1 - mn) if n else -_INF  # n = 0: gain falls with t, the head always wins
        c0, c1 = mn + m.D, mn1 + m.D
        # Over all t the gain is at most g / (δ0 + A*l), δ0 = c1 - c0: its value at the peak
        # u* = δ/kn. g is inflated for its own rounding (cancellation: relative ε·n), and
        # `slack` covers the rounding of the gain as computed (ε·n on terms up to (n+1)/c0).
        g = kn * ((n + 1) / (1.0 + kn) - n) * (1.0 + 1e-9 + n * 1e-15) if n else _INF
        slack = 16.0 * 2.0 ** -53 * (n + 1) / c0 if n else _INF
        return (c0, c1, kn, dm, (key, c0, c1, kn, c1 - c0, g, slack))

    def max_remaining(self) -> int:
        """Largest free KV capacity among R. Every replica keeps a heap entry at least its
        free capacity (adds leave it stale-high, removals push a fresh one), so a top entry
        that is exact is the maximum; a stale top is corrected in place."""
        room, t, cap = self._room, self.t, self.cap
        while room:
            neg, pos = room[0]
            actual = cap[pos] - t[pos]
            if -neg == actual:
                return actual
            heapq.heapreplace(room, (-actual, pos))
        return -1

    def moved(self, pos: int) -> None:
        """Replica `pos` gained or lost a sequence: refresh its bucket and free room."""
        r = self.replicas[pos]  # type: ignore[index]
        self.update(pos, len(r.seqs), r.n_tok)

    def place(self, pos: int, length: int) -> None:
        """A sequence of `length` tokens was added to replica `pos`."""
        self.update(pos, self.n[pos] + 1, self.t[pos] + length)

    def update(self, pos: int, n_new: int, t_new: int) -> None:
        """Replica `pos` now runs `n_new` sequences holding `t_new` tokens."""
        cap = self.cap[pos]
        n_old, t_old = self.n[pos], self.t[pos]
        buckets, heads = self._buckets, self._heads
        old_key, new_key = (n_old, cap), (n_new, cap)
        old = buckets[old_key]
        i = 0 if old[0][1] == pos else bisect_left(old, (t_old, pos))  # usually the head
        del old[i]
        if not old:
            del buckets[old_key]
            del heads[old_key]
        elif i == 0 or len(old) == 1:
            heads[old_key] = old[0][2] if len(old) > 1 else _head(old)
        entry = self._entry(new_key, t_new, pos)
        new = buckets.get(new_key)
        if new is None:
            buckets[new_key] = [entry]
            heads[new_key] = _head(buckets[new_key])
        else:
            insort(new, entry)
            if new[0][1] == pos or len(new) == 2:  # a new head, or no longer alone
                heads[new_key] = new[0][2]
        self.n[pos], self.t[pos] = n_new, t_new
        if t_new < t_old:  # room grew: the old entry may now be too low
            heapq.heappush(self._room, (t_new - cap, pos))

    # `best(length)`: position of the eligible replica with the largest ΔT_i, or None.
    def _best_scan(self, length: int) -> int | None:
        gain = self.model.gain
        best_val, best_pos = -_INF, None
        for pos, (n, t, cap) in enumerate(zip(self.n, self.t, self.cap)):
            if cap - t >= length:
                val = gain(n, t, length)
                if val > best_val:
                    best_val, best_pos = val, pos
        if self.counter is not None:
            self.counter.gain_evals += len(self.n)
        return best_pos

    def _best_bucketed(self, length: int) -> int | None:
        x = self._a * length
        best_val, best_pos = -_INF, -1
        for lim, room, p, a0, thr, pos, x_max, peak in self._heads.values():
            if length <= lim:  # the common case: the head is its bucket's best
                val = p / (a0 + x) - thr
            elif length > room:
                continue  # the bucket's fewest-token replica is full: so is the rest
            elif x <= x_max:
                val = p / (a0 + x) - thr
            elif peak[5] / (peak[4] + x) + peak[6] < best_val:
                continue  # no replica of the bucket can reach the best so far
            else:
                val, pos = self._peak_best(length, x, p, pos, peak)
            if val > best_val or (val == best_val and pos < best_pos):
                best_val, best_pos = val, pos
        if self.counter is not None:
            self.counter.gain_evals += sum(h[1] >= length for h in self._heads.values())
        return None if best_pos < 0 else best_pos

    def _peak_best(self, length: int, x: float, p: int, pos: int, peak: tuple
                   ) -> tuple[float, int]:
        """The gain peaks inside the bucket: its best is a neighbour of the peak."""
        a = self._a
        (n, cap), c0, c1, kn = peak[:4]
        lst = self._buckets[(n, cap)]
        hi = bisect_right(lst, (cap - length, _INF))
        t_star = ((c1 - c0 + x) / kn - c0) / a
        t = lst[hi - 1][0]
        if t <= t_star:  # all eligible ones rise with t: the last group wins
            k = hi - 1
            if k and lst[k - 1][0] == t:
                k = bisect_left(lst, (t, -1))
            return p / (a * t + c1 + x) - n / (a * t + c0), lst[k][1]
        j = bisect_left(lst, (t_star, -1))
        val = -_INF
        if j < hi:
            t, pos = lst[j][:2]
            val = p / (a * t + c1 + x) - n / (a * t + c0)
        if j > 0:
            t = lst[j - 1 if j <= hi else hi - 1][0]
            other = p / (a * t + c1 + x) - n / (a * t + c0)
            if self.counter is not None:
                self.counter.gain_evals += 1
            if other >= val:  # equal: the lower t group may hold a lower position
                cand = lst[bisect_left(lst, (t, -1))][1]
                if other > val or cand < pos:
                    val, pos = other, cand
        return val, pos


def _head(bucket: list[tuple]) -> tuple:
    """The digest `_best_bucketed` reads for a bucket. A lone replica is its bucket's best
    whatever the peak (the two formulas then agree), so it may use its whole room."""
    digest = bucket[0][2]
    if len(bucket) == 1 and digest:
        return (digest[1],) + digest[1:]
    return digest
