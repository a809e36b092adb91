"""Commands the controller sends a device worker, and the worker's replies.

Plain dataclasses: they cross MPI as `WORKER_WIRE` bytes (`protocol.mpi`), never pickled,
and the trace records them. One command, one reply; a failed command still gets a reply.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pivotrl_hpc.protocol.engine import (AbortedSequence, EngineState, FinishedSequence,
                                         RunningSequence, Sampling, SeqProgress, StepOutput)
from pivotrl_hpc.protocol.wire import Codec


class RoleKind(str, Enum):
    IDLE = "idle"
    ROLLOUT = "rollout"      # vLLM serving the policy
    REWARD = "reward"        # vLLM serving the GenRM
    TRAINING = "training"    # Megatron-Core training the policy


# role -> the model whose parameters it Reads from GPS on shift up
ROLE_MODEL = {RoleKind.ROLLOUT: "policy", RoleKind.REWARD: "genrm", RoleKind.TRAINING: "policy"}


@dataclass(frozen=True)
class ShiftUp:
    role: RoleKind
    replica: int = 0
    version: int | None = None  # GPS version to Read; None = the current one


@dataclass(frozen=True)
class ShiftDown:
    pass


@dataclass(frozen=True)
class Prepare:
    """Build the engines of `models` now and put them to sleep, the worker staying idle: a
    role's preserved context is built once, at job start (paper §5.2), so every later shift
    up to it only wakes the engine. Workers without engine hosts keep one engine per process
    and build nothing."""
    models: tuple[str, ...] = ("policy", "genrm")


@dataclass(frozen=True)
class SeqRequest:
    seq_id: str
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...] = ()   # tokens of earlier runs: resume, not restart
    generated_logprobs: tuple[float, ...] = ()  # their behaviour logprobs (for training)
    max_new_tokens: int = 64              # remaining budget
    sampling: Sampling = field(default_factory=Sampling)

    @classmethod
    def resume(cls, aborted) -> "SeqRequest":
        """Re-queue an aborted sequence (protocol.engine.AbortedSequence): same prompt,
        the tokens so far and the remaining budget, so generation resumes (appendix C.1)."""
        return cls(aborted.seq_id, tuple(aborted.prompt_ids), tuple(aborted.generated_ids),
                   tuple(aborted.logprobs), aborted.max_new_tokens_remaining, aborted.sampling)


@dataclass(frozen=True)
class AddSequences:
    seqs: tuple[SeqRequest, ...]


@dataclass(frozen=True)
class Step:
    iterations: int = 1


@dataclass(frozen=True)
class Abort:
    seq_ids: tuple[str, ...] | None = None  # None: Abort(All)


@dataclass(frozen=True)
class TrainBatch:
    """A training batch as plain lists (the controller stays torch-free); the worker packs
    it into `engines.megatron.batch.RolloutBatch`. One GRPO group never spans two batches."""
    prompts: tuple[tuple[int, ...], ...]
    responses: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    rewards: tuple[float, ...]
    group_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class Reload:
    """Refresh a running inference replica's policy weights in place from GPS (after a
    training step was published); running sequences keep going (their KV stays)."""
    version: int | None = None  # this one or a newer live one (issue 47); None: the current


@dataclass(frozen=True)
class TrainStep:
    batch: Any            # TrainBatch (over MPI); in-process callers may pass a RolloutBatch
    publish: bool = True  # GPS Write of the updated policy after the step


@dataclass(frozen=True)
class WaitWrite:
    """Block until the last published policy version is replicated on every node."""
    timeout_s: float = 300.0


@dataclass(frozen=True)
class SaveCheckpoint:
    """Training ranks: write this rank's optimizer state (and, on the first training rank,
    the policy `version` from GPS as a HuggingFace folder) into checkpoint folder `folder`."""
    folder: str
    version: int


@dataclass(frozen=True)
class QueryState:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


Command = (ShiftUp | ShiftDown | Prepare | AddSequences | Step | Abort | TrainStep | WaitWrite
           | Reload | SaveCheckpoint | QueryState | Shutdown)


@dataclass
class Reply:
    command: str                      # the command's class name, for logs and the trace
    ok: bool
    role: RoleKind
    replica: int
    result: Any = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds per shift phase
    error: str | None = None
    seq_ids: tuple[str, ...] = ()     # sequences the worker held when the command failed
    device: int = -1                  # set by the controller's side on arrival


# MPI tags of the worker protocol: other traffic on the communicator (GPS, the trainer's
# collectives) never mixes in.
TAG_COMMAND = 71
TAG_REPLY = 72

# Everything a command or a reply carries between the controller and a worker over MPI: a
# result holds JSON values and these (a Step's StepOutputs, a shift down's AbortedSequences,
# QueryState's EngineState).
WORKER_WIRE = Codec(ShiftUp, ShiftDown, Prepare, SeqRequest, AddSequences, Step, Abort,
                    TrainBatch, Reload, TrainStep, WaitWrite, SaveCheckpoint, QueryState,
                    Shutdown, Reply, Sampling, SeqProgress, FinishedSequence, StepOutput,
                    AbortedSequence, RunningSequence, EngineState)
