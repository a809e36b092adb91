"""Replica throughput models (paper §6.1 and appendix A).

The inter-token latency of a replica running `n` sequences holding `t` tokens in total is
`L = A*t + max(B, C*n) + D`: attention reads the KV cache (linear in tokens), the FFN is
either weight-load bound (constant B) or compute bound (linear in sequences). Its generation
throughput is `T = n / L` tokens per second, and the gain of adding a sequence of length `l`
is `ΔT = T(n+1, t+l) - T(n, t)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ReplicaThroughput(Protocol):
    """What Dispatch and the migrations need from a throughput model."""

    def throughput(self, n_seq: int, n_tok: int) -> float: ...

    def gain(self, n_seq: int, n_tok: int, length: int) -> float: ...


@dataclass(frozen=True)
class ThroughputModel:
    """`T_i = N_i^Seq / (A·N_i^Token + max(B, C·N_i^Seq) + D)`, constants in seconds."""

    A: float
    B: float
    C: float
    D: float

    def __post_init__(self) -> None:
        for name in ("A", "B", "C", "D"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"throughput model constant {name}={value!r} must be >= 0")
        if self.B + self.D <= 0.0 and self.C <= 0.0:
            raise ValueError("throughput model needs B + D > 0 or C > 0 (a latency floor)")

    def latency(self, n_seq: int, n_tok: int) -> float:
        """Inter-token latency in seconds."""
        return self.A * n_tok + max(self.B, self.C * n_seq) + self.D

    def throughput(self, n_seq: int, n_tok: int) -> float:
        if n_seq <= 0:
            return 0.0
        return n_seq / (self.A * n_tok + max(self.B, self.C * n_seq) + self.D)

    def gain(self, n_seq: int, n_tok: int, length: int) -> float:
        """ΔT_i of dispatching one more sequence of `length` tokens (§6.1)."""
        return self.throughput(n_seq + 1, n_tok + length) - self.throughput(n_seq, n_tok)

    def to_dict(self) -> dict[str, float]:
        return {"A": self.A, "B": self.B, "C": self.C, "D": self.D}

    @classmethod
    def from_dict(cls, data: dict) -> "ThroughputModel":
        try:
            return cls(float(data["A"]), float(data["B"]), float(data["C"]), float(data["D"]))
        except KeyError as exc:
            raise ValueError(f"throughput model lacks constant {exc.args[0]!r}") from None


@dataclass(frozen=True)
class BinaryThroughputModel:
    """The vanilla ablation of §8.4: a replica's throughput is 1 if it runs anything, else 0."""

    def throughput(self, n_seq: int, n_tok: int) -> float:
        return 1.0 if n_seq > 0 else 0.0

    def gain(self, n_seq: int, n_tok: int, length: int) -> float:
        return 0.0 if n_seq > 0 else 1.0
