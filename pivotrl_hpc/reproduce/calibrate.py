"""`pivotrl reproduce calibrate`: each paper group's free assumptions fitted so that the
simulated baselines (colocated, disaggregated, rollout-reward colocated, on the paper's
Table 4 splits) give the paper's Figure 9 throughput; shiftable is never run here, its
ratios stay a prediction (docs/calibration.md).

What is fixed, and where from (`Fixed`, `SOURCES`): the H20 datasheet and the models'
dimensions (sim/profile.py), Table 4's splits (the paper configs), Figure 12's shift
seconds, §8.1's length caps; and the assumptions the paper does not give (prompts a step,
the length distributions' medians and spreads, judge prompt = template + response). What
is fitted: the policy's and the GenRM's effective decode/prefill costs and the training
seconds a token, each a scale factor over the datasheet derivation (`FREE`).

The fit is a bounded Gauss-Newton iteration in log space on the three residuals log(ours /
paper): every factor stays where an H20 can run (`LIMITS`: decode at most 85 % of peak HBM
bandwidth, training at 15-60 % MFU; `implied` turns factors into those efficiencies), a
factor at its bound that the step would push past is held there (an active set), and the
iteration goes on until it converges at one of two ends (`Fit.end`, recorded with the
probes that show it): WITHIN, every baseline within TOLERANCE; or NO_IMPROVEMENT, no step
improves the fit inside the bounds: the bounded step is empty (every factor it would move is
held at a bound), or a step improved the fit by less than FTOL (it has settled), or the
steps from the best point kept making it worse (each halves the trust radius) until the
radius is below MIN_RADIUS, or a probe sits at the corner of the
bounds every residual points past (every cost the least an H20 allows and every baseline
still too slow, or the reverse). A NO_IMPROVEMENT end whose best point is outside
TOLERANCE with a factor on a bound is AT_BOUND instead (`called`): the bound, not the data,
stopped it, and the record names the factor and the residuals. AT_BOUND, a fit whose steps
run out first (ITERATIONS) and one that is stopped (INTERRUPTED) have not converged, and
the record says so. Its Jacobian starts from
PRIOR and Broyden's rule corrects it, so a group costs one run set a step. `evaluate` is
injected, so the fit itself is tested without a simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from pivotrl_hpc.reproduce import paper, targets
from pivotrl_hpc.reproduce.targets import TAU_TOLERANCE
# the group's inputs, here too for callers and tests (cal.FIXED[group])
from pivotrl_hpc.reproduce.calibrate_inputs import FIXED, SOURCES, UNEXPLAINED, Fixed  # noqa: F401
from pivotrl_hpc.sim.measure import DRAIN_STEPS, FILL_STEPS, RUN_STEPS
from pivotrl_hpc.sim.profile import H20

BASELINES = ("colocated", "disaggregated", "rr_colocated")
FREE = ("policy_scale", "genrm_scale", "train_scale")
TOLERANCE = 0.10          # Figure 9's baselines within 10 % (issue 50)
MAX_LOG_STEP = math.log(4.0)
MIN_RADIUS = 0.02         # a trust radius (log) below this: no further improvement
FTOL = 0.01               # a step that improves the squared log residuals less: settled
PERTURB = 1.5             # finite-difference factor of the Jacobian

# What the datasheet derivation (sim/profile.py) already assumes: decode at ETA_MEM of the
# H20's peak HBM bandwidth, training at MFU_TRAIN. A scale factor s makes a model's decode
# need ETA_MEM / s of peak (s < 0.7 needs more than the peak: impossible) and training run
# at MFU_TRAIN / s.
ETA_MEM, MFU_TRAIN = H20.eta_mem, H20.mfu_train
# What an H20 can reach: decode kernels reach at most ~85 % of peak HBM bandwidth; a
# Megatron RL step 15-60 % MFU. HBM_FLOOR: low enough for the paper's own speeds: Figure 8's
# tau (reproduce/targets.py) needs the GenRM at ~11 % of peak HBM and the policy at ~22 %
# (the engines' scheduling, sampling and expert-parallel overheads, which the datasheet
# derivation leaves out). The MFU floor stays at 15 %: slower training would let the
# fit make training pace disaggregated, where the paper's Figure 3 has it idle (the record
# keeps disaggregated's training busy share, `targets.training_busy`).
HBM_MAX, HBM_FLOOR, MFU_RANGE = 0.85, 0.10, (0.15, 0.60)
IMPLIED = {"policy_scale": "policy_hbm", "genrm_scale": "genrm_hbm",
           "train_scale": "train_mfu"}


def implied(params: dict[str, float]) -> dict[str, float]:
    """The hardware efficiency each factor stands for: `policy_hbm` and `genrm_hbm`, the
    fraction of the H20's peak HBM bandwidth that model's decode needs; `train_mfu`."""
    return {"policy_hbm": ETA_MEM / params["policy_scale"],
            "genrm_hbm": ETA_MEM / params["genrm_scale"],
            "train_mfu": MFU_TRAIN / params["train_scale"]}


def reachable(eff: dict[str, float]) -> bool:
    """`implied`'s efficiencies inside what an H20 can do (HBM_MAX, HBM_FLOOR, MFU_RANGE)."""
    return (all(HBM_FLOOR <= eff[k] <= HBM_MAX for k in ("policy_hbm", "genrm_hbm"))
            and MFU_RANGE[0] <= eff["train_mfu"] <= MFU_RANGE[1])


