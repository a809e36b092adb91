"""`pivotrl simulate`: the live controller on modeled devices in virtual time (sim/run.py).
Same seed, same trace; no sequence on two replicas at once; generated tokens conserved across
aborts and migrations; the planner's horizon H moves the shift count the way §8.6 says."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from live_util import assert_trace_ok, check_nothing_lost, model_overrides

from pivotrl_hpc.cli.bench_e2e import PARADIGMS
from pivotrl_hpc.config import load_config
from pivotrl_hpc.sim.run import SimConstants, simulate
from pivotrl_hpc.trace import open_trace

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"


def _cfg(tiny_models, *overrides: str):
    return load_config(CONFIG, [*model_overrides(tiny_models), *overrides])


def _tables(path: Path) -> dict:
    with open_trace(str(path)) as t:
        return {n: t.table(n) for n in ("shifts", "sequences", "steps", "timeseries")}


@pytest.fixture(scope="module")
def shiftable(tiny_models, tmp_path_factory):
    cfg = _cfg(tiny_models, "rl.steps=4")
    path = tmp_path_factory.mktemp("sim") / "shiftable.h5"
    summary = simulate(cfg, SimConstants.from_config(cfg), path)
    return cfg, path, summary


def test_same_seed_same_trace(tiny_models, shiftable, tmp_path):
    cfg, path, summary = shiftable
    again = simulate(cfg, SimConstants.from_config(cfg), tmp_path / "again.h5")
    assert again == summary
    a, b = _tables(path), _tables(tmp_path / "again.h5")
    for name in a:
        for col in a[name]:
            np.testing.assert_equal(a[name][col], b[name][col], err_msg=f"{name}.{col}")
    other = simulate(_cfg(tiny_models, "rl.steps=4", "rl.seed=1"), SimConstants.from_config(cfg))
    assert other["seconds"] != summary["seconds"]     # the seed does drive the workload


def test_a_sequence_is_on_two_replicas_only_until_the_source_step_ends(tiny_models):
    """Checked on the modeled devices at every advance of virtual time. A migrated sequence
    is added to its destination at once, while its Abort on the source waits for the Step
    running there (a worker does one command at a time): for up to one Step both hold it,
    and the source's tokens of that Step are ignored (flow.py epochs; docs/design.md, "Controller").
    Every such overlap must end, none outliving one Step."""
    cfg = _cfg(tiny_models, "rl.steps=4")
    overlap: dict[tuple[str, str], float] = {}
    longest = {"s": 0.0, "n": 0}
    checks = {"n": 0}

    def watch(workers) -> None:
        now = workers[0].clock.now()
        owners: dict[tuple[str, str], set[int]] = {}
        for w in workers:
            size = cfg.roles.reward_replica_size if w.role.value == "reward" else 1
            for sid in w.seqs:
                owners.setdefault((w.role.value, sid), set()).add(w.device // size)
        for key, reps in owners.items():
            if len(reps) > 1:
                overlap.setdefault(key, now)
        for key in [k for k in overlap if len(owners.get(k, ())) < 2]:
            longest["s"] = max(longest["s"], now - overlap.pop(key))
            longest["n"] += 1
        checks["n"] += 1

    summary = simulate(cfg, SimConstants.from_config(cfg), None, watch)
    assert summary["steps"] == 4 and summary["shifts"] > 0 and summary["max_lag"] <= 2
    assert checks["n"] > 50 and not overlap, overlap       # every overlap ended
    step_s = max(cfg.paradigm.planner_interval_s, 1.0)     # a Step is at most ~1 s here
    assert longest["s"] <= step_s, longest


def test_the_record_places_a_sequence_on_one_replica_at_a_time(shiftable):
    *_, path = shiftable[:2]
    seq = _tables(path)["sequences"]
    where: dict[tuple[str, str], str | None] = {}
    for ev, role, sid, rep in zip(seq["event"], seq["role"], seq["seq_id"], seq["replica"]):
        key = (role, sid)
        if ev == "dispatch":         # from the queue
            assert where.get(key) is None, (key, rep, where.get(key))
            where[key] = rep
        elif ev == "migrate":        # from another replica (its `abort` follows there)
            assert where.get(key) not in (None, rep), (key, rep, where.get(key))
            where[key] = rep
        elif ev in ("preempt", "finish"):
            assert where.get(key) == rep, (key, ev, rep, where.get(key))
            where[key] = None
    assert where and not any(where.values())
    assert_trace_ok(path)        # and the Abort window, from the rows (docs/trace.md)


def test_every_sequence_finishes_once_and_every_step_is_full(shiftable):
    cfg, path, _ = shiftable
    check_nothing_lost(path, 4, cfg.rl.batch_size * cfg.rl.group_size, 2)


def test_generated_tokens_are_conserved(shiftable):
    """The rollout role's processed tokens are exactly the generated lengths of its
    finished sequences (aborted work is resumed, never redone)."""
    _, path, summary = shiftable
    t = _tables(path)
    seq, ts = t["sequences"], t["timeseries"]
    finished = sum(int(k) for ev, role, k in zip(seq["event"], seq["role"], seq["tokens"])
                   if ev == "finish" and role == "rollout")
    rollout = ts["role"] == "rollout"
    assert summary["in_flight_at_end"] == 0
    assert int(ts["tokens_total"][rollout][-1]) == finished


# Rollout and judging overlap (staleness 4, longer responses, 1 s shifts), so that a shift
# can take devices from a replica that is busy: a candidate with a penalty phi > 0. Shifts
# of idle devices (phi = 0) and training's forced shift up happen at any H (docs/history.md).
OVERLAP = ("rl.steps=6", "rl.batch_size=8", "rl.staleness=4", "workload.rollout_median=40",
           "workload.genrm_median=30", "models.policy.max_response_len=128",
           "models.genrm.max_response_len=64", "paradigm.shift_seconds_rollout=1",
           "paradigm.shift_seconds_reward=1")


def _paid_shifts(tiny_models, tmp_path, horizon: float) -> int:
    """Executed plans that shift a busy replica down (penalty > 0), training's aside."""
    cfg = _cfg(tiny_models, *OVERLAP, f"paradigm.horizon_s={horizon}")
    path = tmp_path / f"h{horizon}.h5"
    simulate(cfg, SimConstants.from_config(cfg), path)
    with open_trace(str(path)) as t:
        p = t.table("planner")
    return sum(1 for ran, i, cands, why in zip(p["executed"], p["chosen"], p["candidates"],
                                               p["reason"])
               if ran and i >= 0 and cands[i]["penalty"] > 0 and "training" not in why)


