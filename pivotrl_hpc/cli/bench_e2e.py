"""`pivotrl bench e2e`: the same RL workload under each paradigm, side by side, on this
machine's emulated devices (each capped to its CPU share), repeated; one JSON object.

Each run is a real `pivotrl run` (vLLM rollout and GenRM, Megatron training, GPS, MPI) with
`paradigm.name` and `rl.steps` overridden. Every paradigm but colocated gets
its best training width (and disaggregated its rollout/reward split) from a small search
first, one run per candidate (as the paper tuned every paradigm's allocation). Prints
{"<paradigm>": {"tokens_per_s", "steady_tokens_per_s", "seconds", "shifts", "idle_fraction",
 "train_step_s" (each with its _std over the repeats), ..., "seconds_went": {...}, "traces"},
 "speedup_vs": {...}, "workload": {...}, "bench_seconds"}; progress on stderr.
Speed-ups compare `steady_tokens_per_s` (from the first generated token on, without the
job's start-up, docs/trace.md); `speedup_vs_incl_startup` compares `tokens_per_s`.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pivotrl_hpc.reproduce import search

log = logging.getLogger(__name__)

# the paper's four and rr_colocated_pooled, the stronger variant of rr_colocated, beside them
PARADIGMS = ("colocated", "disaggregated", "rr_colocated", "rr_colocated_pooled", "shiftable")
METRICS = ("tokens_per_s", "steady_tokens_per_s", "seconds", "shifts", "idle_fraction",
           "train_step_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--steps", type=int, default=0, help="RL steps a run (0: the config's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=0,
                   help="GRPO groups a step for every run (0: the config's). The regime "
                        "matters: at tiny-cpu's 4 a step is latency-bound, at 16 training-"
                        "bound (docs/design.md, 'Paradigms')")
    p.add_argument("--paradigms", default=",".join(PARADIGMS))
    p.add_argument("--out", default=".run/bench-e2e", help="traces and logs of every run")
    p.add_argument("--no-search", action="store_true",
                   help="use the config's training width (disaggregated: the middle "
                        "rollout/reward split of its pool)")
    p.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run")


def run_once(args, paradigm: str, tag: str, extra: list[str]) -> dict:
    trace = (Path(args.out) / f"{paradigm}-{tag}.h5").resolve()
    steps = [f"rl.steps={args.steps}"] if args.steps else []
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run", args.config,
           f"paradigm.name={paradigm}", *steps, f"trace.path={trace}",
           *args.overrides, *extra]
    log.info("bench e2e: %s", " ".join(cmd[3:]))
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-5:])
        raise RuntimeError(f"{paradigm} run failed (exit {proc.returncode}): {tail}")
    summary = json.loads(trace.with_suffix(".summary.json").read_text())
    return summary | {"train_step_s": train_step_seconds(trace), "trace": str(trace)}


def train_step_seconds(trace: Path) -> float | None:
    """Median seconds of the run's training steps (the trace's steps table): paradigms train
    the same batches at a searched width, so this tells a slower trainer from a slower
    pipeline."""
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(trace)) as t:
        seconds = t.table("steps")["seconds"]
    return float(statistics.median(seconds)) if len(seconds) else None


def candidates(args, paradigm: str, check_files: bool = True) -> list[list[str]]:
    """The baseline search's settings for `paradigm` (reproduce/search.py) under the config
    of `args`."""
    from pivotrl_hpc.config import load_config

    return search.candidates(load_config(args.config, args.overrides,
                                         check_files=check_files), paradigm)


def steady(summary: dict) -> float:
    return summary.get("steady_tokens_per_s") or summary["tokens_per_s"]


def unsearched(args, paradigm: str, options: list[list[str]],
               check_files: bool = True) -> list[str]:
    """Without a search: the config's training width; disaggregated takes the middle split
    of its pool (the config's initial_* are the other paradigms' bootstrap and need not
    fit it)."""
    if len(options) < 2:
        return options[0] if options else []
    if paradigm != "disaggregated":
        return []
    from pivotrl_hpc.config import load_config

    cfg = load_config(args.config, args.overrides, check_files=check_files)
    at_width = [o for o in options if o[0] == f"roles.train_devices={cfg.roles.train_devices}"]
    return at_width[len(at_width) // 2]


def best_split(args, paradigm: str) -> tuple[list[str], dict | None]:
    """The split to measure, and the search's run of it (it counts as the first repeat)."""
    options = candidates(args, paradigm)
    if args.no_search or len(options) < 2:
        return unsearched(args, paradigm, options), None
    best, best_run = [], None
    for extra in options:
        tag = "search-" + "-".join(x.rsplit("=", 1)[1] for x in extra)
        run = run_once(args, paradigm, tag, extra)
        log.info("bench e2e: %s %s -> %.1f tokens/s", paradigm, " ".join(extra), steady(run))
        if best_run is None or steady(run) > steady(best_run):
            best, best_run = extra, run
    return best, best_run


