"""Modeled device workers on virtual time: the controller's `WorkerHandle` without engines.

Each worker answers the real `protocol.messages` commands at virtual times given by the
throughput model (a Step of n sequences holding t tokens takes A*t + max(B, C*n) + D per
iteration) and by per-role shift seconds. Generated tokens are a pure function of the
sequence id and position, so a sequence aborted on one worker and resumed on another
produces exactly the tokens it would have produced uninterrupted — the property the real
engines have under greedy decoding, which the controller checks on every finish.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import islice
from pathlib import Path

from pivotrl_hpc import envs
from pivotrl_hpc.controller.clock import VirtualClock
from pivotrl_hpc.controller.flow import STALL_STEPS
from pivotrl_hpc.protocol.engine import (AbortedSequence, EngineOptions, FinishedSequence,
                                         SeqProgress, StepOutput)
from pivotrl_hpc.protocol.messages import (Abort, AddSequences, Command, Prepare, QueryState,
                                           Reload, Reply, RoleKind, SaveCheckpoint, ShiftDown,
                                           ShiftUp, Shutdown, Step, TrainStep, WaitWrite)
from pivotrl_hpc.sched.model import ThroughputModel


_GOLDEN, _MIX = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
# sequences held without a slot are reported (progress without tokens) every this many
# Steps: often enough for flow.STALL_STEPS, not every Step (hundreds wait at long judgements)
HELD_EVERY = STALL_STEPS // 4


@lru_cache(maxsize=1 << 16)
def _seed(seq_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(seq_id.encode(), digest_size=8).digest(), "little")


def tokens_at(seq_id: str, start: int, n: int, vocab: int) -> list[int]:
    """The tokens of `seq_id` at positions start..start+n-1: a pure function of the sequence
    and the position (one hash of the id, then splitmix64's first rounds per position, in
    uint64 arithmetic: it wraps modulo 2**64 as splitmix64 does)."""
    import numpy as np   # here: importing the controller and the simulator stays light

    y = np.arange(start, start + n, dtype=np.uint64) * np.uint64(_GOLDEN) \
        + np.uint64(_seed(seq_id))
    z = (y ^ (y >> np.uint64(30))) * np.uint64(_MIX)
    return ((z ^ (z >> np.uint64(27))) % np.uint64(vocab)).tolist()


@dataclass
class ModeledStore:
    """The cluster's GPS, as far as versions go."""
    version: int = 0
    pending: int | None = None


@dataclass
class _Seq:
    prompt: list[int]
    generated: list[int]
    logprobs: list[float]
    remaining: int
    sampling: object
    # the tokens it will generate here, drawn at once where it lands (tokens_at per Step
    # was a fifth of the simulator's time); generated[start:] came from it. Empty on a TP
    # follower: it only counts, its leader decodes
    ahead: list[int] = field(default_factory=list)
    start: int = 0
    length: int = 0   # prompt + generated tokens: what the iteration latency reads
    prefilled: bool = False   # its prompt (+ generated tokens) prefilled here yet

    def __post_init__(self) -> None:
        self.length = len(self.prompt) + len(self.generated)

    def next_tokens(self, k: int) -> list[int]:
        at = len(self.generated) - self.start
        return self.ahead[at:at + k]