def test_a_tiny_horizon_shifts_busy_replicas_never_and_a_huge_one_does(tiny_models, tmp_path):
    """§8.6, Figure 14: B = H·ΔT − phi; with H = 0.01 s no gain outweighs a penalty."""
    assert _paid_shifts(tiny_models, tmp_path, 0.01) == 0
    assert _paid_shifts(tiny_models, tmp_path, 600) >= 1


def test_pivotrl_simulate_prints_every_paradigm_and_the_speedups(tiny_models, tmp_path):
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "simulate", str(CONFIG),
                        "--out", str(tmp_path), *model_overrides(tiny_models)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    traces = {n: tmp_path / f"{n}-{'-'.join(v.rsplit('=', 1)[1] for v in out[n]['split'])}.h5"
              for n in PARADIGMS if n != "colocated"} | {"colocated": tmp_path / "colocated-run.h5"}
    for name in PARADIGMS:
        assert out[name]["tokens_per_s"] > 0 and out[name]["seconds"] > 0, name
        assert traces[name].exists(), name
    assert_trace_ok(*sorted(tmp_path.glob("*.h5")))   # every paradigm, every split searched
    assert out["shiftable"]["split"][0].startswith("roles.train_devices=")   # searched
    assert set(out["speedup_vs"]) == {"colocated", "disaggregated", "rr_colocated",
                                      "rr_colocated_pooled"}
    # Figure 9's protocol: generated tokens; 3 steps are too few for the steady window
    # (sim/measure.py), so they are counted from the start to the last step's end
    assert out["speedup_vs"]["colocated"] == pytest.approx(
        out["shiftable"]["processed_tokens_per_s"] / out["colocated"]["processed_tokens_per_s"])
    assert out["trained_speedup_vs"]["colocated"] == pytest.approx(
        out["shiftable"]["tokens_per_s"] / out["colocated"]["tokens_per_s"])
    assert out["shiftable"]["window"]["first_step"] == 0
    assert out["shiftable"]["window"]["last_step"] == 3
    assert out["constants"]["source"] == "config" and "paper_speedup_vs" not in out
    with open_trace(str(traces["shiftable"])) as t:
        assert t.meta["simulated"] is True and t.summary["steps"] == 3
    assert np.isfinite(out["rr_colocated"]["idle_fraction"])


