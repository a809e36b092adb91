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

A Write's replication is the same demand with one difference: only the writers hold the
version at first, so (2) would have them send it to every other node: (N-1) x M / B, 4.6 s
for Qwen2.5-7B over 16 nodes of 50 GB/s IB, 37 s over 128. `chain` makes every receiver a
holder: per atomic slice, the nodes that need it form a line from a holder, and each forwards
chunk i while it receives chunk i+1. Each node receives the model once and sends it at most
once (IB is full duplex), so the Write takes M/B + (N-2) x c/B + (M/c) x overhead for chunks of
c bytes: 0.38 s for 128 nodes at c = M/512. A pipelined binary tree sends the model twice from
every inner node (2 x M/B + log2(N) x 2c/B, 0.62 s there); the chain is faster while
(N-2) x c < M, i.e. up to MAX_CHUNKS nodes. `pipelined_seconds` estimates either plan the way
the agents run it.
"""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

Range = tuple[int, int]
P = TypeVar("P")


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


class Cover:
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
    covers = {h: Cover(rs) for h, rs in holders.items()}
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


def pipelined_seconds(plan: Sequence[Transfer], links: LinkModel) -> float:
    """Makespan of a plan run as the agents run it: a node sends one transfer at a time and
    receives one at a time (full duplex), in plan order, and forwards a piece only once it
    holds it. Of a star plan this is `estimated_seconds`; of a chain, the module doc's sum."""
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    held: dict[tuple[int, int], float] = {}   # (node, piece start) -> when it holds it
    end = 0.0
    for t in plan:
        start = max(send.get(t.src, 0.0), recv.get(t.dst, 0.0), held.get((t.src, t.start), 0.0))
        done = start + links.cost(t.nbytes, t.src, t.dst)
        send[t.src] = recv[t.dst] = held[(t.dst, t.start)] = done
        end = max(end, done)
    return end


# ---- a Write's replication: pipelined chains ------------------------------------------------
MAX_CHUNKS = 512        # pieces of a Write: pulls and relay messages per receiver
MIN_CHUNK = 1 << 20     # a smaller pull costs the agents' loop more than it moves


def chunk_size(nbytes: int, receivers: int, links: LinkModel) -> int:
    """The chain's piece: its fill, (receivers - 1) x c / B, against the pieces' overhead,
    (nbytes / c) x o, is least at c = sqrt(nbytes x o x B / (receivers - 1)); at least
    nbytes / MAX_CHUNKS and MIN_CHUNK; the whole when nobody forwards."""
    if receivers <= 1 or nbytes <= 0:
        return max(1, nbytes)
    best = math.sqrt(nbytes * links.overhead_s * links.remote_bps / (receivers - 1))
    return min(nbytes, max(MIN_CHUNK, -(-nbytes // MAX_CHUNKS), int(best)))


@dataclass(frozen=True)
class ChainPlan:
    """A Write's replication: transfers in dependency order (the transfer that brings a relay
    a piece comes before the one the relay forwards it in); a receiver pulls step by step, a
    step being the pieces of one `chunk`-aligned window from one source."""
    transfers: tuple[Transfer, ...]
    chunk: int

    def step(self, t: Transfer) -> int:
        return t.start // self.chunk


def _lines(who: tuple[int, ...], needs: Sequence[int], span: int) -> list[list[int]]:
    """The receivers in ring order after the first holder, cut into one contiguous run per
    holder (at most one per receiver), each run led by its holder."""
    ring = sorted(needs, key=lambda n: ((n - who[0]) % span, n))
    k = min(len(who), len(ring))
    cuts = [round(i * len(ring) / k) for i in range(k + 1)]
    return [[who[j], *ring[cuts[j]:cuts[j + 1]]] for j in range(k)]


def chain(holders: Mapping[int, Sequence[Range]], targets: Mapping[int, Sequence[Range]],
          links: LinkModel, chunk: int | None = None) -> ChainPlan:
    """Every atomic slice goes down lines of the nodes that need it, one line per holder,
    in pieces of `chunk` bytes (default `chunk_size`), each receiver forwarding to the next."""
    need: dict[Range, tuple[tuple[int, ...], list[int]]] = {}
    for rng, recv, who in refine(holders, targets):
        if recv not in who:
            need.setdefault(rng, (who, []))[1].append(recv)
    receivers = max((len(r) for _, r in need.values()), default=0)
    if chunk is None and receivers <= 1:   # nobody forwards: one step, from each holder
        chunk = max((b for _, b in need), default=1)
    elif chunk is None:
        chunk = chunk_size(sum(b - a for a, b in need), receivers, links)
    span = 1 + max([*holders, *targets], default=0)
    lines_of: dict[tuple, list[list[int]]] = {}
    out: list[Transfer] = []
    for (a, b), (who, needs) in sorted(need.items()):
        key = (who, tuple(needs))
        if key not in lines_of:
            lines_of[key] = _lines(who, needs, span)
        x = a
        while x < b:
            y = min(b, (x // chunk + 1) * chunk)
            out.extend(Transfer(src, dst, x, y) for line in lines_of[key]
                       for src, dst in zip(line, line[1:]))
            x = y
    return ChainPlan(tuple(out), chunk)


class PlanCache:
    """Plans memoized by signature <M, G, P> (plus the layout they were built for)."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, signature: Hashable, build: Callable[[], P]) -> P:
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
