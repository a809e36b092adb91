"""Planner steps 1 and 2 (§7.1): pick the shift-up role, prepare sorted shift pairs.

A shift pair groups inactive slots of the shift-up role with the replicas that currently
hold their devices (§7.1, appendix D.1). Slots that share a blocking replica must shift
together with it, so pairs are the connected components of "slot overlaps replica"; free
slots (no blocker) form one pair of penalty 0. Penalty φ = Σ τ_shift(role) · T_i over the
pair's shift-down replicas; idle training generates no tokens, so it costs nothing, and a
training unit that runs a step or has its next batch ready is never shifted down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from pivotrl_hpc.plan.snapshot import (GEN_ROLES, REWARD, ROLLOUT, TRAINING, TRAINING_ID,
                                       ReplicaState, WorkloadSnapshot)

ThroughputOf = Callable[[ReplicaState], float]


@dataclass(frozen=True)
class RoleChoice:
    role: str
    taus: dict[str, float]   # τ_Role = N_Role^Seq / T_Role for rollout and reward
    reason: str


@dataclass(frozen=True)
class ShiftPair:
    up_slots: tuple[tuple[int, ...], ...]   # device tuples of the shift-up replicas, ordered
    shift_down: tuple[str, ...]             # replica ids (TRAINING_ID: the training unit)
    penalty: float

    @property
    def size(self) -> int:
        return len(self.up_slots)

    def to_dict(self) -> dict:
        return {"up_replicas": [list(s) for s in self.up_slots],
                "shift_down": list(self.shift_down), "penalty": self.penalty}


def role_tau(snap: WorkloadSnapshot, role: str, thr: ThroughputOf) -> float:
    n = snap.role_sequences(role)
    t = sum(thr(r) for r in snap.role_replicas(role))
    if n == 0:
        return 0.0
    return math.inf if t <= 0.0 else n / t


def select_shift_up_role(snap: WorkloadSnapshot, thr: ThroughputOf) -> RoleChoice:
    """Training if its next batch is ready (and it is down), else the larger τ_Role."""
    taus = {role: role_tau(snap, role, thr) for role in GEN_ROLES}
    if snap.training.next_batch_ready and not snap.training.up:
        return RoleChoice(TRAINING, taus, "next training batch is ready")
    role = REWARD if taus[REWARD] > taus[ROLLOUT] else ROLLOUT
    other = ROLLOUT if role == REWARD else REWARD
    return RoleChoice(role, taus, f"tau_{role}={taus[role]:.4g} > tau_{other}={taus[other]:.4g}"
                      if taus[role] != taus[other] else f"tau equal ({taus[role]:.4g}): rollout")


def _owners(snap: WorkloadSnapshot) -> dict[int, str]:
    owner = {d: r.replica_id for r in snap.replicas for d in r.devices}
    if snap.training.up:
        owner.update((d, TRAINING_ID) for d in snap.training.devices)
    return owner


def forgone_tokens(snap: WorkloadSnapshot, tau_shift: Mapping[str, float],
                   thr: ThroughputOf) -> dict[str, float]:
    """τ_shift · T_i per replica id: the tokens it fails to generate while shifting."""
    out = {r.replica_id: tau_shift[r.role] * thr(r) for r in snap.replicas}
    out[TRAINING_ID] = 0.0  # training produces no generation throughput
    return out


def training_pair(snap: WorkloadSnapshot, tau_shift: Mapping[str, float],
                  thr: ThroughputOf) -> ShiftPair:
    """Training shifts up as a whole: every replica on its devices shifts down."""
    owner = _owners(snap)
    down = sorted({owner[d] for d in snap.training.devices if d in owner}, key=_id_order(snap))
    cost = forgone_tokens(snap, tau_shift, thr)
    return ShiftPair((tuple(snap.training.devices),), tuple(down), sum(cost[h] for h in down))


def _id_order(snap: WorkloadSnapshot) -> Callable[[str], int]:
    order = {r.replica_id: i for i, r in enumerate(snap.replicas)}
    order[TRAINING_ID] = len(order)
    return order.__getitem__


def prepare_shift_pairs(snap: WorkloadSnapshot, role: str, tau_shift: Mapping[str, float],
                        thr: ThroughputOf) -> list[ShiftPair]:
    """Shift pairs for a rollout or reward shift-up, sorted by ascending penalty."""
    owner = _owners(snap)
    order = _id_order(snap)
    role_of = {r.replica_id: r.role for r in snap.replicas}
    role_of[TRAINING_ID] = TRAINING
    blocked_by_training = snap.training.held
    slots: list[tuple[tuple[int, ...], list[str]]] = []
    for devices in snap.roles[role].slots(snap.gpus):
        holders = sorted({owner[d] for d in devices if d in owner}, key=order)
        if any(role_of[h] == role for h in holders):
            continue  # an active replica of the shift-up role already sits here
        if TRAINING_ID in holders and blocked_by_training:
            continue
        slots.append((devices, holders))
    # Union-find over slots that share a holder: they shift down that holder together.
    parent = list(range(len(slots)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_slot: dict[str, int] = {}
    free: list[int] = []
    for i, (_, holders) in enumerate(slots):
        if not holders:
            free.append(i)
        for h in holders:
            if h in first_slot:
                parent[find(i)] = find(first_slot[h])
            else:
                first_slot[h] = i
    for i in free[1:]:
        parent[find(i)] = find(free[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(slots)):
        groups.setdefault(find(i), []).append(i)
    cost = forgone_tokens(snap, tau_shift, thr)
    pairs = []
    for members in groups.values():
        down = sorted({h for i in members for h in slots[i][1]}, key=order)
        pairs.append(ShiftPair(tuple(slots[i][0] for i in members), tuple(down),
                               sum(cost[h] for h in down)))
    pairs.sort(key=lambda p: (p.penalty, p.up_slots[0]))
    return pairs