def aggregate(runs: list[dict]) -> dict:
    out = {}
    for key in METRICS:
        vals = [float(r[key]) for r in runs if r.get(key) is not None]
        out[key] = statistics.fmean(vals) if vals else None
        out[f"{key}_std"] = statistics.pstdev(vals) if len(vals) > 1 else 0.0
    out["shift_seconds"] = runs[-1]["shift_seconds"]
    out["role_tokens_per_s"] = runs[-1]["role_tokens_per_s"]
    out["seconds_went"] = seconds_went(runs[-1])
    out["traces"] = [r.get("trace") for r in runs]
    return out


def seconds_went(s: dict) -> dict:
    """Where one run's seconds went: shifting (device-seconds by kind), devices idle,
    admission held by staleness, the first step (start-up included)."""
    first = s["reward_per_step"][0]["t"] if s["reward_per_step"] else None
    return {"first_step_s": first, "idle_fraction": s.get("idle_fraction"),
            "staleness_held_s": s.get("staleness_held_s"),
            "shifting_s": {k: v["count"] * v["mean_s"] for k, v in s["shift_seconds"].items()}}


def speedups(result: dict, key: str) -> dict[str, float]:
    shift = result.get("shiftable", {}).get(key)
    return {p: shift / result[p][key] for p in PARADIGMS
            if p != "shiftable" and p in result and shift and result[p].get(key)}


def workload(args) -> dict:
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.config.load import to_dict

    cfg = to_dict(load_config(args.config, args.overrides))
    return {"config": args.config, "steps": args.steps or cfg["rl"]["steps"],
            "repeats": args.repeats,
            "overrides": args.overrides,
            **{k: cfg[k] for k in ("cluster", "roles", "rl", "workload")}}


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    Path(args.out).mkdir(mode=0o700, parents=True, exist_ok=True)
    if args.batch_size:
        args.overrides = [f"rl.batch_size={args.batch_size}", *args.overrides]
    result: dict = {}
    for paradigm in args.paradigms.split(","):
        extra, searched = best_split(args, paradigm)
        runs = [searched] if searched is not None else []
        runs += [run_once(args, paradigm, f"r{i}", extra)
                 for i in range(len(runs), args.repeats)]
        result[paradigm] = aggregate(runs) | {"split": extra}
        # each paradigm's figures as they come: a long bench cut short keeps what it measured
        (Path(args.out) / "bench-e2e.json").write_text(json.dumps(finish(args, result, started),
                                                                  indent=1))
    print(json.dumps(finish(args, result, started), indent=1))
    return 0


def finish(args, result: dict, started: float) -> dict:
    return {**result, "speedup_vs": speedups(result, "steady_tokens_per_s"),
            "speedup_vs_incl_startup": speedups(result, "tokens_per_s"),
            "workload": workload(args),
            "bench_seconds": time.monotonic() - started}   # searches and repeats, all runs
