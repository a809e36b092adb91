"""What each device did over a run, rebuilt from a trace's `shifts` and `timeseries` tables.

A `shifts` row is one replica's shift, stamped when it ended (`t`) and lasting `seconds`. A
shift up of role R on devices D makes D hold R from its end; a shift down releases them at
its start (R still held them while it aborted and stopped) and leaves them idle from its end.
Between shifts a device keeps what it holds, so the timeline of every device covers the run
from 0 to its end without gaps: spans of a role, of `idle`, and shift spans with phases.
Pure: numpy arrays and dicts in, dataclasses out (no h5py, no matplotlib).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IDLE = "idle"
ROLES = ("rollout", "reward", "training")
LOW_FRACTION = 0.2   # Figure 3: below 20 % of the role's peak per-device throughput


@dataclass(frozen=True)
class Span:
    device: int
    start: float
    end: float
    what: str                  # a role, "idle", or "shift up <role>" / "shift down <role>"
    phases: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _devices(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def device_spans(shifts: dict[str, np.ndarray], n_devices: int, end: float) -> list[Span]:
    """Every device's spans over [0, end], in time order per device."""
    order = np.argsort(shifts["t"] - shifts["seconds"], kind="stable") if len(shifts["t"]) \
        else []
    holds = {d: (IDLE, 0.0) for d in range(n_devices)}   # device -> (what, since)
    spans: list[Span] = []

    def close(d: int, at: float) -> None:
        what, since = holds[d]
        if at > since:
            spans.append(Span(d, since, at, what))

    for i in order:
        t1 = float(shifts["t"][i])
        t0 = t1 - float(shifts["seconds"][i])
        role, up = str(shifts["role"][i]), str(shifts["direction"][i]) == "up"
        for d in _devices(shifts["devices"][i]):
            if d not in holds:
                continue
            # Times are the controller's: a multi-device shift down ends when the last
            # device replied, and the next shift up of a device that finished first may
            # have begun (measured: up to 0.2 s). A device does one thing: clip to it.
            start = max(t0, holds[d][1])
            close(d, start)
            spans.append(Span(d, start, max(t1, start), f"shift {'up' if up else 'down'} {role}",
                              dict(shifts["phases"][i] or {})))
            holds[d] = (role if up else IDLE, max(t1, start))
    for d in range(n_devices):
        close(d, max(end, holds[d][1]))
    return sorted(spans, key=lambda s: (s.device, s.start))


def seconds_by_role(spans: list[Span]) -> dict[str, float]:
    """Device-seconds per role, idle and shifting ("shift" for every shift span)."""
    out: dict[str, float] = {}
    for s in spans:
        key = "shift" if s.what.startswith("shift ") else s.what
        out[key] = out.get(key, 0.0) + s.seconds
    return out


def role_series(ts: dict[str, np.ndarray], role: str) -> dict[str, np.ndarray]:
    """The `timeseries` rows of one role, in time order."""
    keep = ts["role"] == role
    order = np.argsort(ts["t"][keep], kind="stable")
    return {k: np.asarray(v)[keep][order] for k, v in ts.items()}


def low_throughput_fraction(ts: dict[str, np.ndarray], role: str,
                            low: float = LOW_FRACTION) -> float | None:
    """Figure 3: the fraction of the time the role held devices during which its per-device
    throughput was below `low` x its peak. Each row covers the interval since the previous
    one. None if the role never held a device or never produced a token."""
    r = role_series(ts, role)
    if len(r["t"]) < 2:
        return None
    dt = np.diff(r["t"])
    devices = r["devices"][1:]
    held = devices > 0
    per_device = np.where(held, r["tokens_per_s"][1:] / np.maximum(devices, 1), 0.0)
    peak = per_device[held].max() if held.any() else 0.0
    if peak <= 0:
        return None
    total = dt[held].sum()
    return float(dt[held & (per_device < low * peak)].sum() / total) if total > 0 else None


def training_idle_fraction(ts: dict[str, np.ndarray], steps: dict[str, np.ndarray]
                           ) -> float | None:
    """Figure 3 for training, whose tokens all land when a step ends: the fraction of the
    time it held devices (its `timeseries` rows) during which no step ran (the `steps`
    rows: each ran for `seconds` up to `t`). None if it never held a device."""
    r = role_series(ts, "training")
    if len(r["t"]) < 2:
        return None
    lo, hi, held = r["t"][:-1], r["t"][1:], r["devices"][1:] > 0
    total = float((hi - lo)[held].sum())
    if total <= 0:
        return None
    busy = sum(float(np.clip(np.minimum(hi, end) - np.maximum(lo, end - s), 0, None)[held].sum())
               for end, s in zip(steps["t"], steps["seconds"]))
    return max(0.0, 1.0 - busy / total)


def low_fractions(ts: dict[str, np.ndarray], steps: dict[str, np.ndarray]
                  ) -> dict[str, float | None]:
    """Figure 3's fraction for each role."""
    return {"rollout": low_throughput_fraction(ts, "rollout"),
            "reward": low_throughput_fraction(ts, "reward"),
            "training": training_idle_fraction(ts, steps)}


def group_of(phase: str, phases) -> str | None:
    """The group `X` whose `X.total` is among `phases` and of which `phase` is a part
    (`X.<part>`), else None. Groups are the worker's nested phases (protocol/context.py)."""
    for g in phases:
        if g.endswith(".total"):
            name = g[:-len(".total")]
            if phase.startswith(name + ".") and phase != g:
                return name
    return None


def shift_phase_means(shifts: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per `<direction> <role>`: count, mean seconds and mean seconds of each phase."""
    out: dict[str, dict] = {}
    for i in range(len(shifts["t"])):
        key = f"{shifts['direction'][i]} {shifts['role'][i]}"
        acc = out.setdefault(key, {"count": 0, "seconds": 0.0, "phases": {}})
        acc["count"] += 1
        acc["seconds"] += float(shifts["seconds"][i])
        for p, v in (shifts["phases"][i] or {}).items():
            if p != "total":
                acc["phases"][p] = acc["phases"].get(p, 0.0) + float(v)
    for acc in out.values():
        n = acc["count"]
        acc["mean_s"] = acc.pop("seconds") / n
        acc["phases"] = {p: v / n for p, v in sorted(acc["phases"].items())}
    return dict(sorted(out.items()))
