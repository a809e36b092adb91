"""Sequences through the two shift-aware schedulers: records, Dispatch, and step replies.

The controller's record of a sequence (prompt, tokens so far, behaviour logprobs, budget,
owner replica) is the source of truth for Abort and migration (appendix C.1): a sequence
moved elsewhere resumes from the record, and progress from an earlier placement is ignored
— even on the same replica, since a sequence preempted and re-dispatched there gets a new
`epoch`, and a Step only counts for the placements it was sent to. So every sequence
finishes exactly once and its final tokens equal the record (checked against the engine's
own account on every finish).

A record whose tokens reach its budget is finished from the record at once: were the
engine's finish to come a Step later, a migration in between would move a complete
sequence that no engine finishes (vLLM refuses a zero budget). And a replica that returns
no token for a placed sequence over `STALL_STEPS` Steps has lost it: the run stops, naming
both, instead of waiting forever (one it holds without a slot yet, past vLLM's
max_num_seqs, comes back as progress without tokens: held, not lost) (a live colocated job
hung so, before the executor netted Algorithm 4's chained moves: `actions.net_moves`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pivotrl_hpc.protocol.engine import Sampling, StepOutput
from pivotrl_hpc.protocol.messages import SeqRequest
from pivotrl_hpc.sched.scheduler import Scheduler
from pivotrl_hpc.sched.state import Sequence


class ControllerError(RuntimeError):
    """The run cannot go on: names the replica/device, the command and the sequences."""

    def __init__(self, message: str, device: int | None = None) -> None:
        super().__init__(message)
        self.device = device


def check_replies(replies) -> None:
    """A failed reply stops the run, naming the device, its role, the error and the
    sequences it held."""
    for r in replies:
        if not r.ok:
            raise ControllerError(f"{r.command} failed on device {r.device} "
                                  f"({r.role.value}): {r.error} "
                                  f"(holding sequences {list(r.seq_ids)})", r.device)


@dataclass
class SeqRecord:
    sid: int
    role: str
    prompt_ids: tuple[int, ...]
    budget: int
    sampling: Sampling
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    replica: str | None = None         # owner; None while queued
    epoch: int = 0                     # placements so far: a Step counts for the one it saw
    version: int | None = None         # oldest policy version that generated a token
    finished: bool = False

    def request(self) -> SeqRequest:
        return SeqRequest(str(self.sid), self.prompt_ids, tuple(self.generated),
                          tuple(self.logprobs), self.budget - len(self.generated), self.sampling)

    def as_sequence(self) -> Sequence:
        return Sequence(self.sid, len(self.prompt_ids), len(self.generated))


STALL_STEPS = 64  # Steps of a replica without a token for a placed sequence: it is lost

Finished = Callable[[SeqRecord, float], None]   # (record, now)
Event = Callable[..., None]          # trace hook: (event, record, replica[, tokens])


class RoleFlow:
    """One generation role: its scheduler plus the records of its sequences."""

    def __init__(self, role: str, scheduler: Scheduler, on_finished: Finished,
                 on_event: Event) -> None:
        self.role, self.sched = role, scheduler
        self.records: dict[int, SeqRecord] = {}
        self.on_finished, self.on_event = on_finished, on_event
        self.versions: dict[str, int | None] = {}   # replica -> policy version it serves
        self.tokens_total = 0
        self.preempted: list[tuple[str, int]] = []  # (replica, sid) to abort on the engine
        self.releasing: dict[str, dict[int, list[int]]] = {}  # replica -> sid -> kept
        self._idle_steps: dict[int, int] = {}       # sid -> Steps of its owner without a token
        self._stepped: set[tuple[int, ...]] = set()  # devices whose engine has run a Step

    def first_step(self, devices: tuple[int, ...]) -> bool:
        """Whether a Step answered on `devices` is the first this role's engine ran there in
        the job: its wall time is mostly the engine's warm-up, so it does not feed the
        throughput fit (and the report counts it apart)."""
        if devices in self._stepped:
            return False
        self._stepped.add(devices)
        return True

    def submit(self, rec: SeqRecord) -> None:
        if rec.sid in self.records:
            raise ControllerError(f"{self.role}: sequence {rec.sid} submitted twice")
        self.records[rec.sid] = rec
        self.sched.submit(rec.as_sequence())
        self.on_event("admit", rec, "")

    def place_ids(self, dst: str, sids) -> list[SeqRequest]:
        """Record that `sids` now run on `dst`; the requests to send it, each resuming from
        the record. From the queue it is a `dispatch`; from another replica, whose engine
        still holds it until its Abort (or ShiftDown) is answered, a `migrate`."""
        reqs = []
        for sid in sids:
            rec = self.records[sid]
            src = rec.replica
            if src is not None:
                self._leaving(src, rec)
            rec.replica = dst
            rec.epoch += 1
            reqs.append(rec.request())
            self.on_event("dispatch" if src is None else "migrate", rec, dst)
        return reqs

    def requeued(self, sids: list[int], replica: str) -> None:
        """Sequences a shift down of `replica` returned to the queue (Algorithm 3 re-queued
        them in the scheduler already): a `preempt`; its ShiftDown reply is their `abort`."""
        for sid in sids:
            rec = self.records[sid]
            if rec.replica == replica:   # else the record moved it already
                self._leaving(replica, rec)
                rec.replica = None
                rec.epoch += 1
                self.on_event("preempt", rec, replica)

    def _leaving(self, replica: str, rec: SeqRecord) -> None:
        """`rec` leaves `replica` with the tokens it has now (the ones kept); the engine
        there lets it go when its Abort or ShiftDown is answered (`released`)."""
        self.releasing.setdefault(replica, {}).setdefault(rec.sid, []).append(len(rec.generated))

    def released(self, replica: str, sids=None) -> None:
        """The engine of `replica` answered an Abort of `sids` (None: its ShiftDown, every
        sequence leaving it): an `abort` row each, with the tokens the record kept."""
        pending = self.releasing.get(replica, {})
        for sid in list(pending) if sids is None else sids:
            kept = pending.get(sid, [])
            for tokens in (kept if sids is None else kept[:1]):   # Aborts answer in order
                self.on_event("abort", self.records[sid], replica, tokens)
            del kept[:len(kept) if sids is None else 1]
            if not kept:
                pending.pop(sid, None)
        if not pending:
            self.releasing.pop(replica, None)

    def placed_on(self, replica: str) -> list[int]:
        """The unfinished sequences whose records place them on `replica`."""
        return [sid for sid, rec in self.records.items()
                if rec.replica == replica and not rec.finished]

    def placements(self, replica: str) -> dict[int, int]:
        """The epochs of the sequences on `replica` now (taken when a Step is sent)."""
        r = self.sched.replicas.get(replica)
        return {sid: self.records[sid].epoch for sid in r.seqs} if r is not None else {}

    def on_step(self, replica: str, outputs: list[StepOutput], now: float,
                epochs: dict[int, int]) -> int:
        """Apply one Step reply of `replica`, sent when its sequences had `epochs`; returns
        the new tokens counted."""
        new, advanced = 0, set()
        for out in outputs:
            done = {f.seq_id: f for f in out.finished}
            # the sequences the engine finished first: they leave the replica before the
            # others grow, so a KV preemption (grow_preempting) never takes one of them (as
            # vLLM frees a finished request's blocks before its next iteration)
            ordered = sorted(out.progress, key=lambda p: p.seq_id not in done) if done \
                else out.progress
            for p in ordered:
                sid = int(p.seq_id)
                if not p.token_ids:   # held, waiting for a slot (vLLM's max_num_seqs)
                    advanced.add(sid)
                    continue
                if self._current(replica, sid, epochs):
                    rec = self.records[sid]
                    complete = len(rec.generated) + len(p.token_ids) >= rec.budget
                    new += self._progress(replica, sid, p.token_ids, p.logprobs,
                                          p.seq_id in done or complete)
                    advanced.add(sid)
                    if p.seq_id in done:
                        self._finish(replica, sid, list(done[p.seq_id].token_ids), now)
                    elif complete:
                        self._finish(replica, sid, list(rec.generated), now)
            for f in out.finished:
                if self._current(replica, int(f.seq_id), epochs):
                    self._finish(replica, int(f.seq_id), list(f.token_ids), now)
        self._check_stalls(replica, epochs, advanced)
        self.tokens_total += new
        return new

    def _check_stalls(self, replica: str, epochs: dict[int, int], advanced: set[int]) -> None:
        for sid in epochs:
            if sid in advanced or not self._current(replica, sid, epochs):
                self._idle_steps.pop(sid, None)
                continue
            n = self._idle_steps[sid] = self._idle_steps.get(sid, 0) + 1
            if n >= STALL_STEPS:
                raise ControllerError(
                    f"{self.role} replica {replica} returned no token for sequence {sid} in "
                    f"{n} Steps: the engine does not hold it (controller and worker disagree)")

    def _current(self, replica: str, sid: int, epochs: dict[int, int]) -> bool:
        """Output of this placement? A former owner's late output, or output of an earlier
        placement on the same replica, is ignored: the record resumes where it stood."""
        rec = self.records.get(sid)
        return (rec is not None and not rec.finished and rec.replica == replica
                and epochs.get(sid) == rec.epoch)

    def _progress(self, replica: str, sid: int, tokens, logprobs, finishing: bool) -> int:
        rec = self.records[sid]
        rec.generated += tokens
        rec.logprobs += logprobs
        v = self.versions.get(replica)
        if v is not None:
            rec.version = v if rec.version is None else min(rec.version, v)
        if not finishing:   # KV full: sequences preempted back to the queue with their tokens
            for victim in self.sched.grow_preempting(replica, sid, len(tokens)):
                self._preempt(replica, victim)
        return len(tokens)

    def _preempt(self, replica: str, victim: int) -> None:
        vrec = self.records[victim]
        self._leaving(replica, vrec)
        vrec.replica = None
        vrec.epoch += 1   # its output still in this reply is stale: it resumes
        self.preempted.append((replica, victim))
        self.on_event("preempt", vrec, replica)

    def evicted(self) -> None:
        """Sequences the scheduler's tail isolation took off their replica (sched/tail.py):
        aborted on the engine as KV preemption's victims are; they wait in the queue."""
        for replica, victim in self.sched.evicted:
            self._preempt(replica, victim)
        self.sched.evicted.clear()

    def _finish(self, replica: str, sid: int, tokens: list[int], now: float) -> None:
        rec = self.records[sid]
        if tokens != rec.generated:
            raise ControllerError(
                f"{self.role} replica {replica}: sequence {sid} finished with tokens that do "
                f"not continue its record ({len(tokens)} vs {len(rec.generated)} tokens)")
        self.sched.replicas[replica].remove(sid)
        rec.finished, rec.replica = True, None
        self._idle_steps.pop(sid, None)
        self.on_event("finish", rec, replica)
        self.on_finished(rec, now)

    def running(self) -> int:
        return sum(r.n_seq for r in self.sched.replicas.values())
