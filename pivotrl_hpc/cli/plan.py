"""`pivotrl plan SNAPSHOT.json`: replay one planner decision offline.

Prints the five steps (shift-up role with every role's τ, shift pairs with penalties, every
candidate with count, penalty, estimated throughput and benefit, the chosen plan) as one JSON
object with --json, else as a table. Planner parameters come from the snapshot's
`meta.planner` when present (what the live run used), overridable here. `--workers N`
evaluates the candidates on N processes (same result; only pays on large snapshots).
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pivotrl_hpc.plan import (POLICIES, PivotPlanner, PlannerParams, PlanReport,
                              SnapshotError, WorkloadSnapshot, make_policy, parallel)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("snapshot", type=Path, help="workload snapshot JSON (docs/snapshot.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--policy", default="shiftable", choices=POLICIES,
                   help="allocation policy to replay (default: shiftable, the planner)")
    p.add_argument("--horizon", type=float, default=None, help="H in seconds (default 60)")
    p.add_argument("--tau-shift", action="append", default=[], metavar="ROLE=SECONDS",
                   help="shift duration of a shifting-down replica of ROLE; repeatable")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="parameter of a non-planner policy (e.g. rollout_gpus=8); repeatable")
    p.add_argument("--workers", type=int, default=1,
                   help="processes evaluating the planner's candidates (default 1: none)")


def _policy_params(items: list[str]) -> dict:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r}: want KEY=VALUE")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def _params(snap: WorkloadSnapshot, args: argparse.Namespace) -> PlannerParams:
    stored = dict(snap.meta.get("planner", {}))
    try:
        params = PlannerParams(**stored)
    except TypeError as exc:
        raise ValueError(f"meta.planner: {exc}") from None
    if args.horizon is not None:
        params.horizon_s = args.horizon
    for item in args.tau_shift:
        role, _, value = item.partition("=")
        if role not in params.tau_shift or not value:
            raise ValueError(f"--tau-shift {item!r}: want ROLE=SECONDS with ROLE in "
                             f"{sorted(params.tau_shift)}")
        params.tau_shift[role] = float(value)
    params.__post_init__()
    return params


def _table(report: PlanReport) -> str:
    ch = report.choice
    lines = [f"1. shift-up role: {ch.role} ({ch.reason})",
             "   " + "  ".join(f"tau_{r}={t:.4g}" for r, t in ch.taus.items()),
             f"   current throughput: rollout {report.current.rollout:.1f}  reward "
             f"{report.current.reward:.1f}  overall {report.current.overall:.1f}",
             "2. shift pairs (ascending penalty):"]
    for i, p in enumerate(report.pairs):
        ups = " ".join(f"{s[0]}-{s[-1]}" for s in p.up_slots)
        lines.append(f"   [{i}] up {len(p.up_slots)} on {ups:<24} down "
                     f"{','.join(p.shift_down) or '-':<28} phi={p.penalty:.1f}")
    lines.append("3-4. candidates:")
    lines.append(f"   {'k':>4} {'penalty':>10} {'T_rollout':>10} {'T_reward':>10} "
                 f"{'T_overall':>10} {'benefit':>12}")
    for c in report.candidates:
        e, cand = c.estimate, c.candidate
        lines.append(f"   {cand.shift_up_count:>4} {cand.penalty:>10.1f} {e.rollout:>10.1f} "
                     f"{e.reward:>10.1f} {e.overall:>10.1f} {c.benefit:>12.1f}")
    lines.append(f"5. plan: {_plan_line(report.plan) if report.plan else 'none'} ({report.reason})")
    return "\n".join(lines)


def _plan_line(plan) -> str:
    ups = ", ".join(f"{s.role}@{s.devices[0]}-{s.devices[-1]}" for s in plan.shift_up)
    return f"shift down [{', '.join(plan.shift_down)}] -> shift up [{ups}]"


def _explain(snap: WorkloadSnapshot, params: PlannerParams, workers: int) -> PlanReport:
    if workers <= 1:
        return PivotPlanner(params).explain(snap)
    with ProcessPoolExecutor(workers, **parallel.share(snap)) as pool:
        return PivotPlanner(params, executor=pool, chunks=workers).explain(snap)


def main(args: argparse.Namespace) -> int:
    try:
        snap = WorkloadSnapshot.from_dict(json.loads(args.snapshot.read_text()))
        if args.policy == "shiftable":
            report = _explain(snap, _params(snap, args), args.workers)
            out = report.to_dict()
        else:
            plan = make_policy(args.policy, _policy_params(args.param)).decide(snap)
            report, out = None, {"policy": args.policy,
                                 "plan": None if plan is None else plan.to_dict()}
    except (OSError, json.JSONDecodeError, SnapshotError, ValueError) as exc:
        print(f"pivotrl plan: {args.snapshot}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
    elif report is not None:
        print(_table(report))
    else:
        plan = out["plan"]
        print(f"{args.policy}: " + ("no shift" if plan is None else
                                     f"shift down {plan['shift_down']} -> shift up "
                                     f"{[(s['role'], s['devices']) for s in plan['shift_up']]}"
                                     f" ({plan['reason']})"))
    return 0
