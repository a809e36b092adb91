"""`pivotrl trace check TRACE`: the invariants of docs/trace.md ("Invariants"), each checked
from the trace's rows alone. `check(path)` returns one `Result` per invariant.

Every check collects its violations (at most `SHOWN` are named) instead of stopping at the
first, so a broken trace says everything that is wrong with it in one run.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pivotrl_hpc.trace import recompute
from pivotrl_hpc.trace.recompute import GEN_ROLES, TRAINING, devices_of
from pivotrl_hpc.trace.schema import TABLES

SHOWN = 5
REL = 1e-9          # float figures agree to this relative (and absolute) tolerance


@dataclass
class Result:
    name: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        if self.ok:
            return f"ok    {self.name}"
        more = f" (+{len(self.problems) - SHOWN} more)" if len(self.problems) > SHOWN else ""
        return f"FAIL  {self.name}: " + "; ".join(self.problems[:SHOWN]) + more


def read(path: str | Path) -> tuple[dict[str, list[dict]], dict, dict | None, dict]:
    """(rows by table, meta, summary, the file's schema)."""
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(path)) as t:
        rows = {}
        for name in t.tables:
            cols = t.table(name)
            rows[name] = [dict(zip(cols, vals)) for vals in zip(*cols.values())]
        return rows, t.meta, t.summary, t.schema


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=REL)


# --- the invariants --------------------------------------------------------------------
def schema(rows, meta, summary, file_schema) -> list[str]:
    """The file's tables and columns are the documented ones."""
    out = []
    for table, cols in TABLES.items():
        got = file_schema.get(table)
        if got != cols:
            out.append(f"table {table}: {'missing' if got is None else got} != {cols}")
    return out


def numbering(rows, meta, summary, _schema) -> list[str]:
    """Steps count up by one, version = step + 1; plan ids are 0, 1, 2, ... in row order and
    every shift names an executed planner row."""
    out = []
    steps = rows["steps"]
    for a, b in zip(steps, steps[1:]):
        if b["step"] != a["step"] + 1:
            out.append(f"steps.step {a['step']} then {b['step']}")
    out += [f"step {s['step']} has version {s['version']}" for s in steps
            if s["version"] != s["step"] + 1]
    ids = [p["plan_id"] for p in rows["planner"]]
    if ids != list(range(len(ids))):
        out.append(f"planner.plan_id {ids[:8]}... is not 0, 1, 2, ...")
    executed = {p["plan_id"] for p in rows["planner"] if p["executed"] == 1}
    out += [f"shift {s['direction']} {s['replica']} at {s['t']:.3f} names plan "
            f"{s['plan_id']}, not an executed planner row" for s in rows["shifts"]
            if s["plan_id"] not in executed]
    return out


def tokens(rows, meta, summary, _schema) -> list[str]:
    """Tokens are conserved per sequence, per step and per role."""
    out = _per_sequence_tokens(rows["sequences"])
    out += _per_step_tokens(rows)
    out += _per_role_tokens(rows)
    return out


def _per_sequence_tokens(seqs: list[dict]) -> list[str]:
    out, last = [], {}
    for r in seqs:
        key = (r["role"], r["seq_id"])
        if r["event"] == "abort":
            # the tokens kept where it left: never more than it holds later
            continue
        if r["tokens"] < last.get(key, 0):
            out.append(f"{key[0]} {key[1]} {r['event']} at {r['t']:.3f} with {r['tokens']} "
                       f"tokens after {last[key]}")
        last[key] = r["tokens"]
    kept = {}
    for r in reversed(seqs):   # an abort's tokens <= every later row's of its sequence
        key = (r["role"], r["seq_id"])
        if r["event"] == "abort" and key in kept and r["tokens"] > kept[key]:
            out.append(f"{key[0]} {key[1]} aborted on {r['replica']} with {r['tokens']} "
                       f"tokens, resumed from {kept[key]}")
        elif r["event"] != "abort":
            kept[key] = r["tokens"]
    return out