def _sig(v: float) -> float:
    """4 significant digits: what the calibration file holds is what was evaluated."""
    return float(f"{v:.4g}")


def _limits() -> dict[str, tuple[float, float]]:
    """Each factor's bounds, rounded inwards to the 4 significant digits a calibration file
    holds (`_sig`)."""
    digits = lambda v: 10.0 ** (3 - math.floor(math.log10(v)))    # noqa: E731
    up = lambda v: _sig(math.ceil(v * digits(v)) / digits(v))      # noqa: E731
    down = lambda v: _sig(math.floor(v * digits(v)) / digits(v))   # noqa: E731
    hbm = (up(ETA_MEM / HBM_MAX), down(ETA_MEM / HBM_FLOOR))
    return {"policy_scale": hbm, "genrm_scale": hbm,
            "train_scale": (up(MFU_TRAIN / MFU_RANGE[1]), down(MFU_TRAIN / MFU_RANGE[0]))}


LIMITS = _limits()

Evaluate = Callable[[dict[str, float]], dict[str, float]]


def residuals(ours: dict[str, float], target: dict[str, float]) -> dict[str, float]:
    """ours / paper - 1 per target: the baselines' bars, and where the group has them
    Figure 8's tau and Figure 10's step seconds (`reproduce.targets`)."""
    return {p: ours[p] / target[p] - 1.0 for p in target}


def tolerance(name: str) -> float:
    """A target's tolerance: TOLERANCE, Figure 8's tau TAU_TOLERANCE (its contexts assumed)."""
    return TAU_TOLERANCE if name.startswith("tau_") else TOLERANCE


def within(res: dict[str, float], tol: float | None = None) -> bool:
    return all(abs(v) <= (tolerance(k) if tol is None else tol) for k, v in res.items())


def _logerr(ours: dict[str, float], target: dict[str, float]) -> list[float]:
    return [math.log(ours[p] / target[p]) for p in target]


def _solve(jac: list[list[float]], rhs: list[float]) -> list[float]:
    """Least squares J x = rhs by the normal equations with RIDGE (a factor that moves
    nothing stays put instead of running off), Gaussian elimination."""
    n = len(jac[0])
    a = [[sum(jac[k][i] * jac[k][j] for k in range(len(jac))) + (RIDGE if i == j else 0.0)
          for j in range(n)] + [sum(jac[k][i] * rhs[k] for k in range(len(jac)))]
         for i in range(n)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[piv] = a[piv], a[c]
        for r in range(n):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c])]
    return [a[i][n] / a[i][i] for i in range(n)]


# How a fit ended (`Fit.end`): the first two are convergence; AT_BOUND is a fit that
# stopped improving with its best point outside TOLERANCE and a factor on a bound: the
# bound, not the data, ended it, so it has not converged (`called`)
WITHIN, NO_IMPROVEMENT = "within_tolerance", "no_further_improvement"
ITERATIONS, INTERRUPTED, AT_BOUND = "iterations_spent", "interrupted", "at_bound"


