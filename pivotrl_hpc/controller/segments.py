"""One run across its segments: each start of a resumed job writes the run's next trace
segment (x.h5, x.seg1.h5, ...) and its own numbers; the summary written at the end also
covers the earlier segments, read from the summaries their traces stored.

`segments` lists every segment (trace, steps trained in it, seconds, tokens); `run` sums
them: the steps trained in all, their seconds and tokens, the reward of every step. A
segment that stopped without a summary (killed) is listed with `summary: false`."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _stored(trace: Path) -> dict[str, Any] | None:
    from pivotrl_hpc.trace import open_trace

    try:
        with open_trace(str(trace)) as t:
            return t.summary
    except (OSError, KeyError, ValueError) as e:
        log.warning("segment %s: no readable summary (%s)", trace, e)
        return None


def _row(trace: Path, s: dict[str, Any] | None) -> dict[str, Any]:
    if not s:
        return {"trace": str(trace), "summary": False}
    steps = [r["step"] for r in s.get("reward_per_step", [])]
    return {"trace": str(trace), "summary": True, "steps": steps, "seconds": s["seconds"],
            "trained_tokens": s["trained_tokens"]}


def with_segments(summary: dict[str, Any], trace_path: str | Path) -> dict[str, Any]:
    """`summary` (this segment's) with `segments` and `run` over every segment of the run."""
    from pivotrl_hpc.checkpoint.layout import segments

    this = Path(trace_path).resolve()
    found = [(p, summary if p.resolve() == this else _stored(p)) for p in segments(this)]
    if not any(p.resolve() == this for p, _ in found):
        found.append((this, summary))
    rows = [_row(p, s) for p, s in found]
    done = [s for _, s in found if s]
    return {**summary, "segments": rows, "run": {
        "segments": len(rows), "steps": summary["steps"],
        "steps_in_segments": sum(len(r.get("steps", [])) for r in rows),
        "seconds": sum(s["seconds"] for s in done),
        "trained_tokens": sum(s["trained_tokens"] for s in done),
        "reward_per_step": [r for s in done for r in s.get("reward_per_step", [])]}}


def describe(summary: dict[str, Any]) -> str | None:
    """The summary's line for a run of several segments (None: one segment)."""
    run = summary.get("run")
    if not run or run["segments"] < 2:
        return None
    return (f"  run of {run['segments']} segments: {run['steps']} steps trained, "
            f"{run['trained_tokens']} tokens in {run['seconds']:.1f} s of training segments")
