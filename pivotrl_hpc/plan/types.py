"""What every allocation policy returns, and the protocol they share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pivotrl_hpc.plan.snapshot import WorkloadSnapshot


@dataclass(frozen=True)
class ReplicaSpec:
    """A replica to shift up: its role and devices (training: the whole unit)."""

    role: str
    devices: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "devices": list(self.devices)}


@dataclass(frozen=True)
class ShiftPlan:
    """Shift down `shift_down` (replica ids; "training" is the training unit), then shift up
    `shift_up`. Penalty, estimated throughput and benefit come from the planner when known."""

    shift_down: tuple[str, ...]
    shift_up: tuple[ReplicaSpec, ...]
    reason: str
    penalty: float = 0.0
    est_throughput: float | None = None
    benefit: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"shift_down": list(self.shift_down),
                "shift_up": [s.to_dict() for s in self.shift_up],
                "reason": self.reason, "penalty": self.penalty,
                "est_throughput": self.est_throughput, "benefit": self.benefit}


class AllocationPolicy(Protocol):
    """One decision per planning round: a shift plan, or None to keep the allocation."""

    name: str

    def decide(self, snap: WorkloadSnapshot) -> ShiftPlan | None: ...
