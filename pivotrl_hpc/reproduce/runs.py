"""Simulated runs of the paper configs for `pivotrl reproduce`, one process each.

A `Run` names a config, a paradigm, a seed and overrides; `run_one` simulates it with the
constants the H20 profile derives for the config (sim/profile.py, as `pivotrl simulate`
does for a GPU config) and returns the few figures the reproduction plots, plus, with
`fractions`, Figure 3's low-throughput fraction of each role from the run's own trace.
Runs are independent and picklable, so `run_all` spreads them over a process pool.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

KEPT = ("tokens_per_s", "steady_tokens_per_s", "seconds", "shifts", "steps",
        "idle_fraction", "trained_tokens", "role_tokens_per_s", "staleness_held_s",
        "train_step_s", "shifts_by_kind", "max_lag", "step_marks")
HARDWARE = ("calibrated", "datasheet")


@dataclass(frozen=True)
class Run:
    config: str                   # path of a paper config
    paradigm: str
    seed: int = 0
    overrides: tuple[str, ...] = ()
    fractions: bool = False       # also Figure 3's fractions (writes a trace)
    tag: str = ""                 # what the caller groups it by
    # calibrated: the config's include (configs/calibration/) over the H20 datasheet's
    # derivation; datasheet: the include's assumptions (ASSUMPTIONS), the derivation alone
    hardware: str = "calibrated"
    keep_trace: str = ""          # a folder to keep a `fractions` run's trace in, for
    #                               `pivotrl report` (<tag>-<paradigm>-<seed>.h5)
    # the planner's throughput model: "" fitted online from the config's constants; fixed
    # (never refitted) at "exact": the simulated hardware's own constants (a perfect
    # offline profile), or "datasheet": the H20 derivation without the calibration
    planner_profile: str = ""

    def all_overrides(self) -> list[str]:
        return [*self.overrides, f"paradigm.name={self.paradigm}", f"rl.seed={self.seed}"]


@dataclass
class Outcome:
    run: Run
    figures: dict = field(default_factory=dict)


CACHE_VERSION = 6   # bump when what a run's figures mean changes (2: KV preemption, 55ef0ff;
#                     3: issue 49, KV from the device, MoE experts touched, training comm;
#                     4: issue 49, rr_colocated per batch, GPS Write, Reload and planning;
#                     5: issue 50, processed tokens over the steady window, step_marks;
#                     6: a sequence prefilled when it first runs, not when it is added)


def run_one(run: Run, cache: str | None = None) -> Outcome:
    """Simulate `run`; with `cache` (a folder), a run whose resolved config and constants
    were simulated before is read back (the simulator is deterministic): the calibration's
    last run set is then fig9's seed-0 baselines."""
    from pivotrl_hpc.launch.preflight import check_kv_capacity
    from pivotrl_hpc.controller.flow import ControllerError
    from pivotrl_hpc.sim.profile import H20, calibrated
    from pivotrl_hpc.sim.run import SimConstants, simulate
    from pivotrl_hpc.sim.standin import stand_in

    with tempfile.TemporaryDirectory(prefix="pivotrl-reproduce-") as scratch:
        cfg, _ = stand_in(load_run(run), Path(scratch))
        check_kv_capacity(cfg)
        datasheet = SimConstants.from_profile(cfg, H20)
        constants = calibrated(datasheet, cfg.calibration)
        entry = _entry(cache, cfg, constants, run.fractions, run.planner_profile)
        if entry is not None and entry.is_file():
            return Outcome(run, json.loads(entry.read_text()))
        if run.planner_profile:
            cfg.paradigm.throughput_profile = str(planner_profile(
                run.planner_profile, constants, datasheet, Path(scratch)))
        trace = Path(scratch) / "run.h5" if run.fractions else None
        try:
            summary = simulate(cfg, constants, trace)
        except ControllerError as e:   # the job failed: the figures say so, others go on
            log.error("%s %s seed %d failed: %s", run.tag, run.paradigm, run.seed, e)
            return Outcome(run, {"error": f"{type(e).__name__}: {e}"})
        figures = {k: summary.get(k) for k in KEPT}
        figures["processed_tokens_per_s"] = processed(summary)
        # the whole run's (start-up, fill and drain included), beside the protocol's
        figures["whole_run_tokens_per_s"] = sum((summary.get("role_tokens_per_s")
                                                 or {}).values())
        figures["code"] = code()
        if trace is not None:
            figures["low_fraction"] = low_fractions(trace)
            figures["allocation"] = allocation(trace)
            if run.keep_trace:
                Path(run.keep_trace).mkdir(mode=0o700, parents=True, exist_ok=True)
                shutil.copy(trace, Path(run.keep_trace) / f"{run.tag}-{run.paradigm}-"
                                                          f"{run.seed}.h5")
    if entry is not None:
        entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        entry.write_text(json.dumps(figures))
    return Outcome(run, figures)


