"""Simulated runs of the paper configs for `pivotrl reproduce`, one process each.

A `Run` names a config, a paradigm, a seed and overrides; `run_one` simulates it with the
constants the H20 profile derives for the config (sim/profile.py, as `pivotrl simulate`
does for a GPU config) and returns the few figures the reproduction plots, plus, with
`fractions`, Figure 3's low-throughput fraction of each role from the run's own trace.
Runs are independent and picklable, so `run_all` spreads them over a process pool.
"""
from __future__ import annotations

import logging
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

KEPT = ("tokens_per_s", "steady_tokens_per_s", "seconds", "shifts", "steps",
        "idle_fraction")


@dataclass(frozen=True)
class Run:
    config: str                   # path of a paper config
    paradigm: str
    seed: int = 0
    overrides: tuple[str, ...] = ()
    fractions: bool = False       # also Figure 3's fractions (writes a trace)
    tag: str = ""                 # what the caller groups it by

    def all_overrides(self) -> list[str]:
        return [*self.overrides, f"paradigm.name={self.paradigm}", f"rl.seed={self.seed}"]


@dataclass
class Outcome:
    run: Run
    figures: dict = field(default_factory=dict)


def run_one(run: Run) -> Outcome:
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.config.validate import check_kv_capacity
    from pivotrl_hpc.sim.profile import H20
    from pivotrl_hpc.sim.run import SimConstants, simulate
    from pivotrl_hpc.sim.standin import stand_in

    with tempfile.TemporaryDirectory(prefix="pivotrl-reproduce-") as scratch:
        cfg, _ = stand_in(load_config(run.config, run.all_overrides(), check_files=False),
                          Path(scratch))
        check_kv_capacity(cfg)
        trace = Path(scratch) / "run.h5" if run.fractions else None
        summary = simulate(cfg, SimConstants.from_profile(cfg, H20), trace)
        figures = {k: summary.get(k) for k in KEPT}
        if trace is not None:
            figures["low_fraction"] = low_fractions(trace)
    return Outcome(run, figures)


def low_fractions(trace: Path) -> dict[str, float | None]:
    from pivotrl_hpc.report.timeline import low_fractions as fractions
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(trace)) as t:
        return fractions(t.table("timeseries"), t.table("steps"))


def run_all(runs: Iterable[Run], jobs: int = 1,
            progress: Callable[[Outcome, int, int], None] | None = None) -> list[Outcome]:
    """Every run, in the order given; `jobs` > 1 runs them on that many processes."""
    runs = list(runs)
    out: list[Outcome] = []
    if jobs <= 1:
        for r in runs:
            out.append(run_one(r))
            if progress:
                progress(out[-1], len(out), len(runs))
        return out
    with ProcessPoolExecutor(jobs) as pool:
        for o in pool.map(run_one, runs):
            out.append(o)
            if progress:
                progress(o, len(out), len(runs))
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0
