"""Which shift-up migration loop runs (Algorithm 4 as the paper states it, or `least_loss`).

`paper` (Algorithm 4, appendix C): pop the max-throughput replica, move its shortest sequence
to Dispatch's best replica, stop at the first move that would not raise aggregate
throughput. Once the throughput model saturates (max(B, C·n) turns compute bound), the most
loaded replica is no longer the max-throughput one, so the loop stops while one replica
still holds most of the role's sequences (issue 41: 589 of 1,024 on one GenRM replica).

`least_loss` (this project's variant): the source is the replica whose shortest sequence
costs it the least throughput to lose; a source whose move would not raise aggregate
throughput is passed over for the next one, and the loop stops only when no replica has an
improving move of its shortest sequence. A sequence may move more than once here (to a new
replica, later on to a newer one), so the paper's bound of N^Seq moves becomes
`LEAST_LOSS_BOUND` · N^Seq; every move raises aggregate throughput, so it cannot cycle. At the
end no single move of a replica's shortest sequence to any replica with room raises
aggregate throughput: Dispatch's best replica has the largest ΔT_i, so if it does not
improve, no other destination does. It moves far more (a 1,024-GPU synthetic snapshot:
984 moves against 27 for one new rollout replica, +0.8 % aggregate) and each move is an
abort and a re-prefill where it lands, so it is not the default (docs/design.md: measured).

Both loops work on a `DispatchIndex`'s counts plus a `Shortest` view of each replica's
shortest sequence, so the live Scheduler (Replica objects) and the planner's replay
(plan.simulate, plain heaps) run the same code and reach bitwise the same floats.
"""
from __future__ import annotations

import heapq
from typing import Literal, Protocol, Union

from pivotrl_hpc.sched.index import DispatchIndex
from pivotrl_hpc.sched.model import ReplicaThroughput

MigrationName = Literal["paper", "least_loss"]
MIGRATIONS: tuple[str, ...] = ("paper", "least_loss")
DEFAULT_MIGRATION: MigrationName = "paper"   # it won on the paper groups: docs/design.md
# False: no migration loop (vanilla ablations); True: the default loop; or a loop's name
MigrationSpec = Union[bool, str]
LEAST_LOSS_BOUND = 8   # least_loss moves at most this many times N^Seq (module docstring)

Item = tuple[int, int]   # (tokens, seq_id): a replica's shortest sequence


def resolve(spec: MigrationSpec) -> str | None:
    """The loop a `migrate` argument names (None: no loop)."""
    if spec is False:
        return None
    if spec is True:
        return DEFAULT_MIGRATION
    if spec not in MIGRATIONS:
        raise ValueError(f"unknown migration {spec!r} (known: {', '.join(MIGRATIONS)})")
    return spec


class Shortest(Protocol):
    """Each replica's shortest sequence, by position in the index."""

    def peek(self, pos: int) -> Item | None: ...

    def take(self, pos: int) -> Item: ...

    def put(self, pos: int, item: Item) -> None: ...


Moved = list[tuple[Item, int, int]]   # (sequence, source position, destination position)


def _try(index: DispatchIndex, tp, thr: list[float], pos: int, length: int
         ) -> tuple[float, int | None, float]:
    """Take `length` tokens off `pos` in the index and ask Dispatch where they would go:
    (aggregate gain, destination, the source's throughput without them). The caller keeps
    the move or undoes it."""
    n, t = index.n, index.t
    index.update(pos, n[pos] - 1, t[pos] - length)
    dst = index.best(length)
    src_thr = tp(n[pos], t[pos])
    if dst is None or dst == pos:
        return 0.0, None, src_thr
    return tp(n[dst] + 1, t[dst] + length) - thr[dst] + src_thr - thr[pos], dst, src_thr


def _apply(index: DispatchIndex, tp, thr: list[float], shortest: Shortest, pos: int,
           dst: int, src_thr: float, moved: Moved) -> None:
    item = shortest.take(pos)
    shortest.put(dst, item)
    index.place(dst, item[0])
    thr[pos], thr[dst] = src_thr, tp(index.n[dst], index.t[dst])
    moved.append((item, pos, dst))