@dataclass
class Fit:
    params: dict[str, float]
    ours: dict[str, float]
    residuals: dict[str, float]
    history: list[dict] = field(default_factory=list)   # every evaluated point
    end: str = ""        # WITHIN, NO_IMPROVEMENT, ITERATIONS or INTERRUPTED
    why: str = ""        # what showed it (the probes, by their index in `history`)

    @property
    def ok(self) -> bool:
        return bool(self.residuals) and within(self.residuals)

    @property
    def converged(self) -> bool:
        return self.end in (WITHIN, NO_IMPROVEMENT)


# d log(throughput) / d log(scale), rows BASELINES, columns FREE: each baseline's share of
# its critical path. Colocated runs every stage in turn (the rollout's tail ~1/3 of a step,
# the judgements' ~2/3, training on every GPU ~10 %); disaggregated waits on the GenRM's
# pool, since judgements are ~6x longer than responses, and on its training pool, which
# since issue 49 pays its communication (72B: train_scale 0.92 -> 2.5 moved disaggregated
# and rr_colocated -24 %, colocated -11 %); rr_colocated shares one pool by work and trains
# beside it. A row sums to ~ -1: every cost scaled by s scales a run's seconds by ~s. A
# first guess Broyden's updates correct: one run set a step instead of (1 + 3).
PRIOR = [[-0.3, -0.58, -0.12],
         [-0.1, -0.65, -0.25],
         [-0.25, -0.5, -0.25]]
# the other targets' rows: a tau is its model's iteration, which its scale multiplies; a
# disaggregated step's seconds go as the inverse of its throughput
EXTRA_PRIOR = {"tau_rollout": [1.0, 0.0, 0.0], "tau_reward": [0.0, 1.0, 0.0],
               "step_s_disaggregated": [-v for v in PRIOR[1]]}


def prior(target: dict[str, float]) -> list[list[float]]:
    """PRIOR's rows for `target`'s keys (the baselines', then EXTRA_PRIOR's)."""
    return [list(PRIOR[BASELINES.index(k)]) if k in BASELINES else list(EXTRA_PRIOR[k])
            for k in target]
# Tikhonov weight on each log step: a factor the three bars barely see (training, which the
# asynchronous baselines overlap) stays near the datasheet instead of absorbing the rest
RIDGE = 0.05


def fit(evaluate: Evaluate, target: dict[str, float], start: dict[str, float],
        steps: int = 6, jacobian: list[list[float]] | None = None,
        history: list[dict] | None = None, limits: dict | None = None) -> Fit:
    """Bounded Gauss-Newton on log(scale factors) against log(ours / paper) of the baselines
    (module docstring). The Jacobian is `jacobian` (e.g. PRIOR) or, if None, measured at
    the start (a run set per factor, each scaled by PERTURB); Broyden's rule updates it
    after every evaluation. Every point is inside `limits` (LIMITS). Stops at one of the
    module docstring's ends, or after `steps` evaluations past the start (ITERATIONS: not
    converged). The best point seen (smallest sum of squared log residuals) is returned
    with the end and why (`Fit.end`, `Fit.why`); `history` (if given) collects every
    evaluated point as it comes, so a caller keeps them when `evaluate` raises."""
    limits = LIMITS if limits is None else limits
    clip = lambda k, v: _sig(min(limits[k][1], max(limits[k][0], v)))   # noqa: E731
    x = {k: clip(k, start[k]) for k in FREE}
    history = [] if history is None else history

    def run(point: dict[str, float]) -> list[float]:
        ours = evaluate(dict(point))
        history.append({"params": dict(point), "ours": ours,
                        "residuals": residuals(ours, target)})
        return _logerr(ours, target)

    e = run(x)
    end = _ended(history, limits)
    if end or steps <= 0:
        return _best(history, *(end or (ITERATIONS, "no step was allowed (steps 0)")),
                     limits=limits)
    if jacobian is not None and len(jacobian) != len(e):   # PRIOR: extended to the targets
        jacobian = prior(target)
    jac = [list(row) for row in jacobian] if jacobian is not None else _measured(run, x, e)
    radius, worse = MAX_LOG_STEP, []
    for _ in range(steps):
        if end := _ended(history, limits):
            return _best(history, *end, limits=limits)
        dx = _bounded_step(jac, e, x, limits)
        dx = [max(-radius, min(radius, d)) for d in dx]
        new = {k: clip(k, x[k] * math.exp(d)) for k, d in zip(FREE, dx)}
        real = [math.log(new[k] / x[k]) for k in FREE]
        if max(map(abs, real)) < 1e-3:
            return _best(history, NO_IMPROVEMENT, _pinned_why(x, limits), limits=limits)
        e_new = run(new)
        _broyden(jac, real, [a - b for a, b in zip(e_new, e)])
        if _sq(e_new) < _sq(e):
            gain = 1 - _sq(e_new) / _sq(e)
            x, e, worse = new, e_new, []
            if gain < FTOL and not within(history[-1]["residuals"]):
                return _best(history, NO_IMPROVEMENT,
                             f"probe {len(history) - 1}, the step from the best point, "
                             f"improved the sum of squared log residuals by {gain:.2%} "
                             f"(< {FTOL:.0%}): the fit has settled inside the bounds",
                             limits=limits)
        else:   # worse: the Jacobian has learnt from it; a shorter step from the same point
            worse.append(len(history) - 1)
            radius = max(map(abs, real)) / 2
            if radius < MIN_RADIUS:
                return _best(history, NO_IMPROVEMENT,
                             f"the steps from the best point (probes {worse}) each made the "
                             f"fit worse until the trust radius fell below {MIN_RADIUS}",
                             limits=limits)
    return _best(history, *(_ended(history, limits) or (
        ITERATIONS, f"the {steps} steps allowed were spent before either end: not converged")),
                 limits=limits)


