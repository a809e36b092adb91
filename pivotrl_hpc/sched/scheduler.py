"""The shift-aware scheduler of one role (paper §6, appendix C, Algorithms 2-4).

`Scheduler` holds a role's replicas, in a fixed order that breaks ties, and its shared
waiting queue. `dispatch` is Dispatch(Q, R), `abort` is Abort(r, d, Q), and
`shift_down_migration` / `shift_up_migration` are Algorithms 3 and 4. Every operation
returns what moved (unless `record_moves=False`, as in the planner's simulation, which only
reads the resulting throughput), so the live controller can tell the engines. Pure: no I/O,
no clocks.

Where the pseudocode leaves room: Dispatch keeps going past a sequence that fits nowhere
(it stays queued, in order, and shorter ones behind it may still be placed); Algorithm 4
evaluates a migration before doing it and stops without doing the one that would not raise
aggregate throughput, so the result is never below the start, and it stops after at most
N^Seq migrations (the bound of appendix C.2). Shift-up migration runs one of the loops of
sched.migration: Algorithm 4 as the paper states it ("paper", the default) or "least_loss".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, NamedTuple

from pivotrl_hpc.sched.index import DispatchIndex, OpCounter
from pivotrl_hpc.sched.migration import LOOPS, MigrationSpec, resolve
from pivotrl_hpc.sched.model import ReplicaThroughput
from pivotrl_hpc.sched.state import (KVOverflow, Replica, SchedulerError, Sequence,
                                     WaitingQueue)
from pivotrl_hpc.sched.tail import TailIsolation, Tails, fewest_tokens

log = logging.getLogger(__name__)


class AbortSpec(Enum):
    ALL = "all"
    SHORTEST = "shortest"


class Move(NamedTuple):
    """Sequence `seq_id` now runs on `dst`; `src` is where it ran before (None: the queue)."""

    seq_id: int
    src: str | None
    dst: str


@dataclass
class MigrationResult:
    moves: list[Move] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)   # seq ids returned to the queue
    queued: int = 0                                     # sequences left waiting afterwards
    iterations: int = 0                                 # improving migrations (Algorithm 4)
    # tokens of the sequences that left a replica for another (shift-down: every aborted
    # one): what the engines prefill again where they land
    moved_tokens: int = 0
    throughput_before: float = 0.0
    throughput_after: float = 0.0


class Scheduler:
    def __init__(self, model: ReplicaThroughput, replicas: Iterable[Replica] = (),
                 queue: WaitingQueue | None = None, counter: OpCounter | None = None,
                 record_moves: bool = True, tail: TailIsolation | None = None) -> None:
        self.model = model
        # None: Dispatch as the paper (sched/tail.py: the lever beyond it)
        self.tails = Tails(tail) if tail is not None else None
        # (replica, sequence) that tail isolation took off a replica: the caller aborts them
        # on the engine (as a KV preemption's victims) and clears the list
        self.evicted: list[tuple[str, int]] = []
        self.record_moves = record_moves  # the planner's simulation only needs throughput
        self.replicas: dict[str, Replica] = {}
        self.queue = queue if queue is not None else WaitingQueue()
        self.counter = counter
        for r in replicas:
            self.add_replica(r)

    # -- state ---------------------------------------------------------------------------
    def add_replica(self, replica: Replica) -> None:
        if replica.replica_id in self.replicas:
            raise SchedulerError(f"replica {replica.replica_id} already belongs to this role")
        self.replicas[replica.replica_id] = replica

    def remove_replica(self, replica_id: str) -> Replica:
        replica = self._replica(replica_id)
        if replica.seqs:
            raise SchedulerError(f"replica {replica_id} still runs {replica.n_seq} sequences; "
                                 "abort them first")
        return self.replicas.pop(replica_id)

    def submit(self, seq: Sequence) -> None:
        self.queue.push(seq)

    def _replica(self, replica_id: str) -> Replica:
        try:
            return self.replicas[replica_id]
        except KeyError:
            raise SchedulerError(f"unknown replica {replica_id}") from None

    def throughput(self, replica_id: str) -> float:
        r = self._replica(replica_id)
        return self.model.throughput(r.n_seq, r.n_tok)

    def aggregate_throughput(self) -> float:
        tp = self.model.throughput
        return sum((tp(r.n_seq, r.n_tok) for r in self.replicas.values()), 0.0)

    def n_sequences(self) -> int:
        """Running plus waiting: N_Role^Seq of the planner."""
        return sum(r.n_seq for r in self.replicas.values()) + len(self.queue)

    def copy(self) -> "Scheduler":
        twin = Scheduler(self.model, queue=self.queue.copy(), counter=self.counter,
                         record_moves=self.record_moves)
        twin.tails = None if self.tails is None else self.tails.copy()
        twin.replicas = {rid: r.copy() for rid, r in self.replicas.items()}
        return twin

    def grow(self, replica_id: str, seq_id: int, new_tokens: int) -> Sequence | None:
        """`grow_preempting`, for a caller that needs only this sequence's fate: the grown
        sequence if it still runs, None if it was preempted."""
        if seq_id in self.grow_preempting(replica_id, seq_id, new_tokens):
            return None
        return self.replicas[replica_id].seqs[seq_id]

    def grow_preempting(self, replica_id: str, seq_id: int, new_tokens: int) -> list[int]:
        """Record tokens a running sequence generated; returns the sequences preempted.

        Past the replica's KV capacity, as vLLM's scheduler does: the running sequence of
        lowest priority (the waiting queue's order, the newest first) leaves the replica and
        waits in the queue with every token it has (it resumes, never restarts), and so on
        until the growth fits; the growing sequence itself, new tokens included, when it is
        the lowest. Preempting whichever sequence happened to overflow instead throws back
        the oldest, longest ones (they are first in the engine's order): a batch's tail was
        preempted ~5 times on the 7B paper group, each time queued and prefilled again."""
        r = self._replica(replica_id)
        try:
            r.grow(seq_id, new_tokens)
            return []
        except KVOverflow as over:
            log.debug("%s", over)
        victims = sorted(r.seqs.values(), key=self.queue.priority, reverse=True)
        preempted: list[int] = []
        for victim in victims:
            r.remove(victim.seq_id)
            preempted.append(victim.seq_id)
            if victim.seq_id == seq_id:
                victim = Sequence(seq_id, victim.prompt_tokens,
                                  victim.generated_tokens + new_tokens)
            self.queue.push(victim)
            if victim.seq_id == seq_id or new_tokens <= r.remaining:
                break
        if seq_id not in preempted:
            r.grow(seq_id, new_tokens)
        return preempted

    # -- Algorithm 2 ---------------------------------------------------------------------
    def abort(self, replica_id: str, which: AbortSpec = AbortSpec.ALL) -> list[Sequence]:
        """Abort(r, d, Q): stop sequences on r and return them, state intact, to the queue."""
        r = self._replica(replica_id)
        if which is AbortSpec.ALL:
            victims = [r.remove(sid) for sid in list(r.seqs)]
        else:
            shortest = r.shortest()
            victims = [] if shortest is None else [r.remove(shortest.seq_id)]
        self.queue.extend(victims)
        return victims

    def dispatch(self, replica_ids: Iterable[str] | None = None) -> list[Move]:
        """Dispatch(Q, R): place queued sequences by largest ΔT_i; misfits stay queued."""
        ids = list(self.replicas) if replica_ids is None else list(replica_ids)
        reps = [self._replica(rid) for rid in ids]
        if self.tails is not None and self.queue:
            return self._dispatch_tails(reps)
        return self._dispatch(DispatchIndex(self.model, reps, self.counter))

    def _dispatch_tails(self, reps: list[Replica]) -> list[Move]:
        """Dispatch with tail isolation (sched/tail.py): a tail sequence to a replica of its
        own (its sequences evicted: `evicted`) or, past the lanes, to the lane holding the
        fewest tokens; the others by ΔT_i off the lanes, onto them only when nowhere else
        has room. The evicted wait in the queue for the next Dispatch (their engine first
        hears of the Abort)."""
        tails = self.tails
        entries = self.queue.take_entries()
        late = [e for e in entries if tails.arrive(e[1])]
        lanes = tails.lanes(list(self.replicas.values()))
        if not lanes and len(self.replicas) <= 2:   # no room for a lane: the paper's
            self.queue.restore_entries(entries)
            return self._dispatch(DispatchIndex(self.model, reps, self.counter))
        moves: list[Move] = []
        waiting, evicted = [], []
        for entry in late:
            pos = self._lane_for(reps, lanes, entry[2], evicted)
            if pos is None:
                waiting.append(entry)
                continue
            reps[pos].add(entry[2])
            lanes.add(reps[pos].replica_id)
            if self.counter is not None:
                self.counter.dispatched += 1
            if self.record_moves:
                moves.append(Move(entry[1], None, reps[pos].replica_id))
        self.queue.restore_entries(sorted(waiting + [e for e in entries
                                                     if e[1] not in tails.tails]))
        free = [r for r in reps if r.replica_id not in lanes]
        if free:
            moves += self._dispatch(DispatchIndex(self.model, free, self.counter))
        if self.queue and len(free) < len(reps):
            moves += self._dispatch(DispatchIndex(self.model, reps, self.counter))
        self.queue.extend(seq for _, seq in evicted)
        self.evicted += [(rid, seq.seq_id) for rid, seq in evicted]
        return moves

    def _lane_for(self, reps: list[Replica], lanes: set[str], seq: Sequence,
                  evicted: list[tuple[str, Sequence]]) -> int | None:
        """Where a tail sequence goes: a new lane (the fewest-token replica, emptied) while
        lanes are left and two replicas stay for the rest, else the fewest-token lane."""
        spec = self.tails.spec
        if len(lanes) < spec.lanes and len(self.replicas) - len(lanes) > 2:
            others = [r for r in reps if r.replica_id not in lanes]
            pos = min(range(len(others)), default=None,
                      key=lambda i: (others[i].n_tok, others[i].n_seq, i))
            if pos is not None and others[pos].capacity >= seq.length:
                r = others[pos]
                evicted += [(r.replica_id, r.remove(sid)) for sid in list(r.seqs)]
                return reps.index(r)
        ours = [i for i, r in enumerate(reps) if r.replica_id in lanes]
        pos = fewest_tokens([reps[i] for i in ours], seq.length)
        return ours[pos] if pos is not None else fewest_tokens(reps, seq.length)

    def _dispatch(self, index: DispatchIndex) -> list[Move]:
        entries = self.queue.take_entries()
        if not entries:
            return []
        moves: list[Move] = []
        waiting: list = []
        reps, best, moved = index.replicas, index.best, index.moved
        record = self.record_moves
        placed = 0
        room = index.max_remaining()  # only ever over-estimates while Dispatch only adds
        for entry in entries:
            seq = entry[2]
            length = seq.length
            pos = None if length > room else best(length)
            if pos is None:
                if length <= room:
                    room = index.max_remaining()
                waiting.append(entry)
                continue
            r = reps[pos]
            r.add(seq)
            moved(pos)
            placed += 1
            if record:
                moves.append(Move(seq.seq_id, None, r.replica_id))
        self.queue.restore_entries(waiting)
        if self.counter is not None:
            self.counter.dispatched += placed
        return moves

    # -- Algorithm 3 ---------------------------------------------------------------------
    def shift_down_migration(self, down_ids: Iterable[str]) -> MigrationResult:
        """Abort everything on the shift-down replicas, remove them, Dispatch to the rest."""
        down = list(down_ids)
        result = MigrationResult(throughput_before=self.aggregate_throughput())
        src: dict[int, str] = {}
        for rid in down:
            for seq in self.abort(rid, AbortSpec.ALL):
                src[seq.seq_id] = rid
                result.aborted.append(seq.seq_id)
                result.moved_tokens += seq.length
            self.remove_replica(rid)
        result.moves = self.dispatch() if self.replicas else []
        result.moves = [Move(m.seq_id, src.get(m.seq_id), m.dst) for m in result.moves]
        result.queued = len(self.queue)
        result.throughput_after = self.aggregate_throughput()
        return result

    # -- Algorithm 4 ---------------------------------------------------------------------
    def shift_up_migration(self, new_replicas: Iterable[Replica],
                           migrate: MigrationSpec = True) -> MigrationResult:
        """Dispatch the queue onto R↑, then move shortest sequences while that raises
        aggregate throughput, by the loop `migrate` names (sched.migration: "paper" is
        Algorithm 4, True the default loop, False vanilla: no loop)."""
        loop = resolve(migrate)
        up = list(new_replicas)
        result = MigrationResult(throughput_before=self.aggregate_throughput())
        for r in up:
            self.add_replica(r)
        result.moves = self.dispatch([r.replica_id for r in up]) if up else []
        if loop and not self.queue:  # migrate only if every waiting sequence found room
            self._migrate_loop(result, loop)
        result.queued = len(self.queue)
        result.throughput_after = self.aggregate_throughput()
        return result

    def _migrate_loop(self, result: MigrationResult, loop: str) -> None:
        reps = list(self.replicas.values())
        if self.tails is not None:   # the lanes stay as they are (sched/tail.py)
            lanes = self.tails.lanes(reps)
            reps = [r for r in reps if r.replica_id not in lanes]
        index = DispatchIndex(self.model, reps, self.counter)
        n_seq = sum(r.n_seq for r in reps)   # the loops' bound is in N^Seq (appendix C.2)
        moved, ops = LOOPS[loop](self.model, index, _ReplicaShortest(reps), n_seq)
        if self.record_moves:
            result.moves += [Move(sid, reps[src].replica_id, reps[dst].replica_id)
                             for (_, sid), src, dst in moved]
        result.iterations = len(moved)
        result.moved_tokens += sum(item[0] for item, _, _ in moved)
        if self.counter is not None:
            self.counter.heap_ops += ops
            self.counter.migrations += result.iterations
        log.debug("shift-up migration (%s): %d moves, aggregate %.1f", loop, len(moved),
                  self.aggregate_throughput())


class _ReplicaShortest:
    """The migration loops' view (sched.migration.Shortest) of Replica objects."""

    def __init__(self, reps: list[Replica]) -> None:
        self.reps = reps
        self.held: dict[int, Sequence] = {}

    def peek(self, pos: int) -> tuple[int, int] | None:
        seq = self.reps[pos].shortest()
        return None if seq is None else (seq.length, seq.seq_id)

    def take(self, pos: int) -> tuple[int, int]:
        seq = self.reps[pos].shortest()
        self.held[seq.seq_id] = self.reps[pos].remove(seq.seq_id)
        return seq.length, seq.seq_id

    def put(self, pos: int, item: tuple[int, int]) -> None:
        self.reps[pos].add(self.held.pop(item[1]))
