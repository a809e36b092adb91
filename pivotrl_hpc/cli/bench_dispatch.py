"""`pivotrl bench dispatch --replicas R --sequences S [--json]`: one Dispatch(Q, R) call.

S queued sequences (prompt 100-2000 tokens, deterministic from --seed) are dispatched onto
R empty rollout replicas with the synthetic rollout model; the median wall time over
--repeats fresh runs is reported, and its process CPU time (not inflated by other load).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pivotrl_hpc.plan.synthetic import ROLLOUT_KV, ROLLOUT_MODEL
from pivotrl_hpc.sched import Replica, Scheduler, Sequence


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=128)
    p.add_argument("--sequences", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def measure(replicas: int, sequences: int, repeats: int = 5, seed: int = 0) -> dict:
    rng = random.Random(seed)
    seqs = [Sequence(i, rng.randint(100, 2000)) for i in range(sequences)]
    times, cpu, placed = [], [], 0
    for _ in range(max(1, repeats)):
        sched = Scheduler(ROLLOUT_MODEL, [Replica(f"r{i}", ROLLOUT_KV) for i in range(replicas)])
        sched.queue.extend(seqs)
        t0, c0 = time.perf_counter(), time.process_time()
        placed = len(sched.dispatch())
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return {"replicas": replicas, "sequences": sequences,
            "dispatch_ms": round(statistics.median(times), 3),
            "dispatch_cpu_ms": round(statistics.median(cpu), 3), "placed": placed}


def main(args: argparse.Namespace) -> int:
    result = measure(args.replicas, args.sequences, args.repeats, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"dispatch {result['sequences']} sequences over {result['replicas']} replicas: "
              f"{result['dispatch_ms']:.1f} ms ({result['placed']} placed)")
    return 0
