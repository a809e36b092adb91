"""Fit the throughput model's A, B, C, D from measured inter-token latencies (appendix A).

`L = A*t + max(B, C*n) + D` is piecewise linear in (t, n) with one breakpoint at n = B/C.
For every split of the samples by sequence count (memory-bound below, compute-bound above)
the model is linear — `L = A*t + (B+D)` below, `L = A*t + C*n + D` above — so each split is
a small weighted least-squares problem; the split whose fitted model explains the samples
best wins. Residuals are relative (weights 1/L) so small and large batches count alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from pivotrl_hpc.sched.model import ThroughputModel


@dataclass(frozen=True)
class ThroughputSample:
    """One measurement: `n_seq` running sequences, `n_tok` tokens, inter-token latency (s)."""

    n_seq: int
    n_tok: int
    latency: float


@dataclass(frozen=True)
class FitResult:
    model: ThroughputModel
    rel_rms_error: float  # root mean square of (predicted - measured) / measured
    rel_max_error: float
    samples: int


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    m = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Weighted (1/y) least squares with column scaling for conditioning."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] / y for j in range(k)] for r, y in zip(rows, ys)]
    ata = [[sum(x[i] * x[j] for x in xs) for j in range(k)] for i in range(k)]
    atb = [sum(x[i] for x in xs) for i in range(k)]  # target y/y == 1
    sol = _solve(ata, atb)
    if sol is None:
        return None
    return [s / scale[j] for j, s in enumerate(sol)]


def _errors(model: ThroughputModel, samples: Sequence[ThroughputSample]) -> tuple[float, float]:
    rel = [(model.latency(s.n_seq, s.n_tok) - s.latency) / s.latency for s in samples]
    return math.sqrt(sum(e * e for e in rel) / len(rel)), max(abs(e) for e in rel)


def _candidate(split: float, samples: Sequence[ThroughputSample]) -> ThroughputModel | None:
    """Model for samples with n <= split memory-bound and n > split compute-bound."""
    low = [s for s in samples if s.n_seq <= split]
    high = [s for s in samples if s.n_seq > split]
    ys = [s.latency for s in samples]
    if not high:  # memory-bound everywhere: L = A*t + B
        sol = _least_squares([[s.n_tok, 1.0] for s in samples], ys)
        return None if sol is None else _clipped(sol[0], sol[1], 0.0, 0.0)
    if not low:  # compute-bound everywhere: L = A*t + C*n + D
        sol = _least_squares([[s.n_tok, s.n_seq, 1.0] for s in samples], ys)
        return None if sol is None else _clipped(sol[0], 0.0, sol[1], sol[2])
    rows = [[s.n_tok, 1.0, 0.0, 0.0] if s.n_seq <= split else [s.n_tok, 0.0, s.n_seq, 1.0]
            for s in samples]
    sol = _least_squares(rows, ys)
    if sol is None:
        return None
    a, e, c, d = sol
    return _clipped(a, e - d, c, d)


def _clipped(a: float, b: float, c: float, d: float) -> ThroughputModel | None:
    a, b, c, d = (max(0.0, v) for v in (a, b, c, d))
    if b + d <= 0.0 and c <= 0.0:
        return None
    return ThroughputModel(a, b, c, d)


def fit_throughput_model(samples: Iterable[ThroughputSample]) -> FitResult:
    """Least-squares A, B, C, D over all breakpoints; raises ValueError on unusable input."""
    data = list(samples)
    if len(data) < 4:
        raise ValueError(f"need at least 4 throughput samples to fit A, B, C, D, got {len(data)}")
    for s in data:
        if s.n_seq <= 0 or s.n_tok < 0 or not s.latency > 0.0:
            raise ValueError(f"bad throughput sample {s}: need n_seq > 0, n_tok >= 0, latency > 0")
    counts = sorted({s.n_seq for s in data})
    splits = [counts[0] - 1] + counts  # "all compute-bound", then each breakpoint
    best: tuple[float, float, ThroughputModel] | None = None
    for split in splits:
        model = _candidate(split, data)
        if model is None:
            continue
        rms, worst = _errors(model, data)
        if best is None or rms < best[0]:
            best = (rms, worst, model)
    if best is None:
        raise ValueError("throughput samples are degenerate: vary both tokens and sequences")
    return FitResult(model=best[2], rel_rms_error=best[0], rel_max_error=best[1], samples=len(data))
