"""The workload snapshot the planner decides on (paper §7.1; schema in docs/snapshot.md).

The live monitor and the cluster simulator build a `WorkloadSnapshot` directly; `pivotrl plan`
reads one from JSON. Construction validates it: a snapshot that puts a sequence in two
places, overlaps devices, over-fills a KV cache or names an unknown role raises
`SnapshotError` naming the replica and the sequence.

Device layout: devices are numbered 0..gpus-1. A rollout or reward replica of `replica_gpus`
devices occupies one aligned slot `[j*s, (j+1)*s)`; training is one unit over a fixed device
list and shifts as a whole (§5.2).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

from pivotrl_hpc.sched.model import ThroughputModel

ROLLOUT, REWARD, TRAINING = "rollout", "reward", "training"
GEN_ROLES = (ROLLOUT, REWARD)
TRAINING_ID = "training"  # the training unit's id in shift plans


class SnapshotError(ValueError):
    """An inconsistent or malformed workload snapshot."""


@dataclass(frozen=True, slots=True)
class SeqState:
    seq_id: int
    prompt_tokens: int
    generated_tokens: int = 0

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.generated_tokens


@dataclass(frozen=True)
class ReplicaState:
    replica_id: str
    role: str
    devices: tuple[int, ...]
    kv_capacity: int
    sequences: tuple[SeqState, ...] = ()
    throughput: float | None = None  # measured tokens/s; None: use the role's model

    @cached_property
    def n_tok(self) -> int:
        # cached: the planner reads it per replica many times a decision; the instance is
        # frozen, so the sum never goes stale (cached_property writes __dict__ directly)
        return sum(s.prompt_tokens + s.generated_tokens for s in self.sequences)


@dataclass(frozen=True)
class RolePool:
    """A generation role: replica size, KV capacity of a new replica, model, waiting queue."""

    role: str
    replica_gpus: int
    kv_capacity: int
    model: ThroughputModel
    queue: tuple[SeqState, ...] = ()

    def slots(self, gpus: int) -> list[tuple[int, ...]]:
        s = self.replica_gpus
        return [tuple(range(j * s, (j + 1) * s)) for j in range(gpus // s)]


@dataclass(frozen=True)
class TrainingState:
    devices: tuple[int, ...]
    up: bool = False                 # holds its devices (shifted up)
    active: bool = False             # running a step: cannot be shifted down
    next_batch_ready: bool = False

    @property
    def held(self) -> bool:
        """Not to be shifted down: running a step, or up with its next batch ready (between
        the shift up, or one step, and the next step; taking it then only forces it back
        up, a shift pair each way for nothing)."""
        return self.active or (self.up and self.next_batch_ready)


@dataclass(frozen=True)
class WorkloadSnapshot:
    gpus: int
    roles: dict[str, RolePool]
    replicas: tuple[ReplicaState, ...]
    training: TrainingState
    time: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    def role_replicas(self, role: str) -> list[ReplicaState]:
        return [r for r in self.replicas if r.role == role]

    def replica_throughput(self, r: ReplicaState) -> float:
        if r.throughput is not None:
            return r.throughput
        return self.roles[r.role].model.throughput(len(r.sequences), r.n_tok)

    def role_sequences(self, role: str) -> int:
        """N_Role^Seq: running plus waiting."""
        return sum(len(r.sequences) for r in self.role_replicas(role)) + len(self.roles[role].queue)

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1, "time": self.time, "gpus": self.gpus, "meta": dict(self.meta),
            "roles": {name: {"replica_gpus": p.replica_gpus, "kv_capacity": p.kv_capacity,
                             "model": p.model.to_dict(), "queue": _seqs_out(p.queue)}
                      for name, p in self.roles.items()},
            "replicas": [{"id": r.replica_id, "role": r.role, "devices": list(r.devices),
                          "kv_capacity": r.kv_capacity, "throughput": r.throughput,
                          "sequences": _seqs_out(r.sequences)} for r in self.replicas],
            "training": {"devices": list(self.training.devices), "up": self.training.up,
                         "active": self.training.active,
                         "next_batch_ready": self.training.next_batch_ready},
        }

    def to_json(self) -> str:
        """JSON text with one replica (and one queue) per line: diff- and grep-friendly."""
        d = self.to_dict()
        one = lambda v: json.dumps(v, separators=(",", ":"))  # noqa: E731
        roles = ",\n".join(f'  "{k}": {one(v)}' for k, v in d["roles"].items())
        reps = ",\n".join(f"  {one(r)}" for r in d["replicas"])
        head = ", ".join(f'"{k}": {one(d[k])}' for k in ("version", "time", "gpus"))
        return (f'{{{head},\n "meta": {one(d["meta"])},\n "training": {one(d["training"])},\n'
                f' "roles": {{\n{roles}\n }},\n "replicas": [\n{reps}\n ]\n}}\n')

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkloadSnapshot":
        try:
            return _from_dict(data)
        except SnapshotError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError(f"malformed snapshot: {type(exc).__name__}: {exc}") from None


def _seqs_out(seqs: Iterable[SeqState]) -> list[list[int]]:
    return [[s.seq_id, s.prompt_tokens, s.generated_tokens] for s in seqs]


def _seqs_in(rows: Iterable, where: str) -> tuple[SeqState, ...]:
    out = []
    for row in rows:
        if not isinstance(row, (list, tuple)) or len(row) not in (2, 3):
            raise SnapshotError(f"{where}: sequence {row!r} is not [id, prompt, generated]")
        out.append(SeqState(int(row[0]), int(row[1]), int(row[2]) if len(row) == 3 else 0))
    return tuple(out)


def _from_dict(data: dict[str, Any]) -> WorkloadSnapshot:
    roles = {}
    for name, p in data["roles"].items():
        if name not in GEN_ROLES:
            raise SnapshotError(f"unknown role {name!r} in roles (known: {', '.join(GEN_ROLES)})")
        roles[name] = RolePool(name, int(p["replica_gpus"]), int(p["kv_capacity"]),
                               ThroughputModel.from_dict(p["model"]),
                               _seqs_in(p.get("queue", ()), f"{name} queue"))
    replicas = tuple(
        ReplicaState(str(r["id"]), str(r["role"]), tuple(int(d) for d in r["devices"]),
                     int(r["kv_capacity"]), _seqs_in(r.get("sequences", ()), f"replica {r['id']}"),
                     None if r.get("throughput") is None else float(r["throughput"]))
        for r in data["replicas"])
    t = data["training"]
    training = TrainingState(tuple(int(d) for d in t["devices"]), bool(t.get("up", False)),
                             bool(t.get("active", False)), bool(t.get("next_batch_ready", False)))
    return WorkloadSnapshot(int(data["gpus"]), roles, replicas, training,
                            float(data.get("time", 0.0)), dict(data.get("meta", {})))


def _validate(snap: WorkloadSnapshot) -> None:
    if snap.gpus <= 0:
        raise SnapshotError(f"gpus must be positive, got {snap.gpus}")
    for role in GEN_ROLES:
        if role not in snap.roles:
            raise SnapshotError(f"snapshot lacks role {role!r}")
        pool = snap.roles[role]
        if pool.role != role or pool.replica_gpus <= 0 or pool.kv_capacity < 0:
            raise SnapshotError(f"role {role}: need replica_gpus > 0 and kv_capacity >= 0")
    owner: dict[int, str] = {}
    tr = snap.training
    if tr.active and not tr.up:
        raise SnapshotError("training is active but not shifted up")
    if len(set(tr.devices)) != len(tr.devices) or any(not 0 <= d < snap.gpus for d in tr.devices):
        raise SnapshotError(f"training devices {list(tr.devices)} repeat or fall outside "
                            f"0..{snap.gpus - 1}")
    if tr.up:
        owner.update((d, TRAINING_ID) for d in tr.devices)
    # Sequence ids are unique within a role (a reward sequence may reuse its sample's id).
    where: dict[str, dict[int, str]] = {role: {} for role in GEN_ROLES}
    ids: set[str] = set()
    for r in snap.replicas:
        _check_replica(snap, r, ids, owner)
        for s in r.sequences:
            _claim(where[r.role], s, f"replica {r.replica_id}")
    for role in GEN_ROLES:
        for s in snap.roles[role].queue:
            _claim(where[role], s, f"the {role} queue")


def _check_replica(snap: WorkloadSnapshot, r: ReplicaState, ids: set[str],
                   owner: dict[int, str]) -> None:
    name = f"replica {r.replica_id}"
    if r.role not in GEN_ROLES:
        raise SnapshotError(f"{name}: unknown role {r.role!r} (known: {', '.join(GEN_ROLES)})")
    if r.replica_id in ids or r.replica_id == TRAINING_ID:
        raise SnapshotError(f"{name}: duplicate or reserved replica id")
    ids.add(r.replica_id)
    if r.kv_capacity < 0:
        raise SnapshotError(f"{name}: negative KV capacity {r.kv_capacity}")
    size = snap.roles[r.role].replica_gpus
    first = r.devices[0] if r.devices else -1
    if (len(r.devices) != size or first % size or first < 0
            or r.devices != tuple(range(first, first + size)) or first + size > snap.gpus):
        raise SnapshotError(f"{name}: devices {list(r.devices)} are not one aligned "
                            f"{size}-GPU {r.role} slot within 0..{snap.gpus - 1}")
    for d in r.devices:
        if d in owner:
            raise SnapshotError(f"{name}: device {d} is also held by {owner[d]}")
        owner[d] = r.replica_id
    for s in r.sequences:
        if s.prompt_tokens < 0 or s.generated_tokens < 0:
            raise SnapshotError(f"{name}: sequence {s.seq_id} has negative token counts")
    if r.n_tok > r.kv_capacity:
        raise SnapshotError(f"{name}: sequences hold {r.n_tok} tokens, over its KV capacity "
                            f"{r.kv_capacity}")


def _claim(where: dict[int, str], s: SeqState, place: str) -> None:
    if s.seq_id in where:
        raise SnapshotError(f"sequence {s.seq_id} is on {where[s.seq_id]} and on {place}")
    if s.prompt_tokens < 0 or s.generated_tokens < 0:
        raise SnapshotError(f"{place}: sequence {s.seq_id} has negative token counts")
    where[s.seq_id] = place