def _at(x: dict[str, float], k: str, limits: dict) -> str | None:
    """"lower" / "upper" where factor k sits at that bound (4 significant digits)."""
    lo, hi = limits[k]
    return "lower" if x[k] <= lo else "upper" if x[k] >= hi else None


def _ended(history: list[dict], limits: dict) -> tuple[str, str] | None:
    """The last evaluated point ends the fit: it is within TOLERANCE, or it is a corner of
    the bounds past which every residual points (every factor at its lower bound, the
    fastest an H20 runs each cost, and every baseline still more than TOLERANCE too slow;
    or the reverse). Every factor scales a cost, and a baseline with every cost lower is
    not slower, so no point inside the bounds comes closer to any baseline."""
    h = history[-1]
    if within(h["residuals"]):
        return WITHIN, f"probe {len(history) - 1} is within {TOLERANCE:.0%} of every bar"
    sides = {_at(h["params"], k, limits) for k in FREE}
    signs = {-1 if v < -TOLERANCE else 1 if v > TOLERANCE else 0
             for k, v in h["residuals"].items() if k in BASELINES}
    for side, sign in (("lower", -1), ("upper", 1)):
        if sides == {side} and signs == {sign}:
            return NO_IMPROVEMENT, (
                f"probe {len(history) - 1} sits at every factor's {side} bound (each cost "
                f"{'the least' if side == 'lower' else 'the most'} an H20 allows) and every "
                f"baseline is still {'slower' if sign < 0 else 'faster'} than its bar by "
                f"more than {TOLERANCE:.0%}: no point inside the bounds comes closer")
    return None


def _pinned_why(x: dict[str, float], limits: dict) -> str:
    """Why the bounded step is empty: the factors at a bound the step pushes past, or (none
    at a bound) a step below 0.1 % in every factor, the least-squares optimum."""
    pinned = [f"{k} at its {_at(x, k, limits)} bound" for k in FREE if _at(x, k, limits)]
    if not pinned:
        return ("the Gauss-Newton step from the best point is below 0.1 % in every factor: "
                "the least-squares optimum inside the bounds")
    return (f"the Gauss-Newton step from the best point moves no factor by 0.1 % once the "
            f"factors it pushes past a bound are held ({', '.join(pinned)}): no step "
            f"improves it inside the bounds")


def _sq(e: list[float]) -> float:
    return sum(v * v for v in e)


