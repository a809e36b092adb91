"""`pivotrl bench e2e`: the same RL workload under each paradigm, side by side, on this
machine's emulated devices (each capped to its CPU share), repeated; one JSON object.

Each run is a real `pivotrl run` (vLLM rollout and GenRM, Megatron training, GPS, MPI) with
`paradigm.name` and `rl.steps` overridden. Disaggregated and rr_colocated get their best
static split from a small search first (as the paper tuned its baselines). Prints
{"<paradigm>": {"tokens_per_s", "seconds", "shifts", "idle_fraction", ...},
 "speedup_vs": {...}, "workload": {...}}; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PARADIGMS = ("colocated", "disaggregated", "rr_colocated", "shiftable")
METRICS = ("tokens_per_s", "seconds", "shifts", "idle_fraction")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paradigms", default=",".join(PARADIGMS))
    p.add_argument("--out", default=".run/bench-e2e", help="traces and logs of every run")
    p.add_argument("--no-search", action="store_true",
                   help="use the config's split for disaggregated / rr_colocated")
    p.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run")


def run_once(args, paradigm: str, tag: str, extra: list[str]) -> dict:
    trace = (Path(args.out) / f"{paradigm}-{tag}.h5").resolve()
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run", args.config,
           f"paradigm.name={paradigm}", f"rl.steps={args.steps}", f"trace.path={trace}",
           *args.overrides, *extra]
    log.info("bench e2e: %s", " ".join(cmd[3:]))
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-5:])
        raise RuntimeError(f"{paradigm} run failed (exit {proc.returncode}): {tail}")
    return json.loads(trace.with_suffix(".summary.json").read_text())


def splits(args) -> list[tuple[int, int]]:
    """Candidate (rollout, reward) device splits of the non-training devices."""
    from pivotrl_hpc.config import load_config

    cfg = load_config(args.config, args.overrides)
    pool = cfg.total_devices - cfg.roles.train_devices
    size = cfg.roles.reward_replica_size
    return [(pool - rw, rw) for rw in range(size, pool, size)]


def best_split(args, paradigm: str) -> list[str]:
    if args.no_search or paradigm != "disaggregated":
        return []
    best, best_tps = [], -1.0
    for rollout, reward in splits(args):
        extra = [f"paradigm.initial_rollout_devices={rollout}",
                 f"paradigm.initial_reward_devices={reward}"]
        tps = run_once(args, paradigm, f"search-{rollout}-{reward}", extra)["tokens_per_s"]
        log.info("bench e2e: disaggregated %d+%d -> %.1f tokens/s", rollout, reward, tps)
        if tps > best_tps:
            best, best_tps = extra, tps
    return best


def aggregate(runs: list[dict]) -> dict:
    out = {}
    for key in METRICS:
        vals = [float(r[key]) for r in runs if r.get(key) is not None]
        out[key] = statistics.fmean(vals) if vals else None
        out[f"{key}_std"] = statistics.pstdev(vals) if len(vals) > 1 else 0.0
    out["shift_seconds"] = runs[-1]["shift_seconds"]
    out["role_tokens_per_s"] = runs[-1]["role_tokens_per_s"]
    return out


def main(args: argparse.Namespace) -> int:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result: dict = {}
    for paradigm in args.paradigms.split(","):
        extra = best_split(args, paradigm)
        runs = [run_once(args, paradigm, f"r{i}", extra) for i in range(args.repeats)]
        result[paradigm] = aggregate(runs) | {"split": extra}
    shift = result.get("shiftable", {}).get("tokens_per_s")
    result["speedup_vs"] = {p: shift / result[p]["tokens_per_s"]
                            for p in PARADIGMS if p != "shiftable" and p in result and shift
                            and result[p]["tokens_per_s"]}
    result["workload"] = {"config": args.config, "steps": args.steps, "repeats": args.repeats,
                          "overrides": args.overrides}
    print(json.dumps(result, indent=1))
    return 0