def test_simulate_refuses_a_bad_key_and_an_unknown_paradigm(tiny_models):
    for args, text in ((["rl.stepz=3"], "rl.stepz"), (["--paradigms", "pivot"], "pivot")):
        p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "simulate",
                            str(CONFIG), *model_overrides(tiny_models), *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and text in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bench_sim_json_smoke(tiny_models):
    """The 1024-device figure is a benchmark (docs/design.md); here only its shape at 16 devices."""
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "bench", "sim", "--gpus",
                        "16", "--json", *model_overrides(tiny_models)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["gpus"] == 16 and out["steps"] == 1 and out["samples_per_step"] == 32
    assert out["wall_s"] > 0 and out["virtual_s"] > 0 and out["shifts"] > 0


def test_a_live_runs_step_overhead_is_measured_and_modeled(tiny_models, shiftable, tmp_path):
    """The loop measures what a Step costs beyond its engine iterations (summary
    `step_overhead_s`); `from_trace` takes it from a live trace, and the modeled workers
    charge it, so the simulated loop measures it back and runs slower for it."""
    from dataclasses import replace

    cfg, path, summary = shiftable
    assert summary["step_overhead_s"] == pytest.approx({"reward": 0.0, "rollout": 0.0}, abs=1e-9)
    want = {"rollout": 0.05, "reward": 0.02}
    slow = simulate(cfg, replace(SimConstants.from_config(cfg), step_overhead_s=want),
                    tmp_path / "slow.h5")
    assert slow["step_overhead_s"] == pytest.approx(want)
    assert slow["seconds"] > summary["seconds"]
    got = SimConstants.from_trace(tmp_path / "slow.h5", cfg)
    assert got.step_overhead_s == pytest.approx(want)


def test_from_trace_gives_the_fits_d_back_the_step_overhead(tiny_models, tmp_path):
    """The loop's fits are of Step round trips, so they hold a Step's overhead, which the
    modeled workers charge on their own: `from_trace` takes an iteration's share of it off
    each fit's D (never below 0), or the simulator would charge it twice."""
    from pivotrl_hpc.trace.writer import TraceWriter

    cfg = _cfg(tiny_models)
    path = tmp_path / "live.h5"
    with TraceWriter(path) as w:
        w.append("fits", t=1.0, role="rollout", A=1e-4, B=0.01, C=0.002, D=0.05, error=0.1,
                 samples=24)
        w.append("fits", t=2.0, role="reward", A=1e-5, B=0.05, C=0.01, D=0.001, error=0.1,
                 samples=24)
        w.close({"step_overhead_s": {"rollout": 0.04, "reward": 0.02}})
    got = SimConstants.from_trace(path, cfg).throughput
    k = cfg.roles.step_iterations
    assert got["policy"].to_dict() == pytest.approx({"A": 1e-4, "B": 0.01, "C": 0.002,
                                                     "D": 0.05 - 0.04 / k})
    assert got["genrm"].D == 0.0 and got["genrm"].C == pytest.approx(0.01)


