"""The run summary's figures recomputed from a trace's rows alone, by the formulas of
docs/trace.md ("Summary figures"). `trace.check` compares them with the stored summary.

Every function takes `rows`: table name -> list of row dicts, in the order written.
"""
from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

GEN_ROLES = ("rollout", "reward")
TRAINING = "training"
VALIDATION = re.compile(r"validation after step (\d+): accuracy ([0-9.]+)")


def devices_of(text: str) -> list[int]:
    return [int(d) for d in str(text).split(",") if d.strip()]


def end_s(rows: dict[str, list[dict]]) -> float | None:
    """`seconds`: the last step's end; None for a run without a step."""
    return rows["steps"][-1]["t"] if rows["steps"] else None


def gpus(rows: dict[str, list[dict]]) -> int | None:
    """Devices of the job: the first planner row's snapshot (`gpus`)."""
    return int(rows["planner"][0]["snapshot"]["gpus"]) if rows["planner"] else None


def shift_kinds(shifts: list[dict]) -> dict[str, int]:
    """`shifts_by_kind`: per device shifted up, `from->to`, `from` the role it held last
    (`idle` before its first role)."""
    held: dict[int, str] = {}
    last: dict[int, str] = {}
    kinds: Counter = Counter()
    for r in shifts:
        for d in devices_of(r["devices"]):
            if r["direction"] == "up":
                kinds[f"{held.get(d) or last.get(d, 'idle')}->{r['role']}"] += 1
                held[d] = r["role"]
            else:
                last[d], held[d] = held.get(d) or last.get(d, "idle"), ""
    return dict(kinds)


def tau_shift(shifts: list[dict], tau0: dict[str, float], n0: dict[str, int]
              ) -> dict[str, float]:
    """`tau_shift`: per role the running mean of its shift seconds, from the `start` row's
    values and counts (the configured value counts as one prior observation), shifts that
    built an engine left out."""
    from pivotrl_hpc.protocol.context import BUILD_PHASES

    tau, n = dict(tau0), Counter(n0)
    for r in shifts:
        if BUILD_PHASES & set(r["phases"] or {}):
            continue
        role = r["role"]
        tau[role] = (tau[role] * (n[role] + 1) + r["seconds"]) / (n[role] + 2)
        n[role] += 1
    return tau


def shift_seconds(shifts: list[dict]) -> dict[str, dict[str, Any]]:
    """`shift_seconds`: per `role.direction` the count, mean seconds and mean phases."""
    out: dict[str, dict[str, Any]] = {}
    for r in shifts:
        k = out.setdefault(f"{r['role']}.{r['direction']}", {"s": [], "phases": Counter()})
        k["s"].append(r["seconds"])
        k["phases"].update(r["phases"] or {})
    return {key: {"count": len(v["s"]), "mean_s": statistics.fmean(v["s"]),
                  "phases_mean_s": {p: s / len(v["s"]) for p, s in v["phases"].items()}}
            for key, v in out.items()}


def in_flight(sequences: list[dict]) -> int:
    """`in_flight_at_end`: training samples admitted (to either role) and not rewarded."""
    admitted = {r["seq_id"] for r in sequences if r["event"] == "admit" and r["step"] >= 0}
    rewarded = {r["seq_id"] for r in sequences if r["event"] == "reward" and r["step"] >= 0}
    return len(admitted - rewarded)


def step_work(work: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """`step_overhead_s` (mean seconds a Step took beyond its engine iterations) and
    `first_step_s` (mean seconds of the first Step an engine ran), per role."""
    over: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}
    for r in work:
        if r["role"] == TRAINING:
            continue
        over.setdefault(r["role"], []).append(max(0.0, r["seconds"] - r["engine_s"]))
        if r["first"] == 1:
            first.setdefault(r["role"], []).append(r["seconds"])
    return ({k: statistics.fmean(v) for k, v in sorted(over.items())},
            {k: statistics.fmean(v) for k, v in sorted(first.items())})


def summary(rows: dict[str, list[dict]], meta: dict[str, Any]) -> dict[str, Any]:
    """Every summary figure that the trace determines (docs/trace.md, "Summary figures")."""
    steps, work, seqs = rows["steps"], rows["work"], rows["sequences"]
    end = end_s(rows)
    trained = sum(s["tokens"] for s in steps)
    role_tokens = Counter()
    for r in work:
        role_tokens[r["role"]] += r["tokens"]
    overhead, first = step_work(work)
    n = gpus(rows)
    first_token = next((r["t"] for r in work if r["role"] != TRAINING and r["tokens"] > 0),
                       None)
    prepared = [e["t"] for e in rows["events"] if e["kind"] == "prepare"]
    start = rows["start"][0] if rows["start"] else {"held_s": 0.0}
    out: dict[str, Any] = {
        "trained_tokens": trained,
        "shifts": sum(len(devices_of(r["devices"])) for r in rows["shifts"]
                      if r["direction"] == "up"),
        "shifts_by_kind": shift_kinds(rows["shifts"]),
        "shift_seconds": shift_seconds(rows["shifts"]),
        "reward_per_step": [{"step": s["step"], "t": s["t"], "reward": s["reward_mean"]}
                            for s in steps],
        "max_lag": max([0] + [s["max_lag"] for s in steps]),
        "staleness_held_s": start["held_s"] + sum(a["held_s"] for a in rows["admission"]),
        "in_flight_at_end": in_flight(seqs),
        "step_overhead_s": overhead, "first_step_s": first,
        "migrations": sum(r["event"] == "migrate" for r in seqs),
        "prebuilt_s": max(prepared) if n is not None and len(prepared) == n else None,
        "validation": [{"step": int(m[1]), "accuracy": float(m[2])} for m in
                       (VALIDATION.match(e["message"]) for e in rows["events"]) if m],
    }
    if "tau" in start:
        out["tau_shift"] = tau_shift(rows["shifts"], start["tau"], start["tau_counts"])
    if end is not None:
        out.update({
            "seconds": end, "steps": steps[-1]["step"] + 1,
            "tokens_per_s": trained / end if end > 0 else 0.0,
            "role_tokens_per_s": {r: role_tokens[r] / end if end > 0 else 0.0
                                  for r in GEN_ROLES},
            "steady_tokens_per_s": (trained / (end - first_token) if first_token is not None
                                    and end > first_token else None),
        })
        if n and end > 0:
            busy = sum(r["seconds"] * r["devices"] for r in work)
            out["idle_fraction"] = max(0.0, 1.0 - busy / (n * end))
    return out
