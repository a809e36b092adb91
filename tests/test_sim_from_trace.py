"""`pivotrl simulate --from-trace` models each engine's iteration on the live engines' own
seconds (issue 49, point 5): the `work` rows' engine seconds an iteration against the
sequences decoded, least squares; the Step's round trip beyond them is charged apart."""
from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl_hpc.config import load_config
from pivotrl_hpc.sim.run import SimConstants
from pivotrl_hpc.trace.writer import TraceWriter
from live_util import model_overrides

ROOT = Path(__file__).resolve().parents[1]


def live_trace(path: Path, k: int, steps: int = 12) -> None:
    """A live run's rows: reward Steps whose engine took 0.02 + 0.003 n seconds an
    iteration at n sequences, 0.05 s more a round trip; its online fit, of round trips
    pooled into windows, says much less (A-D below), as the genrm-heavy-cpu fits did."""
    with TraceWriter(path) as w:
        w.append("fits", t=1.0, role="reward", A=0.0, B=0.01, C=0.0015, D=0.0116,
                 error=0.43, samples=120)
        w.append("work", t=0.5, role="reward", replica="reward0", devices=1, seconds=2.0,
                 engine_s=1.0, tokens=k, first=1)              # warm-up: left out
        for i in range(steps):
            n = 1 + i % 6
            engine = k * (0.02 + 0.003 * n)
            w.append("work", t=1.0 + i, role="reward", replica="reward0", devices=1,
                     seconds=engine + 0.05, engine_s=engine, tokens=n * k, first=0)
        w.close({"step_overhead_s": {"reward": 0.05}})


def test_the_modeled_iteration_is_the_live_engines_own(tiny_models, tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", model_overrides(tiny_models))
    k = cfg.roles.step_iterations
    live_trace(tmp_path / "live.h5", k)
    got = SimConstants.from_trace(tmp_path / "live.h5", cfg)
    g = got.throughput["genrm"]
    assert (g.C, g.D) == pytest.approx((0.003, 0.02))
    for n in (1, 6, 12):   # the engine's seconds at the same batch, not the fit's
        assert g.latency(n, 500) == pytest.approx(0.02 + 0.003 * n)
    assert got.step_overhead_s == {"reward": 0.05}   # the round trip, charged apart


def test_too_few_steps_fall_back_to_the_online_fit(tiny_models, tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", model_overrides(tiny_models))
    k = cfg.roles.step_iterations
    live_trace(tmp_path / "live.h5", k, steps=5)
    g = SimConstants.from_trace(tmp_path / "live.h5", cfg).throughput["genrm"]
    assert (g.B, g.C, g.D) == pytest.approx((0.01, 0.0015, max(0.0, 0.0116 - 0.05 / k)))