@dataclass
class ModeledWorker:
    device: int
    clock: VirtualClock
    store: ModeledStore
    models: dict[str, ThroughputModel]
    shift_up_s: dict[str, float]
    shift_down_s: dict[str, float]
    train_s: float = 1.0
    train_s_per_token: float = 0.0     # + this per prompt and response token of the batch
    step_overhead_s: dict[str, float] = field(default_factory=dict)   # a Step's, per role
    first_step_s: dict[str, float] = field(default_factory=dict)  # a role's first Step here
    # seconds to prefill one token, per model ("policy", "genrm"): a sequence pays for its
    # prompt and generated tokens (a resumed one is prefilled again) in the iteration that
    # first runs it, as vLLM schedules a waiting request's prefill only when it gets a slot:
    # one aborted (migrated away) before then costs nothing
    prefill_s_per_token: dict[str, float] = field(default_factory=dict)
    # the GPS Write of a published step (sim/costs.py): its local part ends the TrainStep,
    # WaitWrite waits for its replication to every node; a Reload Reads the new version
    write_local_s: float = 0.0
    write_replication_s: float = 0.0
    reload_s: float = 0.0
    # sequences decoded at once, as the live engines' vLLM max_num_seqs (runtime/spec.py
    # leaves EngineOptions' default); the Scheduler may place more (up to the KV capacity)
    max_num_seqs: int = EngineOptions.max_num_seqs
    vocab: int = 64
    role: RoleKind = RoleKind.IDLE
    version: int | None = None
    # False on a TP follower of a generation replica (ShiftUp names another device as the
    # replica's leader): as vLLM's non-driver workers it returns no outputs, so it only
    # counts what times its Steps (sequences, tokens, finishes); the leader answers for all
    leads: bool = True
    # command names that fail here (tests, through the one fault hook:
    # PIVOTRL_TEST_FAULTS=modeled_Step=1 when the worker is made)
    fail_on: frozenset[str] = field(default_factory=lambda: frozenset(
        name.removeprefix("modeled_") for name, n in envs.faults().items()
        if name.startswith("modeled_") and n > 0))
    slowdown: float = 1.0              # this device's step latency / the model's
    # True: a sequence's finish is reported by the Step after the one of its last token, and
    # a named Abort in between drops it silently, as the real engine can (flow.py docstring)
    late_finish: bool = False
    seqs: dict[str, _Seq] = field(default_factory=dict)
    _due: list[tuple[float, Reply]] = field(default_factory=list)
    _free_at: float = 0.0
    _warm: set = field(default_factory=set)   # roles that have run a Step on this device
    steps: int = 0                            # Steps run here
    log: list[str] = field(default_factory=list)
    train_seconds: list[float] = field(default_factory=list)   # each TrainStep's here

    # --- WorkerHandle --------------------------------------------------------------------
    def submit(self, cmd: Command) -> None:
        self.log.append(type(cmd).__name__)
        start = max(self._free_at, self.clock.now())
        if type(cmd).__name__ in self.fail_on:
            reply, seconds = Reply(type(cmd).__name__, False, self.role, self.device,
                                   error="injected failure",
                                   seq_ids=tuple(sorted(self.seqs))), 0.0
        else:
            try:
                result, seconds = self._run(cmd)
                reply = Reply(type(cmd).__name__, True, self.role, self.device, result=result,
                              phases={"total": seconds})
            except ValueError as e:  # what the real engine refuses, it refuses here too
                reply, seconds = Reply(type(cmd).__name__, False, self.role, self.device,
                                       error=f"ValueError: {e}"), 0.0
        self._free_at = start + seconds
        self._due.append((self._free_at, reply))

    def poll(self) -> list[Reply]:
        # due times only grow (one command at a time, each after the last): a prefix is due
        now, due = self.clock.now(), self._due
        n = 0
        while n < len(due) and due[n][0] <= now:
            n += 1
        out = [r for _, r in due[:n]]
        del due[:n]
        return out

    def next_reply_time(self) -> float | None:
        return self._due[0][0] if self._due else None

    # --- commands ------------------------------------------------------------------------
    def _run(self, cmd: Command):
        if isinstance(cmd, ShiftUp):
            self.role = cmd.role
            # a TP follower keeps only what times its Steps; its leader decodes
            self.leads = cmd.replica == self.device or cmd.role == RoleKind.TRAINING
            if cmd.role == RoleKind.ROLLOUT or cmd.role == RoleKind.TRAINING:
                self.version = self.store.version
            return {"version": self.version}, self.shift_up_s[cmd.role.value]
        if isinstance(cmd, Prepare):  # modeled shifts are warm: nothing to build
            return {"built": list(cmd.models), "seconds": 0.0}, 0.0
        if isinstance(cmd, ShiftDown):
            if self.role == RoleKind.IDLE:   # as DeviceWorker._shift_down (RoleError)
                raise ValueError("shift down while idle")
            back = self._abort(None)
            role, self.role = self.role.value, RoleKind.IDLE
            return back, self.shift_down_s[role]
        if isinstance(cmd, AddSequences):
            for s in cmd.seqs:
                if s.max_new_tokens < 1:  # as VLLMEngine.add
                    raise ValueError(f"sequence {s.seq_id!r}: no tokens left to generate")
            for s in cmd.seqs:
                done = len(s.generated_ids)
                self.seqs[s.seq_id] = _Seq(list(s.prompt_ids), list(s.generated_ids),
                                           list(s.generated_logprobs), s.max_new_tokens,
                                           s.sampling, tokens_at(
                                               s.seq_id, done, s.max_new_tokens, self.vocab)
                                           if self.leads else [], done)
            return len(cmd.seqs), 0.0
        if isinstance(cmd, Step):
            self.steps += 1
            outs, left = [], cmd.iterations
            while left > 0:
                out = self._iterations(left, first=not outs)
                outs.append(out)
                left -= out.iterations
            # the reply comes this much after the iterations; their seconds stay the model's
            role, first = self.role.value, self.role.value not in self._warm
            self._warm.add(role)
            return outs, sum(o.seconds for o in outs) + self.step_overhead_s.get(role, 0.0) \
                + (self.first_step_s.get(role, 0.0) if first else 0.0)
        if isinstance(cmd, Abort):
            return self._abort(cmd.seq_ids), 0.0
        if isinstance(cmd, TrainStep):
            self.store.pending = self.store.version + 1
            b = cmd.batch
            tokens = sum(map(len, b.prompts)) + sum(map(len, b.responses))
            self.train_seconds.append(self.train_s + self.train_s_per_token * tokens)
            write = self.write_local_s if cmd.publish else 0.0
            return {"loss": 0.0, "gps_version": self.store.pending}, \
                self.train_seconds[-1] + write
        if isinstance(cmd, WaitWrite):
            if self.store.pending is not None:
                self.store.version, self.store.pending = self.store.pending, None
            self.version = self.store.version
            return {"version": self.store.version}, self.write_replication_s
        if isinstance(cmd, Reload):
            self.version = cmd.version if cmd.version is not None else self.store.version
            return {"version": self.version}, self.reload_s
        if isinstance(cmd, SaveCheckpoint):
            return self._checkpoint(cmd), 0.0
        if isinstance(cmd, (QueryState, Shutdown)):
            return {"role": self.role.value, "version": self.version}, 0.0
        raise TypeError(f"modeled worker cannot run {cmd!r}")

    def _checkpoint(self, cmd: SaveCheckpoint) -> dict:
        """A modeled training rank's state is its policy version: the first one writes it
        where the real rank writes the policy, every one its optimizer file."""
        from pivotrl_hpc.checkpoint.folders import open_folder, write_at
        from pivotrl_hpc.checkpoint.layout import POLICY, optim_file

        path = optim_file(Path(cmd.folder), self.device)
        for folder, name in ((path.parent, path.name),) + (
                ((Path(cmd.folder) / POLICY, "version"),) if self.device == 0 else ()):
            fd = open_folder(folder, own=3, create=True)   # 0700, 0600 whatever the umask
            try:
                write_at(fd, name, f"{cmd.version}\n")
            finally:
                os.close(fd)
        return {"rank": self.device, "optim_bytes": 0}

    def _iterations(self, most: int, first: bool = True) -> StepOutput:
        """Up to `most` decode iterations as one output: as many as pass before a sequence
        finishes (its finish ends the block), so the per-token work is done per sequence.
        Each iteration takes the model's latency at its own token count; with `late_finish`
        (tests) one iteration at a time, as the engine reports."""
        model = self.models[self._model()]
        # as vLLM: the first max_num_seqs sequences in arrival order run, the rest wait
        # (their KV is not allocated yet) until a running one finishes
        running = list(islice(self.seqs.items(), self.max_num_seqs))
        # those running for the first time here are prefilled in this block
        fresh = [s for _, s in running if not s.prefilled]
        prefill = self.slowdown * sum(s.length for s in fresh) * self.prefill_s_per_token.get(
            self._model(), 0.0)
        for s in fresh:
            s.prefilled = True
        live = [(sid, s) for sid, s in running if s.remaining > 0]
        k = 1 if self.late_finish or not live else min(most, min(s.remaining for _, s in live))
        n_seq = len(running)
        n_tok = sum(s.length for _, s in running)
        # iteration i sees n_tok + i * (sequences still generating) tokens
        seconds = prefill + (self.slowdown * sum(model.latency(n_seq, n_tok + i * len(live))
                                                 for i in range(k)) if self.seqs else 0.0)
        if not self.leads:
            return self._count(live, k, first, seconds)
        progress, finished = [], []
        if first and self.late_finish:  # reported by the Step after its last token
            finished += [self._finished(sid) for sid, s in list(self.seqs.items())
                         if s.remaining <= 0]
        if first and self.steps % HELD_EVERY == 1 and len(self.seqs) > len(running):
            # held without a slot: progress without tokens, so that the controller knows
            # they are not lost (flow.STALL_STEPS) while they wait their turn
            progress += [SeqProgress(sid, [], []) for sid in islice(self.seqs, len(running),
                                                                     None)]
        for sid, s in live:
            toks = s.next_tokens(k)
            s.generated += toks
            s.logprobs += [-1.0] * k
            s.remaining -= k
            s.length += k
            progress.append(SeqProgress(sid, toks, [-1.0] * k))
            if s.remaining <= 0 and not self.late_finish:
                finished.append(self._finished(sid))
        return StepOutput(progress, finished, seconds, k)

    def _count(self, live: list, k: int, first: bool, seconds: float) -> StepOutput:
        """A TP follower's iterations: the leader's sequence and token counts and finishes
        (what times the next Step), no tokens and no outputs."""
        if first and self.late_finish:
            for sid in [sid for sid, s in self.seqs.items() if s.remaining <= 0]:
                del self.seqs[sid]
        for sid, s in live:
            s.remaining -= k
            s.length += k
            if s.remaining <= 0 and not self.late_finish:
                del self.seqs[sid]
        return StepOutput([], [], seconds, k)

    def _model(self) -> str:
        return "policy" if self.role == RoleKind.ROLLOUT else "genrm"

    def _finished(self, sid: str) -> FinishedSequence:
        s = self.seqs.pop(sid)
        return FinishedSequence(sid, s.prompt, list(s.generated), list(s.logprobs), "length")

    def _abort(self, ids) -> list[AbortedSequence]:
        ids = list(self.seqs) if ids is None else [i for i in ids if i in self.seqs]
        out = []
        for sid in ids:
            s = self.seqs.pop(sid)
            # finished in the engine: not returned, never reported; a follower has no tokens
            if s.remaining <= 0 or not self.leads:
                continue
            out.append(AbortedSequence(sid, s.prompt, s.generated, s.logprobs, s.remaining,
                                       s.sampling))
        return out