def code() -> str:
    """A hash of the simulator's sources (the packages a simulated run executes), kept with
    each run's figures: the JSON says which sources made each number (a cached run keeps
    the hash of the sources that ran it)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in SIMULATED:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


SIMULATED = ("sim", "controller", "sched", "plan", "task", "trace")


def load_run(run: Run):
    """The run's config: with its calibration include (`hardware` calibrated) or with its
    assumptions only (datasheet: the H20 derivation alone), the run's overrides on top."""
    from pivotrl_hpc.config import load_config

    if run.hardware not in HARDWARE:
        raise ValueError(f"hardware {run.hardware!r} is not one of {', '.join(HARDWARE)}")
    return load_config(run.config, run.all_overrides(), check_files=False,
                       includes=True if run.hardware == "calibrated" else ASSUMPTIONS)


# What `datasheet` keeps of a calibration file: its assumptions (prompts a step, the length
# distributions, the engines' caps; the record's "assumptions"), not its fit
# (calibration.*) nor Figure 12's shift seconds, so that the two hardware settings run
# the same workload.
ASSUMPTIONS = ("rl", "workload", "roles")


PLANNER_PROFILES = ("exact", "datasheet")


def planner_profile(kind: str, exact, datasheet, folder: Path) -> Path:
    """A `paradigm.throughput_profile` file of the hardware's own constants or the
    uncalibrated datasheet's, for a planner that never refits."""
    import yaml

    if kind not in PLANNER_PROFILES:
        raise ValueError(f"planner profile {kind!r} is not one of {', '.join(PLANNER_PROFILES)}")
    source = exact if kind == "exact" else datasheet
    path = folder / f"planner-{kind}.yaml"
    path.write_text(yaml.safe_dump({m: vars(t) for m, t in source.throughput.items()}))
    return path


def _entry(cache: str | None, cfg, constants, fractions: bool,
           planner: str = "") -> Path | None:
    """The cache file of a run: a hash of everything the simulation reads (the resolved
    config but for the stood-in model folders and the trace path, the constants). Not the
    sources: the simulator's speed-ups keep its results (tests/test_sim_speed.py); each
    entry records its sources' hash (`code`)."""
    if cache is None:
        return None
    from pivotrl_hpc.config.load import to_dict

    d = to_dict(cfg)
    d.pop("trace", None)
    for m in d["models"].values():
        m.pop("path", None)
    d["data"].pop("train", None)
    d["data"].pop("validation", None)
    for lever in ("tail_isolation", "partial_rollout"):   # off (the paper): keys as before
        if not d["paradigm"].get(lever):
            d["paradigm"].pop(lever, None)
    parts = {"v": CACHE_VERSION, "config": d, "constants": constants.to_dict(),
             "fractions": fractions}
    if planner:
        parts["planner_profile"] = planner
    key = json.dumps(parts, sort_keys=True, default=str)
    return Path(cache) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def processed(summary: dict) -> float:
    """Figure 9's "total tokens processed" a second as this project counts it: the tokens
    the rollout and the reward generate (responses and judgements) over the steady window
    of the run (sim/measure.py: the same protocol for every paradigm and for `pivotrl
    simulate`); docs/calibration.md has why these tokens, and the window's traces."""
    from pivotrl_hpc.sim.measure import processed_tokens_per_s

    return processed_tokens_per_s(summary)


def low_fractions(trace: Path) -> dict[str, float | None]:
    from pivotrl_hpc.report.timeline import low_fractions as fractions
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(trace)) as t:
        return fractions(t.table("timeseries"), t.table("steps"))


def allocation(trace: Path) -> list[list[float]]:
    """Figure 10's allocation: [t, rollout, reward, training devices] at each change of the
    trace's timeseries rows (one row a role per log interval)."""
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(trace)) as t:
        ts = t.table("timeseries")
    now: dict[str, int] = {}
    out: list[list[float]] = []
    for t_, role, dev in zip(ts["t"], ts["role"], ts["devices"]):
        role = role.decode() if isinstance(role, bytes) else str(role)
        now[role] = int(dev)
        row = [round(float(t_), 1), now.get("rollout", 0), now.get("reward", 0),
               now.get("training", 0)]
        if out and out[-1][0] == row[0]:
            out[-1] = row
        elif not out or out[-1][1:] != row[1:]:
            out.append(row)
    return out


def run_all(runs: Iterable[Run], jobs: int = 1,
            progress: Callable[[Outcome, int, int], None] | None = None,
            cache: str | None = None) -> list[Outcome]:
    """Every run, in the order given; `jobs` > 1 runs them on that many processes."""
    runs = list(runs)
    out: list[Outcome] = []
    if jobs <= 1:
        for r in runs:
            out.append(run_one(r, cache))
            if progress:
                progress(out[-1], len(out), len(runs))
        return out
    with ProcessPoolExecutor(jobs) as pool:
        for o in pool.map(run_one, runs, [cache] * len(runs)):
            out.append(o)
            if progress:
                progress(o, len(out), len(runs))
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0
