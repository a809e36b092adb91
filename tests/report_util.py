"""Checks of a `pivotrl report` folder that hold for any trace (live or written by a test)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PNGS = ("allocation.png", "low_throughput.png", "steps.png", "shift_phases.png")


def check_png(path: Path) -> None:
    """More than a blank canvas: over 5 KB and more than two colours."""
    from PIL import Image

    assert path.stat().st_size > 5_000, path.name
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 2, f"{path.name} is one colour"


def check_report(out: Path, n_devices: int) -> dict:
    """Non-trivial PNGs, a Chrome trace with one track per device whose slices nest; returns
    the parsed Perfetto JSON."""
    for name in PNGS:
        check_png(out / name)
    chrome = json.loads((out / "timeline.perfetto.json").read_text())
    events = chrome["traceEvents"]
    tracks = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == set(range(n_devices))
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(e["dur"] >= 0 and e["tid"] in tracks for e in slices)
    for tid in tracks:   # role spans of a device follow each other without overlap
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices
                       if e["tid"] == tid and e["cat"] in ("role", "shift"))
        assert all(b[0] >= a[1] - 1 for a, b in zip(spans, spans[1:])), tid
    shifts = [e for e in slices if e["cat"] == "shift"]
    for p in (e for e in slices if e["cat"] == "phase"):   # every phase inside its shift
        assert any(s["tid"] == p["tid"] and s["ts"] - 1 <= p["ts"]
                   and p["ts"] + p["dur"] <= s["ts"] + s["dur"] + 1 for s in shifts), p
    assert (out / "summary.md").read_text().startswith("# Run report")
    return chrome