def paper_loop(model: ReplicaThroughput, index: DispatchIndex, shortest: Shortest,
               n_seq: int) -> tuple[Moved, int]:
    """Algorithm 4's loop: the moves made (at most `n_seq`, appendix C.2) and the heap
    operations counted."""
    limit = n_seq
    tp, n, t = model.throughput, index.n, index.t
    update, place, best = index.update, index.place, index.best
    peek, take, put = shortest.peek, shortest.take, shortest.put
    pop, push = heapq.heappop, heapq.heappush
    thr = [tp(a, b) for a, b in zip(n, t)]
    heap = [(-x, pos) for pos, x in enumerate(thr)]
    heapq.heapify(heap)
    moved: Moved = []
    ops = len(heap)
    # `_try` and `_apply` inlined (same operations, same order, so the same floats): this
    # loop runs once per simulated shift-up candidate, hundreds of moves each (issue 39).
    while heap and len(moved) < limit:
        neg, pos = pop(heap)
        ops += 1
        if -neg != thr[pos]:
            continue  # stale key: the replica's throughput changed since the push
        item = peek(pos)
        if item is None:
            break  # the max-throughput replica is empty: nothing left to move
        # Try the move first and keep it only if aggregate throughput rises, so the
        # procedure never ends below where it started (Algorithm 4, lines 11-15).
        length = item[0]
        update(pos, n[pos] - 1, t[pos] - length)
        dst = best(length)
        src_thr = tp(n[pos], t[pos])
        if dst is None or dst == pos or (tp(n[dst] + 1, t[dst] + length) - thr[dst]
                                         + src_thr - thr[pos]) <= 0.0:
            update(pos, n[pos] + 1, t[pos] + length)
            break
        put(dst, take(pos))
        place(dst, length)
        thr[pos] = src_thr
        thr[dst] = x = tp(n[dst], t[dst])
        moved.append((item, pos, dst))
        push(heap, (-src_thr, pos))
        push(heap, (-x, dst))
        ops += 2
    return moved, ops


def least_loss_loop(model: ReplicaThroughput, index: DispatchIndex, shortest: Shortest,
                    n_seq: int) -> tuple[Moved, int]:
    """The `least_loss` loop (module docstring): the moves made and the heap operations."""
    limit = LEAST_LOSS_BOUND * n_seq
    tp, n, t = model.throughput, index.n, index.t
    thr = [tp(a, b) for a, b in zip(n, t)]

    def key(pos: int) -> tuple[float, int] | None:
        item = shortest.peek(pos)
        if item is None:
            return None
        return thr[pos] - tp(n[pos] - 1, t[pos] - item[0]), pos

    heap = [k for k in map(key, range(len(n))) if k is not None]
    heapq.heapify(heap)
    loss = {pos: x for x, pos in heap}   # each replica's current key
    moved: Moved = []
    ops, tried = len(heap), []           # tried: sources without an improving move
    while heap and len(moved) < limit:
        x, pos = heapq.heappop(heap)
        ops += 1
        if loss.get(pos) != x:
            continue  # stale key
        length = shortest.peek(pos)[0]
        gain, dst, src_thr = _try(index, tp, thr, pos, length)
        if gain <= 0.0:
            index.update(pos, n[pos] + 1, t[pos] + length)
            tried.append((x, pos))
            continue
        _apply(index, tp, thr, shortest, pos, dst, src_thr, moved)
        # Only the two replicas changed: a source passed over (its shortest sequence had no
        # improving destination) gains one only if moving it to one of them now improves.
        # Checked in O(1) each; those that pass are tried again through Dispatch's index.
        kept = []
        for k in tried:
            x, s = k
            if s == pos or s == dst or loss.get(s) != x:
                continue   # its key is recomputed below, or stale
            length = shortest.peek(s)[0]
            if any(index.cap[d] - t[d] >= length and tp(n[d] + 1, t[d] + length) - thr[d] > x
                   for d in (pos, dst)):
                heapq.heappush(heap, k)
            else:
                kept.append(k)
        ops += len(tried)
        tried = kept
        for p in (pos, dst):
            k = key(p)
            loss.pop(p, None)
            if k is not None:
                loss[p] = k[0]
                heapq.heappush(heap, k)
    return moved, ops


LOOPS = {"paper": paper_loop, "least_loss": least_loss_loop}
