"""The calibration's targets beside Figure 9's bars (`reproduce.targets`): Figure 8's tau
and Figure 10's step seconds for the 7B group, our values of them from the modeled engines
and a run's step marks, and a fit that takes them as residuals. No simulator runs."""
from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path

import pytest

from pivotrl_hpc.config import load_config
from pivotrl_hpc.reproduce import calibrate as cal
from pivotrl_hpc.reproduce import targets
from pivotrl_hpc.sim.profile import H20, calibrated
from pivotrl_hpc.sim.run import SimConstants
from pivotrl_hpc.sim.standin import stand_in

ROOT = Path(__file__).resolve().parents[1]
G7 = "qwen2.5-7b_qwen3-30b-a3b"


def test_the_paper_s_figure_8_and_10_targets_by_hand():
    got = targets.paper(G7)
    assert got["tau_reward"] == pytest.approx(385 / 4752)       # 0.0810 s
    assert got["tau_rollout"] == pytest.approx(59 / 2077)       # 0.0284 s
    assert got["step_s_disaggregated"] == pytest.approx(990.23, abs=0.01)
    assert targets.paper("qwen2.5-32b_qwen3-30b-a3b") == {}   # the paper gives none


def test_the_capped_log_normal_mean_is_the_sampled_one():
    rng = random.Random(0)
    draws = [min(rng.lognormvariate(math.log(5000), 0.8), 20480) for _ in range(200_000)]
    assert targets.capped_mean(5000, 0.8, 20480) == pytest.approx(
        sum(draws) / len(draws), rel=0.01)
    assert targets.capped_mean(650, 1.0, 1e12) == pytest.approx(650 * math.exp(0.5))


def test_our_tau_is_the_modeled_iteration_at_figure_8_s_load_and_step_marks_give_seconds():
    with tempfile.TemporaryDirectory() as scratch:
        cfg, _ = stand_in(load_config(str(ROOT / "configs" / f"{G7}.yaml"),
                                      check_files=False), Path(scratch))
        c = calibrated(SimConstants.from_profile(cfg, H20), cfg.calibration)
        marks = [[100.0 * i, 1000 * i] for i in range(1, 9)]   # 100 s a step
        got = targets.ours(G7, cfg, c, {"disaggregated": {"step_marks": marks}})
    ctx = targets.contexts(cfg)
    assert got["tau_reward"] == pytest.approx(
        c.throughput["genrm"].latency(97, int(385 / 4 * ctx["reward"])))
    assert got["tau_rollout"] == pytest.approx(
        c.throughput["policy"].latency(8, int(59 / 8 * ctx["rollout"])))
    assert got["step_s_disaggregated"] == pytest.approx(100.0)
    # a judgement's context holds the response it reads and half a judgement
    assert ctx["reward"] > ctx["rollout"] > 0
    assert targets.training_busy({"step_marks": marks, "train_step_s": 40.0}) == \
        pytest.approx(0.4)


def test_a_fit_takes_the_extra_targets_as_residuals_with_their_own_tolerance():
    """Baselines as a time-share law and tau as the model's own scale: the fit extends the
    prior Jacobian to the tau rows, every probe's residuals hold every target, and it
    ends within tolerance where the truth is inside the bounds."""
    true = {"policy_scale": 1.6, "genrm_scale": 3.0, "train_scale": 1.2}
    base = {"colocated": 11545.0, "disaggregated": 11711.0, "rr_colocated": 14189.0}
    ws = {"colocated": (0.3, 0.6, 0.1), "disaggregated": (0.05, 0.9, 0.05),
          "rr_colocated": (0.6, 0.35, 0.05)}
    goal = {**base, "tau_reward": 0.081, "tau_rollout": 0.028}

    def evaluate(x):
        out = {p: base[p] * sum(w * true[k] for w, k in zip(ws[p], cal.FREE))
               / sum(w * x[k] for w, k in zip(ws[p], cal.FREE)) for p in base}
        out["tau_reward"] = 0.081 * x["genrm_scale"] / true["genrm_scale"]
        out["tau_rollout"] = 0.028 * x["policy_scale"] / true["policy_scale"]
        return out
    fit = cal.fit(evaluate, goal, {k: 1.0 for k in cal.FREE}, steps=6, jacobian=cal.PRIOR)
    assert all(set(h["residuals"]) == set(goal) for h in fit.history)
    assert fit.end == cal.WITHIN and fit.converged
    assert abs(fit.residuals["tau_reward"]) <= targets.TAU_TOLERANCE
    assert cal.tolerance("tau_reward") == 0.25 and cal.tolerance("colocated") == 0.10
    assert cal.prior(goal)[3:] == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_the_engines_cap_is_a_config_key_the_modeled_engines_take(tmp_path):
    """roles.max_num_seqs (vLLM's, 256 by default; the calibration's veRL 1,024): checked
    by name, and each modeled worker decodes at most that many sequences at once."""
    from pivotrl_hpc.config import ConfigError
    from pivotrl_hpc.controller.clock import VirtualClock
    from pivotrl_hpc.sim.run import modeled_workers

    config = str(ROOT / "configs" / f"{G7}.yaml")
    with pytest.raises(ConfigError, match="roles.max_num_seqs"):
        load_config(config, ["roles.max_num_seqs=0"], check_files=False)
    cfg, _ = stand_in(load_config(config, ["roles.max_num_seqs=1024"], check_files=False),
                      tmp_path)
    c = SimConstants.from_profile(cfg, H20)
    assert {w.max_num_seqs for w in modeled_workers(cfg, c, VirtualClock())} == {1024}
