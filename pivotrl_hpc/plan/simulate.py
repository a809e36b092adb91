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
* Shift-up's migration loop (sched.migration, the same code as the Scheduler's) needs each
  replica's shortest sequence, so it keeps a shortest-first heap per replica, copied from
  one built up front only for the replicas a migration touches (copy on write).
* Aggregate throughput sums the same per-replica floats in the same order as
  `Scheduler.aggregate_throughput`, so even the rounding agrees.
"""
from __future__ import annotations

import heapq
from typing import Iterable

from pivotrl_hpc.plan.snapshot import ReplicaState, RolePool
from pivotrl_hpc.sched.index import DispatchIndex
from pivotrl_hpc.sched.migration import LOOPS, MigrationSpec, resolve
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
        self.entries = [[(s.seq_id, s.prompt_tokens + s.generated_tokens) for s in r.sequences]
                        for r in replicas]
        self.queue = sorted([(s.seq_id, s.prompt_tokens + s.generated_tokens)
                             for s in pool.queue])
        # Shortest-first (tokens, seq_id) per replica: a sorted list is a heap.
        self.shortest = [sorted([(length, sid) for sid, length in e]) for e in self.entries]
        self.now = sum(map(model.throughput, self.n, self.t), 0.0)
        self.constants: dict = {}  # DispatchIndex's per-(n, capacity) cache, model-wide

    # -- Algorithm 3 -----------------------------------------------------------------------
    def shift_down(self, down: Iterable[str]) -> tuple[float, int]:
        """Aggregate throughput after shifting down `down` (ids of this role), and the
        tokens of the sequences aborted there (each is prefilled again where it lands)."""
        gone = {self.pos[rid] for rid in down}
        keep = [i for i in range(len(self.n)) if i not in gone]
        moved = sum(self.t[i] for i in gone)
        if not keep:
            return 0.0, moved
        queue = sorted(self.queue + [e for i in gone for e in self.entries[i]])
        index = DispatchIndex.from_counts(self.model, [self.n[i] for i in keep],
                                          [self.t[i] for i in keep],
                                          [self.cap[i] for i in keep],
                                          constants=self.constants)
        _dispatch(index, queue)
        tp = self.model.throughput
        return sum(map(tp, index.n, index.t), 0.0), moved

    # -- Algorithm 4 -----------------------------------------------------------------------
    def shift_up(self, count: int, migrate: MigrationSpec = True) -> tuple[float, int]:
        """Aggregate throughput after shifting up `count` empty replicas, and the tokens of
        the sequences the migration loop moved."""
        cap = self.new_capacity
        up = DispatchIndex.from_counts(self.model, [0] * count, [0] * count, [cap] * count,
                                       constants=self.constants)
        placed: list[list[tuple[int, int]]] = [[] for _ in range(count)]
        waiting = _dispatch(up, self.queue, placed)
        n, t = self.n + up.n, self.t + up.t
        loop, moved = resolve(migrate), 0
        if loop and not waiting:   # Scheduler._migrate_loop on counts
            index = DispatchIndex.from_counts(self.model, n, t, self.cap + [cap] * count,
                                              constants=self.constants)
            done, _ = LOOPS[loop](self.model, index,
                                  _HeapShortest(self.shortest + [sorted(p) for p in placed]),
                                  sum(n))
            moved = sum(item[0] for item, _, _ in done)
        tp = self.model.throughput
        return sum(map(tp, n, t), 0.0), moved


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


class _HeapShortest:
    """sched.migration's view of each replica's shortest sequence on plain heaps. Sequences
    leave a replica only as its shortest, so a shortest-first heap per replica stays exact;
    each is copied from the shared one built up front only when a migration first touches
    that replica (copy on write)."""

    def __init__(self, shortest: list[list[tuple[int, int]]]) -> None:
        self.base = shortest                    # shared: never modified
        self.heaps: dict[int, list] = {}        # pos -> this run's own (tokens, seq_id) heap

    def _heap(self, pos: int) -> list:
        heap = self.heaps.get(pos)
        if heap is None:
            heap = self.heaps[pos] = self.base[pos].copy()
        return heap

    def peek(self, pos: int) -> tuple[int, int] | None:
        heap = self.heaps.get(pos, self.base[pos])
        return heap[0] if heap else None   # fewest tokens, then lowest id: Replica.shortest

    def take(self, pos: int) -> tuple[int, int]:
        return heapq.heappop(self._heap(pos))

    def put(self, pos: int, item: tuple[int, int]) -> None:
        heapq.heappush(self._heap(pos), item)
