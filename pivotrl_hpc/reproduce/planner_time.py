"""The planner's latency on a synthetic snapshot (paper Table 2; `pivotrl bench planner`).

The snapshot (`pivotrl_hpc.plan.synthetic`) follows the paper's proportions: policy TP1,
GenRM TP4, training half the cluster. Reported times are medians over `repeats` runs:
`construction_ms` is steps 1-3 (shift-up role, shift pairs, the DP), `simulation_ms` step 4
(migration simulation of every candidate), `planner_ms` the whole decision (wall clock) and
`planner_cpu_ms` its process CPU time, which other load on the machine does not inflate
(the parent's only: with workers > 1 the simulations' CPU time is in the workers).
"""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from pivotrl_hpc.plan import PivotPlanner, parallel, synthetic_snapshot


def default_workers() -> int:
    return min(4, os.cpu_count() or 1)


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
