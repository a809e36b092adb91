"""Replica throughput models (paper §6.1 and appendix A).

The inter-token latency of a replica running `n` sequences holding `t` tokens in total is
`L = A*t + max(B, C*n) + D`: attention reads the KV cache (linear in tokens), the FFN is
either weight-load bound (constant B) or compute bound (linear in sequences). Its generation
throughput is `T = n / L` tokens per second, and the gain of adding a sequence of length `l`
is `ΔT = T(n+1, t+l) - T(n, t)`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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
        return self.A * n_tok + self.ffn_seconds(n_seq) + self.D

    def ffn_seconds(self, n_seq: int) -> float:
        """The FFN's share of an iteration: weight-load bound (B) or compute bound (C n)."""
        return max(self.B, self.C * n_seq)

    def throughput(self, n_seq: int, n_tok: int) -> float:
        if n_seq <= 0:
            return 0.0
        return n_seq / self.latency(n_seq, n_tok)

    def gain(self, n_seq: int, n_tok: int, length: int) -> float:
        """ΔT_i of dispatching one more sequence of `length` tokens (§6.1)."""
        return self.throughput(n_seq + 1, n_tok + length) - self.throughput(n_seq, n_tok)

    def to_dict(self) -> dict[str, float]:
        return {"A": self.A, "B": self.B, "C": self.C, "D": self.D}

    def scaled(self, factor: float) -> "ThroughputModel":
        """Every second of the model times `factor` (a calibration's scale)."""
        return replace(self, A=self.A * factor, B=self.B * factor, C=self.C * factor,
                       D=self.D * factor)

    @classmethod
    def from_dict(cls, data: dict) -> "ThroughputModel":
        if "expert_B" in data:
            return MoEThroughputModel.from_dict(data)
        try:
            return cls(float(data["A"]), float(data["B"]), float(data["C"]), float(data["D"]))
        except KeyError as exc:
            raise ValueError(f"throughput model lacks constant {exc.args[0]!r}") from None


@dataclass(frozen=True)
class MoEThroughputModel(ThroughputModel):
    """A mixture-of-experts replica: the weight read of an iteration is the dense part (B)
    plus the routed experts the batch touches. Each of `n` sequences picks `top_k` of
    `experts` per layer, so a layer reads E (1 - (1 - k/E)^n) distinct experts on average
    (routing taken as uniform): `expert_B` (every routed expert read once) times
    1 - (1 - k/E)^n. One sequence reads k/E of them, a batch of hundreds all."""

    expert_B: float = 0.0
    experts: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.expert_B >= 0 and 0 < self.top_k <= self.experts):
            raise ValueError(f"MoE model needs expert_B >= 0 and 0 < top_k <= experts, got "
                             f"{self.expert_B!r}, {self.top_k}, {self.experts}")

    def weight_seconds(self, n_seq: int) -> float:
        touched = 1.0 - (1.0 - self.top_k / self.experts) ** max(n_seq, 0)
        return self.B + self.expert_B * touched

    def ffn_seconds(self, n_seq: int) -> float:
        return max(self.weight_seconds(n_seq), self.C * n_seq)

    def to_dict(self) -> dict[str, float]:
        return {**super().to_dict(), "expert_B": self.expert_B, "experts": self.experts,
                "top_k": self.top_k}

    def scaled(self, factor: float) -> "MoEThroughputModel":
        return replace(super().scaled(factor), expert_B=self.expert_B * factor)

    @classmethod
    def from_dict(cls, data: dict) -> "MoEThroughputModel":
        try:
            return cls(*(float(data[k]) for k in "ABCD"), float(data["expert_B"]),
                       int(data["experts"]), int(data["top_k"]))
        except KeyError as exc:
            raise ValueError(f"MoE throughput model lacks {exc.args[0]!r}") from None


@dataclass(frozen=True)
class BinaryThroughputModel:
    """The vanilla ablation of §8.4: a replica's throughput is 1 if it runs anything, else 0."""

    def throughput(self, n_seq: int, n_tok: int) -> float:
        return 1.0 if n_seq > 0 else 0.0

    def gain(self, n_seq: int, n_tok: int, length: int) -> float:
        return 0.0 if n_seq > 0 else 1.0
