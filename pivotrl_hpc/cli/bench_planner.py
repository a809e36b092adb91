"""`pivotrl bench planner --gpus N [--json]`: planner latency on a synthetic snapshot
(reproduce/planner_time.py measures it: medians over --repeats runs of the construction,
the simulation, the whole decision and its CPU time).

`--workers N` (default min(4, CPUs)) evaluates candidates on a process pool of N workers,
created once outside the timed region with the snapshot installed in each worker, as a
long-lived planner process would hold it; 1 is sequential. Below the planner's size
threshold (plan.parallel.PARALLEL_MIN_WORK) the decision stays sequential anyway.
"""
from __future__ import annotations

import argparse
import json

from pivotrl_hpc.plan import parallel
from pivotrl_hpc.reproduce.planner_time import default_workers, measure


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=128, help="cluster size (multiple of 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
    p.add_argument("--seed", type=int, default=0, help="snapshot seed")
    p.add_argument("--training", choices=("active", "idle", "down"), default="active",
                   help="training state: active keeps its GPUs out of the candidate set")
    p.add_argument("--rollout-seqs", type=int, default=16,
                   help="mean running sequences per rollout replica")
    p.add_argument("--reward-seqs", type=int, default=64,
                   help="mean running sequences per reward replica (plus 16 queued each)")
    p.add_argument("--workers", type=int, default=default_workers(),
                   help="processes evaluating candidates (default min(4, CPUs); 1: none)")
    p.add_argument("--parallel-min-work", type=int, default=parallel.PARALLEL_MIN_WORK,
                   help="K x N^Seq below which the planner stays sequential (0: never)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    result = measure(args.gpus, args.repeats, args.seed, args.training, args.rollout_seqs,
                     args.reward_seqs, args.workers, args.parallel_min_work)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"planner @ {result['gpus']} GPUs ({result['replicas']} replicas, "
              f"{result['sequences']} sequences, {result['candidates']} candidates): "
              f"{result['planner_ms']:.1f} ms (construction {result['construction_ms']:.1f}, "
              f"simulation {result['simulation_ms']:.1f}; {result['workers']} worker(s))")
    return 0
