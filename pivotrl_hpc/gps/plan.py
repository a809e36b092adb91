"""The all-to-all plan of Read and Write (paper appendix B.2), over byte ranges of a segment.

1. Align slicing granularity: the holders' layout (which byte ranges each node holds) and the
   target layout (which ranges each receiver needs) are refined to their common boundaries,
   giving atomic slices that no transfer ever splits.
2. Every (atomic slice, receiver) demand goes, in order, to the holder with the least
   accumulated estimated latency, where one transfer costs bytes / link bandwidth + a fixed
   overhead, so fast (node-local) links take proportionally more data. The comparison counts
   the candidate's latency including this transfer over its own link, so an idle holder
   behind a slow link does not grab a slice a busy fast holder would still finish sooner.
3. Plans are cached by signature (model, device set, parallelism, layout); afterwards
   contiguous slices with the same sender and receiver are merged into one transfer.
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

Range = tuple[int, int]


@dataclass(frozen=True)
class LinkModel:
    """Profiled link bandwidths (bytes/s) and per-transfer overhead (s)."""
    local_bps: float = 10e9
    remote_bps: float = 2e9
    overhead_s: float = 20e-6
    pairs: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def cost(self, nbytes: int, src: int, dst: int) -> float:
        bw = self.pairs.get((src, dst)) or (self.local_bps if src == dst else self.remote_bps)
        return nbytes / bw + self.overhead_s


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def merge_ranges(ranges: Sequence[Range]) -> list[Range]:
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class _Cover:
    """Fast 'does this holder hold [a, b)' over merged ranges."""

    def __init__(self, ranges: Sequence[Range]):
        self.ranges = merge_ranges(ranges)
        self.starts = [a for a, _ in self.ranges]

    def holds(self, a: int, b: int) -> bool:
        i = bisect.bisect_right(self.starts, a) - 1
        return i >= 0 and self.ranges[i][1] >= b


def refine(holders: Mapping[int, Sequence[Range]],
           targets: Mapping[int, Sequence[Range]]) -> list[tuple[Range, int, tuple[int, ...]]]:
    """Common refinement: [(atomic slice, receiver, holders of that slice)], in slice order."""
    cuts = set()
    for rs in list(holders.values()) + list(targets.values()):
        for a, b in rs:
            cuts.update((a, b))
    points = sorted(cuts)
    covers = {h: _Cover(rs) for h, rs in holders.items()}
    demands = []
    for recv in sorted(targets):
        for a, b in merge_ranges(targets[recv]):
            i = bisect.bisect_left(points, a)
            while i + 1 < len(points) and points[i] < b:
                x, y = points[i], points[i + 1]
                who = tuple(h for h, c in sorted(covers.items()) if c.holds(x, y))
                if not who:
                    raise LookupError(f"no holder has bytes [{x}, {y}) needed by node {recv}")
                demands.append(((x, y), recv, who))
                i += 1
    return demands


def assign(demands: Sequence[tuple[Range, int, tuple[int, ...]]], links: LinkModel,
           skip_local: bool = True) -> list[Transfer]:
    """Greedy least-accumulated-latency assignment; contiguous same-pair slices merged.

    With `skip_local`, a demand that its receiver already holds moves nothing.
    """
    load: dict[int, float] = {}
    chosen: list[Transfer] = []
    for (a, b), recv, who in demands:
        if skip_local and recv in who:
            continue
        src = min(who, key=lambda h: (load.get(h, 0.0) + links.cost(b - a, h, recv), h))
        load[src] = load.get(src, 0.0) + links.cost(b - a, src, recv)
        chosen.append(Transfer(src, recv, a, b))
    chosen.sort(key=lambda t: (t.src, t.dst, t.start))
    merged: list[Transfer] = []
    for t in chosen:
        last = merged[-1] if merged else None
        if last and (last.src, last.dst, last.stop) == (t.src, t.dst, t.start):
            merged[-1] = Transfer(t.src, t.dst, last.start, t.stop)
        else:
            merged.append(t)
    return merged


def estimated_seconds(plan: Sequence[Transfer], links: LinkModel) -> float:
    """Makespan estimate: the busiest sender's accumulated latency."""
    per: dict[int, float] = {}
    for t in plan:
        per[t.src] = per.get(t.src, 0.0) + links.cost(t.nbytes, t.src, t.dst)
    return max(per.values(), default=0.0)


class PlanCache:
    """Plans memoized by signature <M, G, P> (plus the layout they were built for)."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, list[Transfer]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, signature: Hashable, build: Callable[[], list[Transfer]]) -> list[Transfer]:
        with self._lock:
            plan = self._plans.get(signature)
            if plan is not None:
                self.hits += 1
                return plan
            self.misses += 1
        plan = build()
        with self._lock:
            self._plans[signature] = plan
        return plan