def _per_step_tokens(rows) -> list[str]:
    out = []
    finish = {r["seq_id"]: r for r in rows["sequences"]
              if r["event"] == "finish" and r["role"] == "rollout"}
    trains = defaultdict(list)
    for r in rows["sequences"]:
        if r["event"] == "train":
            trains[r["step"]].append(r)
            f = finish.get(r["seq_id"])
            if f is not None and (f["tokens"], f["prompt_tokens"]) != (r["tokens"],
                                                                      r["prompt_tokens"]):
                out.append(f"sample {r['seq_id']} trained with {r['tokens']} tokens, "
                           f"finished with {f['tokens']}")
    for s in rows["steps"]:
        tr = trains.get(s["step"], [])
        total = sum(r["tokens"] + r["prompt_tokens"] for r in tr)
        if (len(tr), total) != (s["samples"], s["tokens"]):
            out.append(f"step {s['step']}: {s['samples']} samples, {s['tokens']} tokens; its "
                       f"train rows {len(tr)} samples, {total} tokens")
    return out


def _landed(rows, role: str) -> list[tuple[float, int]]:
    if role == TRAINING:
        return [(s["t"], s["tokens"]) for s in rows["steps"]]
    return [(w["t"], w["tokens"]) for w in rows["work"] if w["role"] == role]


def _per_role_tokens(rows) -> list[str]:
    out = []
    for role in (*GEN_ROLES, TRAINING):
        landed, i, total, prev = _landed(rows, role), 0, 0, 0.0
        for ts in (r for r in rows["timeseries"] if r["role"] == role):
            window = 0
            while i < len(landed) and landed[i][0] <= ts["t"]:
                window += landed[i][1]
                i += 1
            total += window
            rate = window / max(ts["t"] - prev, 1e-9)
            if ts["tokens_total"] != total or not _close(ts["tokens_per_s"], rate):
                out.append(f"{role} at {ts['t']:.3f}: tokens_total {ts['tokens_total']}, "
                           f"tokens_per_s {ts['tokens_per_s']:.3f}; rows {total}, {rate:.3f}")
            prev = ts["t"]
        if role in GEN_ROLES:
            done = sum(r["tokens"] for r in rows["sequences"]
                       if r["role"] == role and r["event"] == "finish")
            work = sum(n for _, n in landed)
            if done > work:
                out.append(f"{role}: finished sequences hold {done} tokens, Steps made {work}")
    return out


def finishes(rows, meta, summary, _schema) -> list[str]:
    """Each sequence finishes at most once, nothing places it after; in a fresh run every
    trained sample was rolled out and judged."""
    out, done = [], set()
    for r in rows["sequences"]:
        key = (r["role"], r["seq_id"])
        if r["event"] in ("dispatch", "migrate", "preempt", "finish") and key in done:
            out.append(f"{key[0]} {key[1]}: {r['event']} at {r['t']:.3f} after its finish")
        done |= {key} if r["event"] == "finish" else set()
    if not meta.get("resumed_from"):
        for r in rows["sequences"]:
            if r["event"] == "train":
                missing = [role for role in GEN_ROLES if (role, r["seq_id"]) not in done]
                if missing:
                    out.append(f"sample {r['seq_id']} trained without a {missing} finish")
    return out


def placement(rows, meta, summary, _schema) -> list[str]:
    """The controller places a sequence on one replica at a time; a replica it left
    (`migrate`, `preempt`) lets it go (`abort`) before answering a second Step."""
    out, owner = [], {}
    leaving: dict[tuple, list[float]] = defaultdict(list)   # (role, sid, replica) -> times
    for r in rows["sequences"]:
        key, ev, rep = (r["role"], r["seq_id"]), r["event"], r["replica"]
        here = owner.get(key)
        if ev == "dispatch" and here is not None or ev == "migrate" and here in (None, rep) \
                or ev in ("preempt", "finish") and here != rep:
            out.append(f"{key[0]} {key[1]}: {ev} on {rep!r} at {r['t']:.3f} while placed "
                       f"on {here!r}")
        if ev in ("migrate", "preempt") and here is not None:
            leaving[(*key, here)].append(r["t"])
        if ev == "abort":
            if not leaving[(*key, rep)]:
                out.append(f"{key[0]} {key[1]}: abort on {rep!r} at {r['t']:.3f}, which it "
                           f"did not leave")
                continue
            out += _window(rows["work"], key, rep, leaving[(*key, rep)].pop(0), r["t"])
        if ev in ("dispatch", "migrate"):
            owner[key] = rep
        elif ev in ("preempt", "finish"):
            owner[key] = None
    end = max((w["t"] for w in rows["work"]), default=0.0)
    for (role, sid, rep), times in leaving.items():
        out += [p for t in times for p in _window(rows["work"], (role, sid), rep, t, end)]
    return out


