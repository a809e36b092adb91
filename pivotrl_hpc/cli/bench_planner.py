"""`pivotrl bench planner --gpus N [--json]`: planner latency on a synthetic snapshot.

The snapshot (`pivotrl_hpc.plan.synthetic`) follows the paper's proportions: policy TP1,
GenRM TP4, training half the cluster. Reported times are medians over --repeats runs:
`construction_ms` is steps 1-3 (shift-up role, shift pairs, the DP), `simulation_ms` step 4
(migration simulation of every candidate), `planner_ms` the whole decision (wall clock) and
`planner_cpu_ms` its process CPU time, which other load on the machine does not inflate
(the parent's only: with --workers > 1 the simulations' CPU time is in the workers).

`--workers N` (default min(4, CPUs)) evaluates candidates on a process pool of N workers,
created once outside the timed region with the snapshot installed in each worker, as a
long-lived planner process would hold it; 1 is sequential. Below the planner's size
threshold (plan.parallel.PARALLEL_MIN_WORK) the decision stays sequential anyway.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from pivotrl_hpc.plan import PivotPlanner, parallel, synthetic_snapshot


def default_workers() -> int:
    return min(4, os.cpu_count() or 1)


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


def measure(gpus: int, repeats: int = 5, seed: int = 0, training: str = "active",
            rollout_seqs: int = 16, reward_seqs: int = 64, workers: int = 1,
            min_work: int = parallel.PARALLEL_MIN_WORK) -> dict:
    snap = synthetic_snapshot(gpus, seed=seed, training=training,
                              seqs_per_rollout=rollout_seqs, seqs_per_reward=reward_seqs)
    if workers <= 1:
        return _measure(snap, PivotPlanner(), repeats) | {"workers": 1, "parallel": False}
    # The pool outlives the timed decisions, as in a long-lived planner process.
    with ProcessPoolExecutor(workers, **parallel.share(snap)) as pool:
        planner = PivotPlanner(executor=pool, chunks=workers, min_parallel_work=min_work)
        planner.explain(snap)  # warm-up: start the workers
        result = _measure(snap, planner, repeats)
    parallel.forget(snap)
    return result | {"workers": workers, "parallel": planner.use_parallel(
        snap, result["candidates"])}


def _measure(snap, planner: PivotPlanner, repeats: int) -> dict:
    total, cpu, construct, simulate = [], [], [], []
    report = None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        choice, pairs = planner.prepare(snap)
        candidates = planner.construct(pairs)
        t1 = time.perf_counter()
        planner.evaluate(snap, choice.role, pairs, candidates)
        t2 = time.perf_counter()
        c2 = time.process_time()
        report = planner.explain(snap)
        t3 = time.perf_counter()
        cpu.append((time.process_time() - c2) * 1e3)
        construct.append((t1 - t0) * 1e3)
        simulate.append((t2 - t1) * 1e3)
        total.append((t3 - t2) * 1e3)
    assert report is not None
    return {"gpus": snap.gpus, "replicas": len(snap.replicas),
            "sequences": sum(len(r.sequences) for r in snap.replicas)
            + sum(len(p.queue) for p in snap.roles.values()),
            "planner_ms": round(statistics.median(total), 3),
            "construction_ms": round(statistics.median(construct), 3),
            "simulation_ms": round(statistics.median(simulate), 3),
            "planner_cpu_ms": round(statistics.median(cpu), 3),  # robust to busy machines
            "candidates": len(report.candidates), "shift_up_role": report.choice.role,
            "chosen_k": None if report.plan is None else len(report.plan.shift_up)}


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
