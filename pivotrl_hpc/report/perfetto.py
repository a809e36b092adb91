"""A run as a Chrome trace (JSON object format), which ui.perfetto.dev and chrome://tracing
open: one track per device with its role over time, shifts as slices, their phases nested
inside in the order they ran, and one counter track per role with its tokens/s.

Phase names come from the worker (`protocol/context.py`): `<context kind>.<phase>`, and a group
`X.total` with parts `X.<part>` (e.g. `offloadable.reload.total` with `...reload.grads`). Top
phases are laid end to end from the shift's start; a group's parts inside its slice.
"""
from __future__ import annotations

import numpy as np

from pivotrl_hpc.report.timeline import ROLES, Span, group_of, role_series

PID_DEVICES, PID_ROLES = 1, 2
US = 1e6


def _meta(pid: int, tid: int | None, name: str, kind: str) -> dict:
    ev = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _slice(tid: int, name: str, start: float, seconds: float, cat: str, args=None) -> dict:
    ev = {"ph": "X", "pid": PID_DEVICES, "tid": tid, "name": name, "cat": cat,
          "ts": round(start * US, 3), "dur": round(max(seconds, 0.0) * US, 3)}
    if args:
        ev["args"] = args
    return ev


def _phase_slices(span: Span) -> list[dict]:
    """The shift's phases as slices nested in it (durations clipped to the shift)."""
    phases = {k: float(v) for k, v in span.phases.items() if k != "total"}
    out, at = [], span.start
    for k, v in phases.items():
        if group_of(k, phases) is not None:
            continue
        v = min(v, span.end - at)
        name = k[:-len(".total")] if k.endswith(".total") else k
        out.append(_slice(span.device, name, at, v, "phase"))
        if k.endswith(".total"):
            inner = at
            for p, pv in phases.items():
                if group_of(p, phases) == name:
                    pv = min(pv, at + v - inner)
                    out.append(_slice(span.device, p[len(name) + 1:], inner, pv, "phase"))
                    inner += pv
        at += v
    return out


def chrome_trace(spans: list[Span], ts: dict[str, np.ndarray], meta: dict) -> dict:
    events = [_meta(PID_DEVICES, None, "devices", "process_name"),
              _meta(PID_ROLES, None, "roles", "process_name")]
    ranks = meta.get("device_ranks", {})
    for d in sorted({s.device for s in spans}):
        rank = ranks.get(str(d))
        label = f"device {d}" + (f" (rank {rank})" if rank is not None else "")
        events += [_meta(PID_DEVICES, d, label, "thread_name"),
                   {"ph": "M", "pid": PID_DEVICES, "tid": d, "name": "thread_sort_index",
                    "args": {"sort_index": d}}]
    for s in spans:
        if s.what.startswith("shift "):
            events.append(_slice(s.device, s.what, s.start, s.seconds, "shift",
                                 {k: round(float(v), 4) for k, v in s.phases.items()}))
            events += _phase_slices(s)
        else:
            events.append(_slice(s.device, s.what, s.start, s.seconds, "role"))
    for role in ROLES:
        r = role_series(ts, role)
        for t, tps, dev in zip(r["t"], r["tokens_per_s"], r["devices"]):
            events.append({"ph": "C", "pid": PID_ROLES, "name": f"{role} tokens/s",
                           "ts": round(float(t) * US, 3),
                           "args": {"tokens/s": float(tps), "devices": int(dev)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"paradigm": meta.get("paradigm", ""), "source": "pivotrl report"}}