def _window(work: list[dict], key: tuple, replica: str, left: float, let_go: float
            ) -> list[str]:
    steps = sum(1 for w in work if w["replica"] == replica and left < w["t"] <= let_go)
    if steps <= 1:
        return []
    return [f"{key[0]} {key[1]} left {replica} at {left:.3f}, which answered {steps} Steps "
            f"before letting it go at {let_go:.3f}"]


def staleness(rows, meta, summary, _schema) -> list[str]:
    """Lag <= k at admission (against the oldest version a rollout replica serves, which
    is never newer than the published one) and at training."""
    k = rows["start"][0]["staleness"] if rows["start"] else None
    if k is None or k < 0:
        return ["no start row with the staleness bound k"]
    out = [f"sample {r['seq_id']} of step {r['step']} admitted against v{r['version']}"
           for r in rows["sequences"] if r["event"] == "admit" and r["role"] == "rollout"
           and r["step"] >= 0 and r["version"] >= 0 and r["step"] - r["version"] > k]
    lags = defaultdict(list)
    for r in rows["sequences"]:
        if r["event"] == "train":
            lags[r["step"]].append(r["step"] - r["version"])
    for s in rows["steps"]:
        worst = max(lags[s["step"]], default=None)
        if worst is not None and worst > k or s["max_lag"] > k:
            out.append(f"step {s['step']}: lag {worst} (max_lag {s['max_lag']}) > k = {k}")
        elif worst is not None and s["max_lag"] != worst:
            out.append(f"step {s['step']}: max_lag {s['max_lag']}, its train rows {worst}")
    return out + _admission_versions(rows)


def _admission_versions(rows) -> list[str]:
    """Replays who serves what: a rollout replica serves from its shift up (shifts.version),
    each reload moves it on, it stops when the plan that shifts it down starts."""
    plan_t = {p["plan_id"]: p["t"] for p in rows["planner"]}
    events = [(s["t"], 0, "up", s["replica"], s["version"]) for s in rows["shifts"]
              if s["role"] == "rollout" and s["direction"] == "up"]
    events += [(plan_t.get(s["plan_id"], s["t"]), 0, "down", s["replica"], -1)
               for s in rows["shifts"] if s["role"] == "rollout" and s["direction"] == "down"]
    # A shift down stops the replica serving when its plan executes; its shifts row comes
    # when the workers answer, which a cancelled job may never see (a Slurm cancel with a
    # shift down in flight left v1 "served" under an admission against v2).
    events += [(p["t"], 0, "down", rid, -1) for p in rows["planner"]
               for rid in _executed_downs(p)]
    events += [(r["t"], 0, "reload", r["replica"], r["version"]) for r in rows["reloads"]]
    events += [(g["t"], 0, "publish", "", g["version"]) for g in rows["gps"]
               if g["op"] == "write"]
    events += [(a["t"], 1, "admit", "", a) for a in rows["admission"]]
    served: dict[str, int] = {}
    published, out = (rows["start"][0]["version"] if rows["start"] else None), []
    for t, _, kind, rep, v in sorted(events, key=lambda e: e[:2]):
        if kind in ("up", "reload"):
            served[rep] = v
        elif kind == "down":
            served.pop(rep, None)
        elif kind == "publish":
            published = v
        else:
            oldest = min([x for x in served.values() if x >= 0] + [v["published"]])
            if v["version"] != oldest or published is not None and v["published"] != published:
                out.append(f"admission at {t:.3f} against v{v['version']} (published "
                           f"v{v['published']}); the trace has v{oldest} served, "
                           f"v{published} published")
    return out


def _executed_downs(plan: dict) -> list[str]:
    """The replicas an executed planner row shifted down (its chosen candidate's)."""
    cands, chosen = plan.get("candidates", []), plan.get("chosen", -1)
    if not plan.get("executed") or not 0 <= chosen < len(cands):
        return []
    return list(cands[chosen].get("shift_down", []))


