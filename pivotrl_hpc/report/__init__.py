"""`pivotrl report TRACE -o DIR`: a trace (live or simulated) as figures, a Markdown summary
and a Chrome/Perfetto timeline.

    from pivotrl_hpc.report import write_report
    files = write_report("runs/r1/trace.h5", "runs/r1/report")

Writes `summary.md`, `summary.json` (the same numbers), `timeline.perfetto.json`,
`allocation.png`, `low_throughput.png`, `steps.png` and `shift_phases.png`
(figures.py says what each shows). Every number comes from the trace's tables; the run's
own summary is used only for its end time, when the run closed with one.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pivotrl_hpc.report import figures
from pivotrl_hpc.report.perfetto import chrome_trace
from pivotrl_hpc.report.timeline import (device_spans, low_fractions, seconds_by_role,
                                         shift_phase_means)

__all__ = ["write_report", "numbers", "markdown"]


def _end(t) -> float:
    if t.summary and t.summary.get("seconds") is not None:
        return float(t.summary["seconds"])
    ends = [float(np.max(t.table(n)["t"])) for n in t.tables if t.rows(n)]
    return max(ends, default=0.0)


def _n_devices(meta: dict, shifts: dict) -> int:
    cluster = (meta.get("config") or {}).get("cluster") or {}
    if cluster.get("nodes") and cluster.get("devices_per_node"):
        return int(cluster["nodes"]) * int(cluster["devices_per_node"])
    seen = [int(d) for text in shifts["devices"] for d in str(text).split(",") if d.strip()]
    return max(seen, default=-1) + 1


def numbers(t) -> dict:
    """The summary's numbers, from the trace's tables."""
    return _analyse(t)[0]


def _analyse(t) -> tuple[dict, list]:
    shifts, ts, steps = t.table("shifts"), t.table("timeseries"), t.table("steps")
    end, n = _end(t), _n_devices(t.meta, shifts)
    spans = device_spans(shifts, n, end)
    trained = int(steps["tokens"].sum()) if len(steps["t"]) else 0
    rewards = steps["reward_mean"]
    events = t.table("sequences")["event"]
    return {
        "paradigm": t.meta.get("paradigm", ""), "devices": n, "seconds": end,
        "steps": int(len(steps["t"])), "trained_tokens": trained,
        "tokens_per_s": trained / end if end > 0 else 0.0,
        "reward_first": float(rewards[0]) if len(rewards) else None,
        "reward_last": float(rewards[-1]) if len(rewards) else None,
        "max_lag": int(steps["max_lag"].max()) if len(steps["t"]) else None,
        # moves from one replica to another only: a dispatch from the queue is none
        "migrations": int((events == "migrate").sum()),
        "shifts": shift_phase_means(shifts),
        "device_seconds": dict(sorted(seconds_by_role(spans).items())),
        "low_throughput_fraction": low_fractions(ts, steps),
    }, spans


def run_segments(trace_path: str | Path) -> list[dict]:
    """Every segment of the run `trace_path` belongs to (x.h5, x.seg1.h5, ...: each start of
    a resumed job): its trace, steps, seconds and trained tokens."""
    from pivotrl_hpc.checkpoint.layout import segments
    from pivotrl_hpc.trace import open_trace

    out = []
    for path in segments(trace_path):
        with open_trace(str(path)) as t:
            steps = t.table("steps")
            out.append({"trace": path.name, "steps": [int(s) for s in steps["step"]],
                        "seconds": _end(t), "trained_tokens": int(steps["tokens"].sum())})
    return out


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(num: dict) -> str:
    lines = [f"# Run report: {num['paradigm'] or 'run'}", "",
             "| metric | value |", "|---|---|"]
    for key in ("devices", "seconds", "steps", "trained_tokens", "tokens_per_s",
                "reward_first", "reward_last", "max_lag", "migrations"):
        lines.append(f"| {key} | {_f(num[key])} |")
    lines += ["", "| shift | count | mean s |", "|---|---|---|"]
    lines += [f"| {k} | {v['count']} | {_f(v['mean_s'])} |" for k, v in num["shifts"].items()]
    lines += ["", "| role | device-seconds | time below 20 % of peak |", "|---|---|---|"]
    for role, sec in num["device_seconds"].items():
        frac = num["low_throughput_fraction"].get(role)
        lines.append(f"| {role} | {_f(sec, 1)} | {_f(frac)} |")
    segs = num.get("segments", [])
    if len(segs) > 1:   # a resumed run: every start's segment, and the run over them all
        lines += ["", "| segment | steps | seconds | trained_tokens |", "|---|---|---|---|"]
        lines += [f"| {g['trace']} | {_steps(g['steps'])} | {_f(g['seconds'], 1)} | "
                  f"{g['trained_tokens']} |" for g in segs]
        lines.append(f"| run ({len(segs)} segments) | {sum(len(g['steps']) for g in segs)} | "
                     f"{_f(sum(g['seconds'] for g in segs), 1)} | "
                     f"{sum(g['trained_tokens'] for g in segs)} |")
    return "\n".join(lines) + "\n"


def _steps(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else _f(steps[0] if steps else None)


def write_report(trace_path: str | Path, out_dir: str | Path) -> list[Path]:
    from pivotrl_hpc.trace import open_trace

    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open_trace(str(trace_path)) as t:
        num, spans = _analyse(t)
        ts, shifts, steps = t.table("timeseries"), t.table("shifts"), t.table("steps")
        meta = t.meta
    num["segments"] = run_segments(trace_path)
    title = num["paradigm"] or Path(trace_path).stem
    files = {name: out / name for name in (
        "summary.md", "summary.json", "timeline.perfetto.json", "allocation.png",
        "low_throughput.png", "steps.png", "shift_phases.png")}
    files["summary.md"].write_text(markdown(num))
    files["summary.json"].write_text(json.dumps(num, indent=1))
    files["timeline.perfetto.json"].write_text(json.dumps(chrome_trace(spans, ts, meta)))
    figures.allocation(ts, shifts, files["allocation.png"], title)
    figures.low_throughput(num["low_throughput_fraction"], files["low_throughput.png"], title)
    figures.steps(steps, files["steps.png"], title)
    figures.shift_phases(num["shifts"], files["shift_phases.png"], title)
    return list(files.values())
