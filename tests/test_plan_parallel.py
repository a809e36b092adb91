"""Step 4 in parallel (plan.parallel) gives bitwise the sequential decision."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from pivotrl_hpc.cli.main import main
from pivotrl_hpc.plan import (PivotPlanner, PlannerParams, VanillaPlanner, WorkloadSnapshot,
                              parallel, synthetic_snapshot)

FIG8 = Path(__file__).resolve().parents[1] / "examples" / "figure8_snapshot.json"


def _fig8() -> tuple[WorkloadSnapshot, PlannerParams]:
    data = json.loads(FIG8.read_text())
    return WorkloadSnapshot.from_dict(data), PlannerParams(**data["meta"]["planner"])


SNAPSHOTS = {
    "fig8": _fig8,
    "synthetic-128": lambda: (synthetic_snapshot(128, seed=1), PlannerParams()),
    "synthetic-256": lambda: (synthetic_snapshot(256, seed=2), PlannerParams()),
    "synthetic-64-idle": lambda: (synthetic_snapshot(64, seed=3, training="idle"),
                                  PlannerParams()),
    "synthetic-64-down": lambda: (synthetic_snapshot(64, seed=4, training="down"),
                                  PlannerParams()),
}


@pytest.fixture(scope="module")
def pool():
    """A pool with no snapshot installed: the planner ships its simulator per decision."""
    with ProcessPoolExecutor(2) as ex:
        yield ex


def _assert_same(seq, par) -> None:
    assert par.candidates == seq.candidates          # same candidates, floats, order
    assert par.current == seq.current and par.plan == seq.plan
    assert par.to_dict() == seq.to_dict()


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_parallel_matches_sequential_shipped(name, pool):
    snap, params = SNAPSHOTS[name]()
    seq = PivotPlanner(params).explain(snap)
    par = PivotPlanner(params, executor=pool, chunks=2, min_parallel_work=0)
    assert par.use_parallel(snap, len(seq.candidates)) == (len(seq.candidates) > 1)
    _assert_same(seq, par.explain(snap))


@pytest.mark.parametrize("name", ["fig8", "synthetic-256"])
def test_parallel_matches_sequential_shared(name):
    """Snapshot installed once per pool by its initializer; tasks carry only its key."""
    snap, params = SNAPSHOTS[name]()
    seq = PivotPlanner(params).explain(snap)
    with ProcessPoolExecutor(2, **parallel.share(snap)) as ex:
        for chunks in (2, 3):
            _assert_same(seq, PivotPlanner(params, executor=ex, chunks=chunks,
                                           min_parallel_work=0).explain(snap))
    parallel.forget(snap)


def test_vanilla_and_reference_replay_in_parallel(pool):
    snap, params = _fig8()
    seq = VanillaPlanner(params).explain(snap)
    _assert_same(seq, VanillaPlanner(params, executor=pool, chunks=2,
                                     min_parallel_work=0).explain(snap))
    ref, fast = PivotPlanner(params), PivotPlanner(params, executor=pool, min_parallel_work=0)
    ref.replay = fast.replay = True
    _assert_same(ref.explain(snap), fast.explain(snap))


def test_plain_map_callable_runs_chunks_in_process():
    snap, params = _fig8()
    par = PivotPlanner(params, executor=map, chunks=3, min_parallel_work=0)
    _assert_same(PivotPlanner(params).explain(snap), par.explain(snap))


def test_small_decisions_stay_sequential():
    def refuse(fn, items):
        raise AssertionError("below the threshold the executor must not be used")

    snap, params = _fig8()
    planner = PivotPlanner(params, executor=refuse)
    assert not planner.use_parallel(snap, 4)                     # 4 x 444 < threshold
    assert planner.explain(snap).plan is not None
    big = synthetic_snapshot(128)
    assert planner.use_parallel(big, 8)
    assert not PivotPlanner(executor=refuse, chunks=1).use_parallel(big, 8)
    assert not planner.use_parallel(big, 1)


def test_chunks_are_striped_and_cover_every_candidate():
    assert parallel.chunked(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert parallel.chunked(2, 4) == [[0], [1]]


def test_worker_without_the_snapshot_says_how_to_fix_it():
    with pytest.raises(LookupError, match="share"):
        parallel._evaluate_chunk(("shared-missing", None, (True, False, False), "reward", []))


def test_cli_workers(capsys):
    assert main(["bench", "planner", "--gpus", "128", "--repeats", "1", "--workers", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == 2 and out["parallel"] is True and out["planner_ms"] > 0
    assert main(["plan", str(FIG8), "--json"]) == 0
    one = capsys.readouterr().out
    assert main(["plan", str(FIG8), "--json", "--workers", "2"]) == 0
    assert capsys.readouterr().out == one


def test_plan_stays_pure_no_multiprocessing_on_import():
    """The caller owns the pool: importing plan loads neither multiprocessing nor
    concurrent.futures."""
    code = ("import sys, pivotrl_hpc.plan, pivotrl_hpc.sched\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('multiprocessing', 'concurrent')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
