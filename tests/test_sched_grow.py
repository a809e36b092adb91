"""A running sequence that grows past its replica's KV capacity (the live monitor's update).

`Replica.grow` is atomic: past the capacity it raises `KVOverflow` and the replica is exactly
as before. The Scheduler then preempts as vLLM does: the replica's lowest-priority running
sequences (the newest first) go to the waiting queue with every token they have until the
growth fits, the growing one itself if it is the lowest, and a later Dispatch resumes them.
Nothing is lost or duplicated.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl_hpc.sched import (AbortSpec, KVOverflow, Replica, Scheduler, SchedulerError,
                               Sequence, ThroughputModel, WaitingQueue)

M = ThroughputModel(A=5e-8, B=0.012, C=2e-4, D=0.008)


def _state(r: Replica) -> tuple:
    return (dict(r.seqs), r.n_tok, r.remaining, r.shortest())


def test_replica_grow_overflow_changes_nothing():
    r = Replica("r0", 1_000, [Sequence(1, 300, 50), Sequence(2, 400, 100)])
    assert r.shortest().seq_id == 1          # builds the lazy heap, so it is checked too
    before = _state(r)
    with pytest.raises(KVOverflow) as info:
        r.grow(1, 151)                         # remaining is 150
    assert _state(r) == before and r.n_tok == 850
    assert info.value.seq == Sequence(1, 300, 50) and info.value.new_tokens == 151
    assert "remaining KV capacity 150" in str(info.value)
    grown = r.grow(1, 150)                     # exactly full still fits
    assert (grown.generated_tokens, r.n_tok, r.remaining) == (200, 1_000, 0)


def test_replica_grow_rejects_unknown_and_negative_without_change():
    r = Replica("r0", 1_000, [Sequence(1, 300, 50)])
    before = _state(r)
    with pytest.raises(SchedulerError, match="no running sequence 9"):
        r.grow(9, 1)
    with pytest.raises(SchedulerError, match="cannot shrink"):
        r.grow(1, -1)
    assert _state(r) == before


def _sched() -> Scheduler:
    return Scheduler(M, [Replica("a", 1_000, [Sequence(1, 300, 50), Sequence(2, 400, 100)]),
                         Replica("b", 2_000)])


def test_scheduler_grow_in_capacity_keeps_running():
    s = _sched()
    grown = s.grow("a", 2, 150)
    assert grown == Sequence(2, 400, 250)
    assert s.replicas["a"].seqs[2] == grown and s.replicas["a"].n_tok == 1_000 and not s.queue


def test_scheduler_grow_past_capacity_preempts_the_newest_not_the_grower():
    """vLLM preempts its lowest-priority running request (the newest), not whichever one
    overflowed: the older sequence grows, the newer one waits with its tokens."""
    s = _sched()
    assert s.grow_preempting("a", 1, 400) == [2]
    a = s.replicas["a"]
    assert a.seqs == {1: Sequence(1, 300, 450)} and a.n_tok == 750
    assert list(s.queue) == [Sequence(2, 400, 100)]   # as it stood: it generated nothing new
    assert s.n_sequences() == 2
    # a later Dispatch resumes it where it fits: b, not a (250 left)
    assert [(m.seq_id, m.dst) for m in s.dispatch()] == [(2, "b")]
    assert not s.queue


def test_scheduler_grow_of_the_newest_preempts_itself_with_all_tokens():
    s = _sched()
    assert s.grow("a", 2, 400) is None
    a = s.replicas["a"]
    assert set(a.seqs) == {1} and a.n_tok == 350 == sum(q.length for q in a.seqs.values())
    assert a.shortest().seq_id == 1
    assert list(s.queue) == [Sequence(2, 400, 500)]   # prompt + 100 + the 400 new tokens
    moves = s.dispatch()
    assert [(m.seq_id, m.dst) for m in moves] == [(2, "b")]
    assert s.replicas["b"].seqs[2] == Sequence(2, 400, 500) and not s.queue


def test_scheduler_grow_preempts_lowest_priority_first_until_it_fits():
    """Victims in the waiting queue's order, from its end (a custom key included), as many
    as the growth needs and no more."""
    seqs = [Sequence(i, 100, 0) for i in (1, 2, 3, 4)]
    s = Scheduler(M, [Replica("a", 400, seqs)])
    assert s.grow_preempting("a", 1, 150) == [4, 3]          # 100 free each
    assert set(s.replicas["a"].seqs) == {1, 2} and s.replicas["a"].n_tok == 350
    assert [q.seq_id for q in s.queue] == [3, 4]
    by_id_desc = Scheduler(M, [Replica("a", 400, seqs)],
                           queue=WaitingQueue(key=lambda q: -q.seq_id))
    assert by_id_desc.grow_preempting("a", 4, 150) == [1, 2]  # 1 ranks last under this key
    assert set(by_id_desc.replicas["a"].seqs) == {3, 4}


def test_scheduler_grow_preempted_waits_until_room():
    s = Scheduler(M, [Replica("a", 1_000, [Sequence(1, 300, 50), Sequence(2, 400, 100)])])
    assert s.grow("a", 2, 600) is None              # 1 100 tokens: fits nowhere now
    assert s.dispatch() == [] and list(s.queue) == [Sequence(2, 400, 700)]
    s.abort("a")                                    # sequence 1 back to the queue too
    moves = s.dispatch()
    assert sorted(m.seq_id for m in moves) == [1] and list(s.queue) == [Sequence(2, 400, 700)]
    s.add_replica(Replica("big", 4_000))
    assert [(m.seq_id, m.dst) for m in s.dispatch()] == [(2, "big")]
    assert s.replicas["big"].n_tok == 1_100 and not s.queue


# -- property: random grow / dispatch / abort never lose, duplicate or shrink a sequence ---
ops = st.lists(st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 2), st.integers(0, 50), st.integers(0, 900)),
    st.tuples(st.just("dispatch")),
    st.tuples(st.just("abort"), st.integers(0, 2), st.sampled_from(list(AbortSpec))),
), max_size=60)


def _where(s: Scheduler) -> tuple[Counter, dict[int, int]]:
    """Multiset of sequence ids (running + queued) and each sequence's token count."""
    ids: Counter = Counter()
    length: dict[int, int] = {}
    for r in s.replicas.values():
        assert r.n_tok == sum(q.length for q in r.seqs.values()) <= r.capacity
        for sid, q in r.seqs.items():
            ids[sid] += 1
            length[sid] = q.length
    for q in s.queue:
        ids[q.seq_id] += 1
        length[q.seq_id] = q.length
    return ids, length


def _apply(s: Scheduler, op: tuple) -> None:
    rid = f"r{op[1]}" if len(op) > 1 else None
    if op[0] == "grow":
        seqs = sorted(s.replicas[rid].seqs)
        if seqs:
            s.grow(rid, seqs[op[2] % len(seqs)], op[3])
    elif op[0] == "dispatch":
        s.dispatch()
    else:
        s.abort(rid, op[2])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(10, 600), min_size=1, max_size=20), ops)
def test_grow_dispatch_abort_conserve_sequences_and_tokens(prompts, steps):
    s = Scheduler(M, [Replica(f"r{i}", cap) for i, cap in enumerate((1_000, 1_500, 2_500))])
    s.queue.extend(Sequence(i, p) for i, p in enumerate(prompts))
    s.dispatch()
    ids, length = _where(s)
    assert ids == Counter(range(len(prompts)))
    for op in steps:
        _apply(s, op)
        now_ids, now_length = _where(s)
        assert now_ids == ids, op
        assert all(now_length[i] >= length[i] for i in ids), op
        length = now_length