def test_a_first_step_warm_up_is_measured_once_per_engine_and_modeled(tiny_models, shiftable,
                                                                     tmp_path):
    """A role's first Step on a device costs `first_step_s` more (an engine's warm-up); the
    loop's summary reports the first Steps' mean wall seconds, which then hold the warm-up
    plus one ordinary Step, and `from_trace` takes them."""
    from dataclasses import replace

    cfg, _, summary = shiftable
    warm = {"rollout": 7.0, "reward": 3.0}
    slow = simulate(cfg, replace(SimConstants.from_config(cfg), first_step_s=warm),
                    tmp_path / "warm.h5")
    for role, extra in warm.items():   # the warm-up on top of an ordinary first Step
        plain = summary["first_step_s"][role]
        assert plain < 2.0
        assert slow["first_step_s"][role] == pytest.approx(extra + plain, abs=0.5), (
            slow["first_step_s"], summary["first_step_s"])
    assert slow["seconds"] > summary["seconds"] + 3.0
    got = SimConstants.from_trace(tmp_path / "warm.h5", cfg).first_step_s
    assert got == pytest.approx(slow["first_step_s"])


def test_judge_prompts_carry_the_response_at_the_configured_ratio(tmp_path):
    """`workload.judge_prompt_ratio`: a judge prompt is the template and problem plus ratio
    x the response's tokens. Same seed, ratios 1 and 3: every judge prompt grows by exactly
    twice its response (the 7B group's stand-ins, short lengths)."""
    from pivotrl_hpc.protocol.messages import RoleKind
    from pivotrl_hpc.sim.profile import H20
    from pivotrl_hpc.sim.standin import stand_in

    def run(ratio: float) -> tuple[dict, dict]:
        cfg, _ = stand_in(load_config(ROOT / "configs" / "qwen2.5-7b_qwen3-30b-a3b.yaml",
                                      ["rl.steps=1", "rl.batch_size=2", "rl.group_size=4",
                                       "workload.rollout_median=40", "workload.genrm_median=8",
                                       f"workload.judge_prompt_ratio={ratio}"],
                                      check_files=False), tmp_path)
        judged, responses = {}, {}

        def watch(workers):
            for w in workers:
                for sid, s in w.seqs.items():
                    if w.role == RoleKind.REWARD:
                        judged.setdefault(sid, len(s.prompt))
                    elif w.role == RoleKind.ROLLOUT:
                        responses[sid] = len(s.generated) + s.remaining
        simulate(cfg, SimConstants.from_profile(cfg, H20), watch=watch)
        return judged, responses

    one, responses = run(1.0)
    three, _ = run(3.0)
    assert set(one) == set(three) and len(one) == 8
    for sid in one:
        assert three[sid] - one[sid] == 2 * responses[sid] > 0


@pytest.mark.parametrize("paradigm", ["colocated", "disaggregated", "shiftable", "vanilla"])
def test_every_paradigm_migrates_by_the_configured_loop(paradigm, tmp_path):
    """paradigm.migration reaches the executor of every paradigm, planner or not (vanilla:
    none, its ablation)."""
    from pivotrl_hpc.config.paradigm import normalize
    from pivotrl_hpc.controller.clock import VirtualClock
    from pivotrl_hpc.controller.handles import Devices
    from pivotrl_hpc.controller.live import build_controller
    from pivotrl_hpc.sim.run import modeled_workers
    from pivotrl_hpc.sim.standin import stand_in

    cfg, _ = stand_in(load_config(ROOT / "configs" / "qwen2.5-7b_qwen3-30b-a3b.yaml",
                                  [f"paradigm.name={paradigm}", "paradigm.migration=paper"],
                                  check_files=False), tmp_path)
    cfg = normalize(cfg)
    clock = VirtualClock()
    workers = modeled_workers(cfg, SimConstants.from_config(cfg), clock)
    ctl = build_controller(cfg, Devices(workers), clock, None, decider=None)
    assert ctl.executor.migrate == (False if paradigm == "vanilla" else "paper")
