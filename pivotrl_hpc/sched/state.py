"""Sequences, replicas and the shared waiting queue of a shift-aware scheduler (§6).

A `Sequence` carries the tokens produced so far, so an aborted sequence resumes instead of
restarting (appendix C.1). A `Replica` tracks its running sequences, their token total and
its KV-cache capacity in tokens, and finds its shortest sequence through a lazy heap. The
`WaitingQueue` is a priority queue, ascending sequence id by default (as veRL).

KV overflow, for the controller: the live monitor reports generated tokens through
`Scheduler.grow_preempting(replica, seq, new_tokens)`. Past the capacity `Replica.grow`
raises `KVOverflow` having changed nothing, and the Scheduler preempts as vLLM does: the
replica's lowest-priority running sequences (the queue's order: the newest first) go back
to the waiting queue with every token until the growth fits, the growing sequence itself
if it is the lowest. The controller treats them as aborted on that engine; a later Dispatch
resumes them where they fit. Nothing is lost.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator


class SchedulerError(ValueError):
    """An operation that would lose, duplicate or over-fill a sequence."""


class KVOverflow(SchedulerError):
    """Growing a running sequence would exceed its replica's KV capacity. Raised before
    anything changes: the replica still holds the sequence with its old token count."""

    def __init__(self, replica_id: str, seq: "Sequence", new_tokens: int, remaining: int):
        super().__init__(f"replica {replica_id}: sequence {seq.seq_id} cannot grow by "
                         f"{new_tokens} tokens (remaining KV capacity {remaining})")
        self.replica_id, self.seq, self.new_tokens = replica_id, seq, new_tokens


@dataclass(frozen=True, slots=True)
class Sequence:
    seq_id: int
    prompt_tokens: int
    generated_tokens: int = 0
    length: int = field(init=False, compare=False)  # tokens in the KV cache

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.generated_tokens < 0:
            raise SchedulerError(f"sequence {self.seq_id}: negative token counts")
        object.__setattr__(self, "length", self.prompt_tokens + self.generated_tokens)


class Replica:
    """One rollout or reward replica: running sequences and KV capacity in tokens."""

    __slots__ = ("replica_id", "capacity", "seqs", "n_tok", "_short")

    def __init__(self, replica_id: str, capacity: int, seqs: Iterable[Sequence] = ()) -> None:
        if capacity < 0:
            raise SchedulerError(f"replica {replica_id}: negative KV capacity {capacity}")
        self.replica_id = replica_id
        self.capacity = capacity
        self.seqs: dict[int, Sequence] = {}
        self.n_tok = 0
        self._short: list[tuple[int, int]] | None = None  # built on first shortest()
        for s in seqs:
            self.add(s)

    @property
    def n_seq(self) -> int:
        return len(self.seqs)

    @property
    def remaining(self) -> int:
        return self.capacity - self.n_tok

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise SchedulerError(f"replica {self.replica_id}: sequence {seq.seq_id} already "
                                 "runs here")
        if seq.length > self.capacity - self.n_tok:
            raise SchedulerError(f"replica {self.replica_id}: sequence {seq.seq_id} "
                                 f"({seq.length} tokens) exceeds remaining KV capacity "
                                 f"{self.capacity - self.n_tok}")
        self.seqs[seq.seq_id] = seq
        self.n_tok += seq.length
        if self._short is not None:
            heapq.heappush(self._short, (seq.length, seq.seq_id))

    def remove(self, seq_id: int) -> Sequence:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise SchedulerError(f"replica {self.replica_id}: no running sequence {seq_id}")
        self.n_tok -= seq.length
        if self._short is not None and len(self._short) > 2 * len(self.seqs) + 16:
            self._short = None  # mostly stale: rebuild on the next shortest()
        return seq

    def shortest(self) -> Sequence | None:
        """The running sequence with the fewest tokens (ties: lowest id)."""
        if self._short is None:
            self._short = [(s.length, s.seq_id) for s in self.seqs.values()]
            heapq.heapify(self._short)
        heap = self._short
        while heap:
            length, sid = heap[0]
            seq = self.seqs.get(sid)
            if seq is not None and seq.length == length:
                return seq
            heapq.heappop(heap)
        return None

    def grow(self, seq_id: int, new_tokens: int) -> Sequence:
        """Record `new_tokens` generated for a running sequence (the live monitor's update).

        Atomic: past the KV capacity it raises `KVOverflow` and changes nothing, so the
        caller decides (`Scheduler.grow` preempts the sequence to the waiting queue with its
        tokens, as vLLM does when its KV cache fills up)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise SchedulerError(f"replica {self.replica_id}: no running sequence {seq_id}")
        if new_tokens < 0:
            raise SchedulerError(f"replica {self.replica_id}: sequence {seq_id} cannot shrink")
        if new_tokens > self.remaining:
            raise KVOverflow(self.replica_id, seq, new_tokens, self.remaining)
        self.remove(seq_id)
        grown = Sequence(seq.seq_id, seq.prompt_tokens, seq.generated_tokens + new_tokens)
        self.add(grown)
        return grown

    def copy(self) -> "Replica":
        twin = Replica.__new__(Replica)
        twin.replica_id, twin.capacity, twin.n_tok = self.replica_id, self.capacity, self.n_tok
        twin.seqs = self.seqs.copy()
        twin._short = None if self._short is None else self._short.copy()
        return twin

    def __repr__(self) -> str:
        return (f"Replica({self.replica_id!r}, seqs={self.n_seq}, tokens={self.n_tok}, "
                f"capacity={self.capacity})")


@dataclass
class WaitingQueue:
    """Shared waiting queue: a heap of (priority, seq_id, sequence); unique ids."""

    key: Callable[[Sequence], float] | None = None
    _heap: list[tuple[float, int, Sequence]] = field(default_factory=list)
    _ids: set[int] = field(default_factory=set)

    def priority(self, seq: Sequence) -> tuple[float, int]:
        """Its place in the queue: smaller comes first (KV preemption takes the largest)."""
        return (self.key(seq) if self.key else seq.seq_id, seq.seq_id)

    def _entry(self, seq: Sequence) -> tuple[float, int, Sequence]:
        return (*self.priority(seq), seq)

    def push(self, seq: Sequence) -> None:
        if seq.seq_id in self._ids:
            raise SchedulerError(f"sequence {seq.seq_id} is already in the waiting queue")
        self._ids.add(seq.seq_id)
        heapq.heappush(self._heap, self._entry(seq))

    def extend(self, seqs: Iterable[Sequence]) -> None:
        """Push many at once: Abort(r, All) returns a whole replica."""
        entries = [self._entry(seq) for seq in seqs]
        new_ids = {e[1] for e in entries}
        if len(new_ids) != len(entries) or not new_ids.isdisjoint(self._ids):
            seen = set(self._ids)
            for e in entries:
                if e[1] in seen:
                    raise SchedulerError(f"sequence {e[1]} is already in the waiting queue")
                seen.add(e[1])
        self._ids |= new_ids
        if len(entries) * 8 < len(self._heap):  # small batch: pushes beat a full heapify
            for e in entries:
                heapq.heappush(self._heap, e)
        else:
            self._heap.extend(entries)
            heapq.heapify(self._heap)

    def pop(self) -> Sequence:
        _, sid, seq = heapq.heappop(self._heap)
        self._ids.discard(sid)
        return seq

    def peek(self) -> Sequence | None:
        return self._heap[0][2] if self._heap else None

    def take_entries(self) -> list[tuple[float, int, Sequence]]:
        """Remove everything, in priority order (Dispatch's working list)."""
        entries = sorted(self._heap)
        self._heap, self._ids = [], set()
        return entries

    def restore_entries(self, entries: list[tuple[float, int, Sequence]]) -> None:
        """Put back entries taken by take_entries (already in order: a sorted list is a heap)."""
        for entry in entries:
            if entry[1] in self._ids:
                raise SchedulerError(f"sequence {entry[1]} is already in the waiting queue")
            self._ids.add(entry[1])
        if self._heap:
            self._heap.extend(entries)
            heapq.heapify(self._heap)
        else:
            self._heap = entries

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._ids

    def __iter__(self) -> Iterator[Sequence]:
        """Sequences in priority order (does not consume)."""
        return (entry[2] for entry in sorted(self._heap))

    def copy(self) -> "WaitingQueue":
        return WaitingQueue(self.key, self._heap.copy(), self._ids.copy())