def roles(rows, meta, summary, _schema) -> list[str]:
    """A device holds one role at a time: shifted up only when idle, down only from the
    role it holds (shifts rows in the order written). A multi-device shift down's row comes
    when its last device answered; a device that answered first may be up in its next role
    before it: allowed when that down's plan started before the up ended, or, where the
    trace ends before that row (a job stopped with the down in flight), when the up's own
    executed plan shifts the held replica down."""
    shifts = rows["shifts"]
    plans = {p["plan_id"]: p for p in rows["planner"]}
    held: dict[int, dict] = {}            # device -> the up row of the replica it holds
    early: set[tuple[int, int]] = set()   # (row index of a down, device) already let go
    out = []
    for i, s in enumerate(shifts):
        for d in devices_of(s["devices"]):
            up = held.get(d)
            now = up["role"] if up else ""
            if s["direction"] == "down" and (i, d) in early:
                continue
            if s["direction"] == "up" and now:
                j = _next_row_of(shifts, i, d)
                if j is not None and _releases(shifts[j], now, plans, s["t"]):
                    early.add((j, d))
                    now = ""
                elif j is None and up["replica"] in _executed_downs(plans.get(s["plan_id"], {})):
                    now = ""
            if s["direction"] == "up" and now or s["direction"] == "down" and now != s["role"]:
                out.append(f"device {d}: shift {s['direction']} {s['role']} at {s['t']:.3f} "
                           f"while it holds {now or 'nothing'}")
            held[d] = s if s["direction"] == "up" else None
    return out


def _next_row_of(shifts: list[dict], i: int, device: int) -> int | None:
    """The index of the first shifts row after row `i` on `device` (None: the trace ends)."""
    return next((j for j in range(i + 1, len(shifts))
                 if device in devices_of(shifts[j]["devices"])), None)


def _releases(down: dict, role: str, plans: dict[int, dict], up_t: float) -> bool:
    """`down` is the shift down of `role` whose plan started before an up that ended at
    `up_t` on one of its devices."""
    plan = plans.get(down["plan_id"])
    return (down["direction"] == "down" and down["role"] == role
            and plan is not None and plan["t"] <= up_t)


def figures(rows, meta, summary, _schema) -> list[str]:
    """Every summary figure equals its recomputation from the rows (trace.recompute)."""
    if summary is None:
        return []   # a run still going, or one that died: nothing to compare
    if "error" in summary and "steps" not in summary:
        return [f"the run ended with an error: {summary['error']}"]
    want = recompute.summary(rows, meta)
    out = []
    for key, value in want.items():
        if key not in summary:
            if value is not None and key not in OPTIONAL:
                out.append(f"{key}: missing from the summary (rows give {value!r})")
            continue
        got = summary[key]
        if key == "validation":
            got = [{"step": v["step"], "accuracy": round(v["accuracy"], 3)} for v in got]
        if not _same(got, value):
            out.append(f"{key}: summary {got!r}, rows {value!r}")
    if "unparsed_genrm" in summary and summary["unparsed_genrm"] < sum(
            s["unparsed"] for s in rows["steps"]):
        out.append(f"unparsed_genrm {summary['unparsed_genrm']} < the steps' unparsed")
    return out


OPTIONAL = ("migrations",)   # figures a summary written before they existed lacks


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
            and not isinstance(a, bool) and not isinstance(b, bool):
        return _close(float(a), float(b))
    return a == b


INVARIANTS: tuple[tuple[str, Callable[..., list[str]]], ...] = (
    ("schema: tables and columns as documented", schema),
    ("numbering: steps, versions and plan ids", numbering),
    ("tokens: conserved per sequence, per step and per role", tokens),
    ("finish: one per sequence", finishes),
    ("placement: one replica at a time, beyond the Abort window", placement),
    ("staleness: lag <= k at admission and at training", staleness),
    ("roles: a device in one role at a time", roles),
    ("summary: every figure equals its recomputation", figures),
)


def check(path: str | Path) -> list[Result]:
    """Every invariant of docs/trace.md on the trace at `path`, one Result each. A trace
    written before a table existed fails `schema` and is checked no further."""
    rows, meta, summary, file_schema = read(path)
    results = [Result(INVARIANTS[0][0], schema(rows, meta, summary, file_schema))]
    if not results[0].ok:
        return results
    for name, fn in INVARIANTS[1:]:
        results.append(Result(name, fn(rows, meta, summary, file_schema)))
    return results