def _bounded_step(jac: list[list[float]], e: list[float], x: dict[str, float],
                  limits: dict) -> list[float]:
    """The Gauss-Newton step with the factors at a bound that it would push past held
    there (an active set: re-solved over the others until none is pushed past)."""
    free = list(range(len(FREE)))
    while free:
        sub = _solve([[row[j] for j in free] for row in jac], [-v for v in e])
        dx = [0.0] * len(FREE)
        for j, d in zip(free, sub):
            dx[j] = d
        held = [j for j in free
                if (dx[j] < 0 and x[FREE[j]] <= limits[FREE[j]][0])
                or (dx[j] > 0 and x[FREE[j]] >= limits[FREE[j]][1])]
        if not held:
            return dx
        free = [j for j in free if j not in held]
    return [0.0] * len(FREE)


def _broyden(jac: list[list[float]], dx: list[float], de: list[float]) -> None:
    """J += (de - J dx) dx^T / |dx|^2, in place."""
    norm = sum(d * d for d in dx)
    if norm <= 0:
        return
    for i in range(len(jac)):
        pred = sum(jac[i][j] * dx[j] for j in range(len(FREE)))
        for j in range(len(FREE)):
            jac[i][j] += (de[i] - pred) * dx[j] / norm


def _measured(run, x: dict[str, float], e: list[float]) -> list[list[float]]:
    h = math.log(PERTURB)
    cols = []
    for k in FREE:
        e_k = run({**x, k: _sig(x[k] * PERTURB)})
        cols.append([(a - b) / h for a, b in zip(e_k, e)])
    return [[cols[j][i] for j in range(len(FREE))] for i in range(len(e))]


def best(history: list[dict], start: dict[str, float]) -> Fit:
    """The best point of an interrupted fit (`start`, unmeasured, if none was evaluated)."""
    why = "stopped before it ended (an error or ^C): not converged"
    return _best(history, INTERRUPTED, why) if history else \
        Fit({k: _sig(start[k]) for k in FREE}, {}, {}, end=INTERRUPTED, why=why)


def _best(history: list[dict], end: str = "", why: str = "",
          limits: dict | None = None) -> Fit:
    """The point of the smallest sum of squared log residuals (what the steps minimise),
    its end called by its name (`called`)."""
    i, b = min(enumerate(history),
               key=lambda ih: sum(math.log1p(v) ** 2 for v in ih[1]["residuals"].values()))
    return Fit(b["params"], b["ours"], b["residuals"], history,
               *called(end, why, b["params"], b["residuals"], i, limits))


def called(end: str, why: str, params: dict[str, float], res: dict[str, float],
           probe: int, limits: dict | None = None) -> tuple[str, str]:
    """A NO_IMPROVEMENT end whose best point (`probe`) is outside TOLERANCE with a factor
    on a bound is AT_BOUND, not converged: `why` then names the factors on a bound (the
    H20 limit each is) and the baselines beyond TOLERANCE, before the rule that stopped
    it. Any other end is returned as it is."""
    on = pinned(params, limits)
    off = {p: v for p, v in res.items() if abs(v) > tolerance(p)}
    if end != NO_IMPROVEMENT or not on or not off:
        return end, why
    return AT_BOUND, (
        f"the best point, probe {probe}, rests on a bound: "
        + ", ".join(f"{k} {params[k]:.4g} at its {v}" for k, v in on.items())
        + f", with {', '.join(f'{p} {v:+.1%}' for p, v in off.items())} beyond "
        f"its tolerance; the fit stopped because {why}")


def pinned(params: dict[str, float], limits: dict | None = None) -> dict[str, str]:
    """The factors at a bound, with the bound's meaning (what the H20 limit is)."""
    limits = LIMITS if limits is None else limits
    what = {("policy_scale", "lower"): f"policy decode at {HBM_MAX:.0%} of peak HBM",
            ("genrm_scale", "lower"): f"GenRM decode at {HBM_MAX:.0%} of peak HBM",
            ("policy_scale", "upper"): f"policy decode at {HBM_FLOOR:.0%} of peak HBM",
            ("genrm_scale", "upper"): f"GenRM decode at {HBM_FLOOR:.0%} of peak HBM",
            ("train_scale", "lower"): f"training at {MFU_RANGE[1]:.0%} MFU",
            ("train_scale", "upper"): f"training at {MFU_RANGE[0]:.0%} MFU"}
    return {k: f"{side} bound ({what[k, side]})" for k in FREE
            if (side := _at(params, k, limits))}


