"""Step 4 in parallel (§7.3: "the simulator runs independently for each role of each
candidate plan, allowing these simulations to execute in parallel with low overhead").

`PivotPlanner(executor=...)` splits its candidates into a few chunks and evaluates them with
the caller's executor: anything with `map(fn, items)` (a `concurrent.futures` Executor) or a
map-like callable (`map` itself runs the chunks in process). This module stays pure: it
never imports multiprocessing; the caller owns the pool.

Each simulation depends only on the snapshot and the candidate (the simulator's caches hold
pure functions of their keys), so a chunk replays on a fresh `MigrationSimulator` and gives
bitwise the sequential floats; the planner reassembles them in candidate order.

Shipping the state, the large part at 1024 GPUs:

* `share(snap)` registers the snapshot under a key and returns the `initializer`/`initargs`
  that install it in each worker once per pool (a fork-started pool created after `share`
  also inherits it). Tasks then carry only the key, and each chunk builds its simulator from
  the installed snapshot (~4 ms at 1024 GPUs).
* Otherwise (say a long-lived pool and a new snapshot per decision) the planner builds the
  simulator once and ships it pickled, the same bytes with each chunk: its plain-count
  roles pickle ~10x faster than the snapshot's dataclasses (~1 + 2 ms vs ~13 + 12 ms for
  pickling + unpickling at 1024 GPUs, 150 kB).

Below `PARALLEL_MIN_WORK` (K candidates x N^Seq sequences, the cost of step 4) the
planner stays sequential: shipping and process hand-offs then cost more than they save
(measured with 2 workers, see `pivotrl bench planner --workers`).
"""
from __future__ import annotations

import itertools
import pickle
from typing import Any, Callable, Iterable, Sequence

from pivotrl_hpc.plan.evaluate import Estimate, MigrationSimulator, role_models
from pivotrl_hpc.plan.snapshot import WorkloadSnapshot
from pivotrl_hpc.sched.migration import MigrationSpec

# K * N^Seq below which step 4 stays sequential. Measured with 2 workers on synthetic
# snapshots on an otherwise idle 2-core machine (medians of 31 decisions, ms, sequential vs
# parallel): 32 GPUs (K x N^Seq = 2 x 229) 0.46 vs 0.82; 48 GPUs (1.4k) 1.39 vs 1.68;
# 64 GPUs (2.4k) 2.13 vs 1.97, break-even; 96 GPUs (5.8k) 4.5 vs 3.1; 128 GPUs 7.4 vs 4.5.
PARALLEL_MIN_WORK = 4_000

Shift = tuple[int, tuple[str, ...]]  # (shift-up count, ids shifted down) of one candidate

_SNAPSHOTS: dict[str, WorkloadSnapshot] = {}  # key -> shared snapshot (parent and workers)
_SHARED: dict[int, tuple[WorkloadSnapshot, str]] = {}  # id(snap) -> (snap, key), parent
_keys = itertools.count()


def share(snap: WorkloadSnapshot) -> dict[str, Any]:
    """Make `snap` available to the workers of a pool created afterwards:
    `ProcessPoolExecutor(n, **share(snap))`. Tasks then refer to it by key only."""
    entry = _SHARED.get(id(snap))
    if entry is None or entry[0] is not snap:
        entry = _SHARED[id(snap)] = (snap, f"shared-{next(_keys)}")
        _SNAPSHOTS[entry[1]] = snap
    return {"initializer": install, "initargs": (entry[1], snap)}


def forget(snap: WorkloadSnapshot) -> None:
    """Drop a snapshot registered with `share` (the parent's reference to it)."""
    entry = _SHARED.pop(id(snap), None)
    if entry is not None:
        _SNAPSHOTS.pop(entry[1], None)


def install(key: str, snap: WorkloadSnapshot) -> None:
    """Pool initializer: runs once in each worker."""
    _SNAPSHOTS[key] = snap


def chunked(n: int, chunks: int) -> list[list[int]]:
    """Candidate indices striped over `chunks` lists: cost grows with k, striping balances."""
    return [list(range(j, n, chunks)) for j in range(min(chunks, n))]


# (migrate, binary_throughput, replay, prefill seconds per token as (role, s) pairs)
Config = tuple[MigrationSpec, bool, bool, tuple[tuple[str, float], ...]]


def simulator(snap: WorkloadSnapshot, config: Config) -> MigrationSimulator:
    migrate, binary, replay, prefill = config
    return MigrationSimulator(snap, role_models(snap, binary), migrate, replay, dict(prefill))


def estimate_all(executor: Any, snap: WorkloadSnapshot, config: Config,
                 role: str, shifts: Sequence[Shift], chunks: int
                 ) -> tuple[Estimate, list[Estimate]]:
    """Current estimate and one estimate per shift, in order, computed chunk-wise on
    `executor`."""
    entry = _SHARED.get(id(snap))
    if entry is not None and entry[0] is snap:
        key, blob = entry[1], None
    else:
        sim = simulator(snap, config)
        key, blob = "", pickle.dumps(sim, pickle.HIGHEST_PROTOCOL)
    tasks = [(key, blob, config, role, [(i, shifts[i]) for i in part])
             for part in chunked(len(shifts), chunks)]
    results = _map(executor, _evaluate_chunk, tasks)
    estimates: list[Estimate | None] = [None] * len(shifts)
    for _, done in results:
        for i, est in done:
            estimates[i] = est
    return results[0][0], estimates  # type: ignore[return-value]


def _map(executor: Any, fn: Callable, items: Iterable) -> list:
    mapper = getattr(executor, "map", None)
    return list(mapper(fn, items) if mapper is not None else executor(fn, items))


def _simulator(key: str, blob: bytes | None, config: Config) -> MigrationSimulator:
    """Worker side: a fresh simulator (no cached results) from the shipped or installed
    state."""
    if blob is not None:
        return pickle.loads(blob)  # noqa: S301 - from this process's own pool parent
    snap = _SNAPSHOTS.get(key)
    if snap is None:
        raise LookupError(f"snapshot {key} is not installed in this worker: create the pool "
                          "with **plan.parallel.share(snap)")
    return simulator(snap, config)


def _evaluate_chunk(task: tuple) -> tuple[Estimate, list[tuple[int, Estimate]]]:
    """Worker side: replay one chunk of candidates."""
    key, blob, config, role, items = task
    sim = _simulator(key, blob, config)
    return sim.current(), [(i, sim.estimate(role, up, down)) for i, (up, down) in items]
