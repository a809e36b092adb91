"""One node's part of a Write's chained replication (plan.chain): what it pulls, from which
node, in which order, and which nodes it tells that it now holds a piece.

A step (the pieces of one chunk window from one source, plan.ChainPlan.step) is pulled once its
source holds all of it: a writer from the start, a relay once it announced the pieces (the
agents' `holds` message). At most WINDOW steps are in flight, so steps finish about in order
and the next node pulls piece i while this one pulls piece i+1.

A relay that fails is dropped, and every step still due from it is pulled from the slice's
first-hand holders (the writers) instead: a pull from it that keeps failing (fetch.Pull's
retries), or no announcement from it for `wait_s` while a step waits on it. A pull from a
first-hand holder that keeps failing raises fetch.TransferError: the Write fails, as it did
before chains. The version is published only once every step is done, whatever its source.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pivotrl_hpc.gps.fetch import Pull, TransferError
from pivotrl_hpc.gps.plan import ChainPlan, Cover, Range, Transfer

log = logging.getLogger(__name__)

WINDOW = 2   # steps in flight: one moving while the loop notices the other finish


@dataclass
class Step:
    src: int
    transfers: list[Transfer]
    first_hand: bool          # the source held all of it before the replication began
    pull: Pull | None = None
    done: bool = False

    @property
    def ranges(self) -> list[Range]:
        return [(t.start, t.stop) for t in self.transfers]


class Relay:
    """`start(src, transfers)` makes the Pull of one step; `announced[src]` is the set of
    pieces `src` said it holds and `heard[src]` when it last said so (both filled by the
    agent as `holds` messages arrive, before or after this Relay exists)."""

    def __init__(self, plan: ChainPlan, me: int, holders: Mapping[int, Sequence[Range]],
                 start: Callable[[int, list[Transfer]], Pull],
                 announced: Mapping[int, set[Range]], heard: Mapping[int, float],
                 wait_s: float, now: float):
        self.me, self.start, self.wait_s, self.t0 = me, start, wait_s, now
        self.announced, self.heard = announced, heard
        self.covers = {n: Cover(rs) for n, rs in holders.items()}
        by_step: dict[tuple[int, int], list[Transfer]] = {}
        self.downstream: dict[int, set[Range]] = {}   # node -> pieces it pulls from here
        for t in plan.transfers:
            if t.dst == me:
                by_step.setdefault((plan.step(t), t.src), []).append(t)
            elif t.src == me:
                self.downstream.setdefault(t.dst, set()).add((t.start, t.stop))
        self.steps = [self._step(src, ts) for (_, src), ts in sorted(by_step.items())]
        self.dropped: dict[int, str] = {}          # relay -> why it was dropped
        self.bytes_from: dict[int, int] = {}

    def _step(self, src: int, transfers: list[Transfer]) -> Step:
        cover = self.covers.get(src)
        first = cover is not None and all(cover.holds(t.start, t.stop) for t in transfers)
        return Step(src, transfers, first)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.steps)

    def advance(self, now: float) -> list[Range]:
        """Poll the steps in flight and start the next ready ones; the pieces newly held."""
        got: list[Range] = []
        failed: dict[int, str] = {}
        for s in self.steps:
            if s.pull is None or s.done:
                continue
            try:
                finished = s.pull.done()
            except TransferError as e:
                if s.first_hand:
                    raise
                failed[s.src] = str(e)
                continue
            if finished:
                s.done = True
                self.bytes_from[s.src] = self.bytes_from.get(s.src, 0) + s.pull.nbytes
                got.extend(s.ranges)
        busy = sum(s.pull is not None and not s.done for s in self.steps)
        for s in self.steps:
            if busy >= WINDOW:
                break
            if s.pull is None and not s.done and s.src not in failed:
                if self._ready(s, now, failed):
                    s.pull = self.start(s.src, s.transfers)
                    busy += 1
        for relay, why in failed.items():
            self._drop(relay, why)
        return got

    def _ready(self, s: Step, now: float, failed: dict[int, str]) -> bool:
        if s.first_hand:
            return True
        held = self.announced.get(s.src, ())
        if all(r in held for r in s.ranges):
            return True
        quiet = now - max(self.t0, self.heard.get(s.src, self.t0))
        if quiet > self.wait_s:
            failed[s.src] = f"announced nothing for {quiet:.1f} s"
        return False

    def _drop(self, relay: int, why: str) -> None:
        """Every step still due from `relay` comes from its pieces' first-hand holders."""
        log.warning("GPS replication on node %d: relay node %d dropped (%s); its pieces come "
                    "from the writers", self.me, relay, why)
        self.dropped[relay] = why
        steps: list[Step] = []
        for s in self.steps:
            if s.src != relay or s.done:
                steps.append(s)
                continue
            by_src: dict[int, list[Transfer]] = {}
            for t in s.transfers:
                h = min(n for n, c in self.covers.items() if c.holds(t.start, t.stop))
                by_src.setdefault(h, []).append(Transfer(h, t.dst, t.start, t.stop))
            steps.extend(self._step(h, ts) for h, ts in sorted(by_src.items()))
        self.steps = steps

    def tell(self, got: list[Range]) -> dict[int, list[Range]]:
        """Which downstream node needs to hear of which of the pieces just held."""
        out: dict[int, list[Range]] = {}
        for node, pieces in self.downstream.items():
            mine = [r for r in got if r in pieces]
            if mine:
                out[node] = mine
        return out

    def stats(self) -> dict:
        return {"bytes_from": {str(n): b for n, b in sorted(self.bytes_from.items())},
                "steps": len(self.steps), "dropped": {str(n): w for n, w in
                                                      self.dropped.items()}}