def document(group: str, fixed: Fixed, result: Fit, settings: dict,
             error: str | None = None, training_busy: float | None = None) -> dict:
    """The calibration file's mapping: the config keys a paper config includes, `implied`
    (the hardware efficiencies the factors stand for, against what an H20 can reach) and
    a `record` (neither loaded) with the target, the fit, its residuals, how it ended
    (`convergence`: the end, the probes that show it, the factors pinned at a bound) and
    every source;
    where the fit is not within TOLERANCE, `unexplained`: the group's assumption that would
    explain the rest (UNEXPLAINED)."""
    up = {r: s[0] for r, s in fixed.shifts.items()}
    cal = dict(result.params)
    for role, (u, d) in fixed.shifts.items():
        cal[f"shift_up_s_{role}"], cal[f"shift_down_s_{role}"] = u, d
    rnd = lambda d: {k: round(v, 4) for k, v in d.items()}   # noqa: E731
    return {
        "rl": {"batch_size": fixed.batch_size},
        "roles": {"max_num_seqs": fixed.max_num_seqs,
                  "gpu_memory_utilization": fixed.gpu_memory_utilization},
        "workload": {"length_mode": "budget", "rollout_median": fixed.rollout_median,
                     "rollout_sigma": fixed.rollout_sigma,
                     "genrm_median": fixed.genrm_median, "genrm_sigma": fixed.genrm_sigma,
                     "judge_prompt_ratio": fixed.judge_prompt_ratio},
        # the planner's shift estimates before it measures any: Figure 12's
        "paradigm": {f"shift_seconds_{r}": s for r, s in up.items()},
        "calibration": cal,
        "implied": {**{k: round(v, 3) for k, v in implied(result.params).items()},
                    "reachable": reachable(implied(result.params)),
                    "limits": {"hbm_max": HBM_MAX, "hbm_floor": HBM_FLOOR,
                               "train_mfu": list(MFU_RANGE)},
                    "derivation": f"policy_hbm, genrm_hbm = {ETA_MEM} (sim/profile.py's "
                                  f"eta_mem) / scale: the fraction of the H20's peak HBM "
                                  f"bandwidth each model's decode needs; train_mfu = "
                                  f"{MFU_TRAIN} (mfu_train) / train_scale"},
        "record": {
            "group": group, "title": paper.TITLES[group],
            "accounting": "tokens/s = tokens the rollout and the reward generate "
                          "(responses + judgements) between the ends of steps "
                          f"{FILL_STEPS} and {RUN_STEPS - DRAIN_STEPS} of {RUN_STEPS}, over "
                          "those seconds (sim/measure.py, docs/calibration.md)",
            "target_paper_fig9": {p: paper.FIG9[group][p] for p in BASELINES},
            # Figure 8's tau and Figure 10's step seconds where the paper gives them
            **({"target_paper_fig8_fig10": {k: round(v, 4) for k, v in extra.items()},
                "tau_tolerance": TAU_TOLERANCE} if (extra := targets.paper(group)) else {}),
            # the paper's Figure 3: disaggregated training idles (< 1 of a step)
            **({"disaggregated_training_busy": round(training_busy, 3)}
               if training_busy is not None else {}),
            "ours": rnd(result.ours), "residuals": rnd(result.residuals),
            "tolerance": TOLERANCE, "within_tolerance": result.ok,
            # which end the fit reached (issue 50: within 10 %, or no further improvement
            # inside the bounds), the probes that show it, the factors at a bound
            "convergence": {"converged": result.converged, "end": result.end,
                            "why": result.why, "pinned": pinned(result.params)},
            **({} if result.ok or group not in UNEXPLAINED
               else {"unexplained": UNEXPLAINED[group]}),
            **({"error": error} if error else {}), "fitted": list(FREE),
            "assumptions": ["rl.batch_size", "workload.*", "roles.max_num_seqs",
                            "roles.gpu_memory_utilization"],
            "fixed_from_paper": ["calibration.shift_*", "paradigm.shift_seconds_*",
                                 "Table 4 splits", "length caps"],
            "sources": SOURCES, "settings": settings,
            "history": [{"probe": i, "params": rnd(h["params"]),
                         "residuals": rnd(h["residuals"])}
                        for i, h in enumerate(result.history)]}}
