"""The calibration's targets beside Figure 9's bars, where the paper gives them (the 7B
group, Qwen2.5-7B & Qwen3-30B-A3B): Figure 8's generation latencies and Figure 10's step
seconds (docs/calibration.md, "The shared workload" and "Figure 8's speeds").

- Figure 8 (the planner's worked example, 7B group): reward N = 385 sequences, T = 4,752
  tokens/s on 16 GPUs (4 replicas of 4); rollout N = 59, T = 2,077 on 8 GPUs (8 replicas of
  1). tau = N / T, seconds a token a sequence: a replica's iteration at that load. Ours is
  the modeled engine's iteration (`ThroughputModel.latency`) at N / replicas sequences a
  replica, each holding its prompt and half its mean length (an assumption: the snapshot's
  contexts are not given), hence TAU_TOLERANCE rather than the bars' 10 %.
- Figure 10: disaggregated 2,970.7 s over the three steps PivotRL ran in 1,728.3 s. Ours is
  the disaggregated run's seconds a step over the protocol's window.
"""
from __future__ import annotations

import math

from pivotrl_hpc.sim.measure import window

G7 = "qwen2.5-7b_qwen3-30b-a3b"
# role -> (sequences N, tokens/s T, replicas): Figure 8
FIG8 = {G7: {"reward": (385, 4752.0, 4), "rollout": (59, 2077.0, 8)}}
FIG10_STEP_S = {G7: {"disaggregated": 2970.7 / 3, "shiftable": 1728.3 / 3}}
TAU_TOLERANCE = 0.25
MODEL = {"reward": "genrm", "rollout": "policy"}


def paper(group: str) -> dict[str, float]:
    """The group's extra targets, named as the fit's residuals are: tau_<role>,
    step_s_<paradigm> (only baselines: shiftable is never run in a fit)."""
    out = {f"tau_{r}": n / t for r, (n, t, _) in FIG8.get(group, {}).items()}
    step = FIG10_STEP_S.get(group, {})
    if "disaggregated" in step:
        out["step_s_disaggregated"] = step["disaggregated"]
    return out


def capped_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] of a log-normal X (median, sigma): the workload's mean length."""
    mu = math.log(median)
    z = (math.log(cap) - mu) / sigma
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))   # noqa: E731
    return (math.exp(mu + sigma ** 2 / 2) * phi(z - sigma) + cap * (1 - phi(z)))


def contexts(cfg) -> dict[str, float]:
    """Tokens a running sequence holds at a snapshot: its prompt and half its mean length
    (rollout: the problem + half a response; reward: the judge prompt, template + problem +
    judge_prompt_ratio x the response, + half a judgement)."""
    w, pol, gen = cfg.workload, cfg.models.policy, cfg.models.genrm
    resp = capped_mean(w.rollout_median, w.rollout_sigma, pol.max_response_len)
    judge = capped_mean(w.genrm_median, w.genrm_sigma, gen.max_response_len)
    prompt = pol.max_prompt_len / 4    # a DAPO problem is far below the 2K cap
    return {"rollout": prompt + resp / 2,
            "reward": prompt + w.judge_prompt_ratio * resp + judge / 2}


def ours(group: str, cfg, constants, figures: dict[str, dict]) -> dict[str, float]:
    """Our values of `paper(group)`'s targets: tau from `constants`' engines at Figure 8's
    load, step seconds from the disaggregated run's `figures` (its step_marks)."""
    out = {}
    ctx = contexts(cfg)
    for role, (n, _, replicas) in FIG8.get(group, {}).items():
        per = n / replicas
        out[f"tau_{role}"] = constants.throughput[MODEL[role]].latency(
            math.ceil(per), int(per * ctx[role]))
    if "step_s_disaggregated" in paper(group):
        w = window((figures.get("disaggregated") or {}).get("step_marks") or [])
        if w is not None and w.last_step > w.first_step:
            out["step_s_disaggregated"] = (w.t1 - w.t0) / (w.last_step - w.first_step)
    return out


def training_busy(figures: dict) -> float | None:
    """Disaggregated's training pool: the share of a window step it trains (the paper's
    Figure 3: disaggregated training idles, so this should stay below 1)."""
    w = window(figures.get("step_marks") or [])
    steps = figures.get("train_step_s")
    if w is None or not steps or w.last_step <= w.first_step:
        return None
    mean = sum(steps) / len(steps) if isinstance(steps, list) else float(steps)
    return mean / ((w.t1 - w.t0) / (w.last_step - w.first_step))


def of_run(group: str, run, figures: dict[str, dict]) -> dict[str, float]:
    """`ours` for a fit's probe: `run` (one of its baselines; the engines' constants do not
    depend on the paradigm) resolved and derived as `runs.run_one` does."""
    import tempfile
    from pathlib import Path

    from pivotrl_hpc.reproduce.runs import load_run
    from pivotrl_hpc.sim.profile import H20, calibrated
    from pivotrl_hpc.sim.run import SimConstants
    from pivotrl_hpc.sim.standin import stand_in

    if not paper(group):
        return {}
    with tempfile.TemporaryDirectory(prefix="pivotrl-targets-") as scratch:
        cfg, _ = stand_in(load_run(run), Path(scratch))
        constants = calibrated(SimConstants.from_profile(cfg, H20), cfg.calibration)
        return ours(group, cfg, constants, figures)
