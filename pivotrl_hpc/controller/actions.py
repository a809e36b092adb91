"""The Executor's pure half (the Executor, which sends, is in shifts.py): a shift plan -> the
actions that carry it out (paper §7, §6.2).

Order, as the paper gives it: (1) Abort/Dispatch migration on the two schedulers
(Algorithm 3: everything on a shift-down replica is aborted and dispatched onto the
remaining replicas), (2) shift down, (3) shift up. The shift-up migration (Algorithm 4)
runs when a new replica has answered its shift up (`migration_actions`), since only then can
it take sequences. Devices run their commands in FIFO order, so on each device a shift down
always precedes the shift up queued after it. The thin sending part lives in the loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from pivotrl_hpc.plan.snapshot import GEN_ROLES, TRAINING, TRAINING_ID
from pivotrl_hpc.plan.types import ShiftPlan
from pivotrl_hpc.sched.scheduler import MigrationResult, Move, Scheduler

MIGRATE, SHIFT_DOWN, SHIFT_UP = 0, 1, 2


@dataclass(frozen=True)
class Action:
    phase: int                    # MIGRATE, SHIFT_DOWN or SHIFT_UP
    kind: str                     # "add", "abort", "shift_down", "shift_up"
    role: str
    replica: str
    devices: tuple[int, ...] = ()
    seq_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReplicaInfo:
    role: str
    devices: tuple[int, ...]


class PlanError(ValueError):
    """A plan that does not fit the current state (re-checked before it executes)."""


def replica_id(role: str, devices: tuple[int, ...]) -> str:
    """Stable ids: a replica is named by its role and its first device."""
    return TRAINING_ID if role == TRAINING else f"{role}{devices[0]}"


def check_plan(plan: ShiftPlan, replicas: Mapping[str, ReplicaInfo],
               training_devices: tuple[int, ...], training_up: bool, training_active: bool,
               gpus: int) -> None:
    """Raise PlanError if `plan` no longer fits: unknown replicas, busy training, or a
    shift up onto a device that stays held."""
    held: dict[int, str] = {}
    for rid, info in replicas.items():
        held.update((d, rid) for d in info.devices)
    if training_up:
        held.update((d, TRAINING_ID) for d in training_devices)
    for rid in plan.shift_down:
        if rid == TRAINING_ID:
            if not training_up or training_active:
                raise PlanError("plan shifts training down while it is "
                                + ("running a step" if training_active else "not up"))
        elif rid not in replicas:
            raise PlanError(f"plan shifts down {rid}, which is not up")
    freed = set(plan.shift_down)
    taken: set[int] = set()
    for spec in plan.shift_up:
        if spec.role == TRAINING and training_up and TRAINING_ID not in freed:
            raise PlanError("plan shifts training up while it is up")
        for d in spec.devices:
            if not 0 <= d < gpus or d in taken or (d in held and held[d] not in freed):
                raise PlanError(f"plan shifts {spec.role} up on device {d}, held by "
                                f"{held.get(d, 'another shift up')}")
            taken.add(d)


def plan_actions(plan: ShiftPlan, replicas: Mapping[str, ReplicaInfo],
                 schedulers: Mapping[str, Scheduler], training_devices: tuple[int, ...]
                 ) -> tuple[list[Action], dict[str, MigrationResult]]:
    """Translate a plan; mutates `schedulers` (the shift-down replicas leave them)."""
    actions: list[Action] = []
    results: dict[str, MigrationResult] = {}
    for role in GEN_ROLES:
        down = [rid for rid in plan.shift_down if rid in replicas and replicas[rid].role == role]
        if not down:
            continue
        res = schedulers[role].shift_down_migration(down)
        results[role] = res
        actions += add_actions(role, res.moves, replicas)
    for rid in plan.shift_down:
        if rid == TRAINING_ID:
            actions.append(Action(SHIFT_DOWN, "shift_down", TRAINING, TRAINING_ID,
                                  tuple(training_devices)))
        else:
            info = replicas[rid]
            actions.append(Action(SHIFT_DOWN, "shift_down", info.role, rid, info.devices))
    for spec in plan.shift_up:
        actions.append(Action(SHIFT_UP, "shift_up", spec.role,
                              replica_id(spec.role, spec.devices), tuple(spec.devices)))
    return actions, results


def net_moves(moves: list[Move]) -> list[Move]:
    """One move per sequence: its first source to its last destination. Algorithm 4 may move
    a sequence twice in one migration (r1 -> r2, later r2 -> r0); sent as they were, with
    every Abort before every add, the Abort on r2 came before the add there, so the sequence
    ran on r2 as well, and r2's copy, not the record's, was what the scheduler counted."""
    first: dict[int, Move] = {}
    last: dict[int, Move] = {}
    for m in moves:
        first.setdefault(m.seq_id, m)
        last[m.seq_id] = m
    return [Move(sid, first[sid].src, last[sid].dst) for sid in last
            if first[sid].src != last[sid].dst]


def migration_actions(role: str, result: MigrationResult,
                      replicas: Mapping[str, ReplicaInfo]) -> list[Action]:
    """Algorithm 4's moves, netted per sequence: abort on the source, add on the destination."""
    moves = net_moves(result.moves)
    aborts: dict[str, list[int]] = {}
    for m in moves:
        if m.src is not None:
            aborts.setdefault(m.src, []).append(m.seq_id)
    out = [Action(MIGRATE, "abort", role, src, replicas[src].devices, tuple(ids))
           for src, ids in aborts.items() if src in replicas]
    return out + add_actions(role, moves, replicas)


def add_actions(role: str, moves: list[Move], replicas: Mapping[str, ReplicaInfo]
                ) -> list[Action]:
    """Dispatch or migration moves -> one "add" per destination replica."""
    by_dst: dict[str, list[int]] = {}
    for m in moves:
        by_dst.setdefault(m.dst, []).append(m.seq_id)
    return [Action(MIGRATE, "add", role, dst, replicas[dst].devices, tuple(ids))
            for dst, ids in by_dst.items()]
