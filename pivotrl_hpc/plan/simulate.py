"""Step 4's migration simulation for one role, fast but exact (§7.3).

`RoleReplay` (plan.evaluate) states the simulation plainly: copy the role's `Scheduler`,
run Algorithm 3 or 4 on the copy, read the aggregate throughput. With K candidates that
copies, aborts and re-queues the whole role K times. `FastRole` reaches bitwise the same
throughput by the same decisions (`DispatchIndex.best`, same order, same floats) on plain
counts, doing per candidate only what the candidate changes:

* Dispatch only ever adds, so what decides it is each replica's (sequences, tokens,
  capacity); the sequences themselves are not needed. Shift-down builds an index over the
  surviving replicas' counts and merges the pre-sorted sequences of the shift-down
  replicas into the queue, instead of copying replicas, aborting and re-queueing.
* Shift-up's migration loop needs each replica's shortest sequence, so it keeps a
  shortest-first heap per replica, copied from one built up front only for the replicas a
  migration touches (copy on write).
* Aggregate throughput sums the same per-replica floats in the same order as
  `Scheduler.aggregate_throughput`, so even the rounding agrees.
"""
from __future__ import annotations

import heapq
from typing import Iterable

from pivotrl_hpc.plan.snapshot import ReplicaState, RolePool
from pivotrl_hpc.sched.index import DispatchIndex
from pivotrl_hpc.sched.model import ReplicaThroughput

Entry = tuple[int, int]  # (seq_id, tokens): the queue's order is ascending seq_id


class FastRole:
    """One generation role's state at the snapshot, ready to replay many shifts."""

    def __init__(self, model: ReplicaThroughput, replicas: list[ReplicaState],
                 pool: RolePool) -> None:
        self.model = model
        self.new_capacity = pool.kv_capacity
        self.pos = {r.replica_id: i for i, r in enumerate(replicas)}
        self.n = [len(r.sequences) for r in replicas]
        self.t = [r.n_tok for r in replicas]
        self.cap = [r.kv_capacity for r in replicas]
        self.entries = [[(s.seq_id, s.length) for s in r.sequences] for r in replicas]
        self.queue = sorted((s.seq_id, s.length) for s in pool.queue)
        # Shortest-first (tokens, seq_id) per replica: a sorted list is a heap.
        self.shortest = [sorted((length, sid) for sid, length in e) for e in self.entries]
        self.now = sum(map(model.throughput, self.n, self.t), 0.0)
        self.constants: dict = {}  # DispatchIndex's per-(n, capacity) cache, model-wide

    # -- Algorithm 3 -----------------------------------------------------------------------
    def shift_down(self, down: Iterable[str]) -> float:
        """Aggregate throughput after shifting down `down` (ids of this role)."""
        gone = {self.pos[rid] for rid in down}
        keep = [i for i in range(len(self.n)) if i not in gone]
        if not keep:
            return 0.0
        queue = sorted(self.queue + [e for i in gone for e in self.entries[i]])
        index = DispatchIndex.from_counts(self.model, [self.n[i] for i in keep],
                                          [self.t[i] for i in keep],
                                          [self.cap[i] for i in keep],
                                          constants=self.constants)
        _dispatch(index, queue)
        tp = self.model.throughput
        return sum(map(tp, index.n, index.t), 0.0)

    # -- Algorithm 4 -----------------------------------------------------------------------
    def shift_up(self, count: int, migrate: bool = True) -> float:
        """Aggregate throughput after shifting up `count` empty replicas."""
        cap = self.new_capacity
        up = DispatchIndex.from_counts(self.model, [0] * count, [0] * count, [cap] * count,
                                       constants=self.constants)
        placed: list[list[tuple[int, int]]] = [[] for _ in range(count)]
        waiting = _dispatch(up, self.queue, placed)
        n, t = self.n + up.n, self.t + up.t
        if migrate and not waiting:
            shortest = self.shortest + [sorted(p) for p in placed]
            return _MigrationLoop(self.model, n, t, self.cap + [cap] * count, shortest,
                                  self.constants).run()
        tp = self.model.throughput
        return sum(map(tp, n, t), 0.0)


def _dispatch(index: DispatchIndex, queue: list[Entry],
              placed: list[list[tuple[int, int]]] | None = None) -> list[Entry]:
    """Scheduler._dispatch on counts: each entry in queue order goes to `best(length)`;
    returns what stays queued. `placed` collects (tokens, seq_id) per replica when given."""
    best, update, n, t = index.best, index.update, index.n, index.t
    waiting: list[Entry] = []
    room = index.max_remaining()  # only ever over-estimates while Dispatch only adds
    for entry in queue:
        length = entry[1]
        pos = None if length > room else best(length)
        if pos is None:
            if length <= room:
                room = index.max_remaining()
            waiting.append(entry)
            continue
        update(pos, n[pos] + 1, t[pos] + length)
        if placed is not None:
            placed[pos].append((length, entry[0]))
    return waiting


class _MigrationLoop:
    """Scheduler._migrate_loop on counts. Sequences leave a replica only as its shortest, so
    a plain shortest-first heap per replica stays exact; each is copied from the shared one
    built up front only when a migration first touches that replica (copy on write)."""

    def __init__(self, model: ReplicaThroughput, n: list[int], t: list[int], cap: list[int],
                 shortest: list[list[tuple[int, int]]], constants: dict) -> None:
        self.model = model
        self.index = DispatchIndex.from_counts(model, n, t, cap, constants=constants)
        self.base = shortest                    # shared: never modified
        self.heaps: dict[int, list] = {}        # pos -> this run's own (tokens, seq_id) heap

    def _heap(self, pos: int) -> list:
        heap = self.heaps.get(pos)
        if heap is None:
            heap = self.heaps[pos] = self.base[pos].copy()
        return heap

    def run(self) -> float:
        """Move shortest sequences off the max-throughput replica while that raises
        aggregate throughput; at most N^Seq moves. Returns aggregate throughput."""
        index, tp = self.index, self.model.throughput
        n, t = index.n, index.t
        thr = [tp(a, b) for a, b in zip(n, t)]
        heap = [(-x, pos) for pos, x in enumerate(thr)]
        heapq.heapify(heap)
        limit, iterations = sum(n), 0
        while heap and iterations < limit:
            neg, pos = heapq.heappop(heap)
            if -neg != thr[pos]:
                continue  # stale key
            src = self._heap(pos)
            if not src:
                break  # the max-throughput replica is empty
            item = heapq.heappop(src)  # fewest tokens, then lowest id: Replica.shortest
            length = item[0]
            index.update(pos, n[pos] - 1, t[pos] - length)
            dst = index.best(length)
            src_thr = tp(n[pos], t[pos])
            gain = 0.0
            if dst is not None and dst != pos:
                gain = tp(n[dst] + 1, t[dst] + length) - thr[dst] + src_thr - thr[pos]
            if gain <= 0.0:  # undo and stop: the move would not raise throughput
                index.update(pos, n[pos] + 1, t[pos] + length)
                break
            index.place(dst, length)
            heapq.heappush(self._heap(dst), item)
            thr[pos], thr[dst] = src_thr, tp(n[dst], t[dst])
            heapq.heappush(heap, (-thr[pos], pos))
            heapq.heappush(heap, (-thr[dst], dst))
            iterations += 1
        return sum(map(tp, n, t), 0.0)
