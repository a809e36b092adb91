"""The loop learns, and shifting does not change what is learned (paper §8.7, Figure 15).

configs/learn-cpu.yaml (1 node x 4 capped devices, TP=1): 20 GRPO steps of the tiny policy
through `pivotrl run` under colocated, disaggregated and shiftable, on the init-models
DAPO-schema parquet with chat-templated prompts and the tiny GenRM's judgement. The reward is
0.5 (R_verifiable + R_GenRM) with the arithmetic compute_score
(pivotrl_hpc/task/arithmetic.py, in [0, 1]: 1 for the right number, else the response's
fraction of digit characters) and the GenRM's parsed yes/no (in [0, 1], mostly unparsed: 0),
so the reward lies in [0, 1] and the threshold stays a rise of 0.2. With DAPO's +1/-1 the
same halved reward would lie in [-0.5, 1] and a random policy sits at -0.5 with no variance
in a group (no GRPO signal), so learn-cpu does not use it. A policy whose rollout never
receives the trained weights (training -> GPS Write -> rollout Reload) stays at the random
policy's ~0.01. Each run ~3-5 min on 2 cores. Each runs beside CONTENTION CPU spinners: the
suite's one run per paradigm under contention (issue 47; `pivotrl bench soak --contention`
runs many).
"""
from __future__ import annotations

import statistics

import pytest
from live_util import CONTENTION, check_nothing_lost, run_job

pytestmark = pytest.mark.slow

PARADIGMS = ("colocated", "disaggregated", "shiftable")
STEPS, PER_STEP = 20, 8 * 4


@pytest.fixture(scope="module")
def learned(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("learn")
    runs = {}

    def get(paradigm: str) -> dict:
        if paradigm not in runs:
            runs[paradigm] = run_job("learn-cpu.yaml", tiny_models, out / f"{paradigm}.h5",
                                     [f"paradigm.name={paradigm}"], contention=CONTENTION)
        return runs[paradigm]
    return get


def rewards(run: dict) -> list[float]:
    return [r["reward"] for r in run["summary"]["reward_per_step"]]


@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_reward_rises_by_at_least_0_2(learned, paradigm):
    run = learned(paradigm)
    r = rewards(run)
    assert len(r) == STEPS
    first, last = statistics.fmean(r[:5]), statistics.fmean(r[-5:])
    assert last - first >= 0.2, f"{paradigm}: first 5 steps {first:.3f}, last 5 {last:.3f}"
    k = 0 if paradigm == "colocated" else 2
    check_nothing_lost(run["trace"], STEPS, PER_STEP, k)
    assert run["summary"]["in_flight_at_end"] == 0 and run["left"] == set()


def test_shifting_does_not_change_what_is_learned(learned):
    """Per-step curves agree within noise: the last 5 steps' mean reward of every paradigm
    lies within 0.15 of the others', and so does each paradigm's mean over all 20 steps."""
    curves = {p: rewards(learned(p)) for p in PARADIGMS}
    for stat in (lambda r: statistics.fmean(r[-5:]), statistics.fmean):
        values = {p: stat(r) for p, r in curves.items()}
        assert max(values.values()) - min(values.values()) <= 0.15, values


def test_shiftable_shifts_while_it_learns(learned):
    s = learned("shiftable")["summary"]
    assert s["shifts"] > 0 and s["steady_tokens_per_s"] > 0
    assert all(v["t"] > 0 for v in s["reward_per_step"])   # reward against wall-clock time


def test_the_simulator_fed_each_live_run_orders_the_paradigms_as_they_ran(learned, tiny_models):
    """`pivotrl simulate` with a live run's measured constants (sim/run.py `from_trace`):
    every pair of paradigms whose live throughputs differ by more than 25 % comes out in the
    same order. Simulated over live ran 0.86 (colocated), 1.26 (disaggregated) and 1.04
    (shiftable) here (NOTES "The simulator against live runs"): printed, not bounded, since
    one live run of this machine drifts by more than the bound."""
    from live_util import ROOT, model_overrides

    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.sim.run import SimConstants, simulate

    live, sim = {}, {}
    for p in PARADIGMS:
        run = learned(p)
        cfg = load_config(ROOT / "configs" / "learn-cpu.yaml",
                          [*model_overrides(tiny_models), f"paradigm.name={p}"])
        live[p] = run["summary"]["tokens_per_s"]
        sim[p] = simulate(cfg, SimConstants.from_trace(run["trace"], cfg))["tokens_per_s"]
    print({p: (round(live[p], 2), round(sim[p], 2), round(sim[p] / live[p], 2))
           for p in PARADIGMS})
    for a in PARADIGMS:
        for b in PARADIGMS:
            if live[a] > 1.25 * live[b]:
                assert sim[a] > sim[b], (a, b, live, sim)
