"""`pivotrl report TRACE -o DIR`: figures, a Markdown summary and a Perfetto timeline from a
trace (pivotrl_hpc/report)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="an HDF5 trace of a live or simulated run")
    p.add_argument("-o", "--out", default=None,
                   help="output folder (default: <trace without .h5>.report next to it)")


def main(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    if not trace.is_file():
        print(f"pivotrl report: no trace at {trace}", file=sys.stderr)
        return 2
    from pivotrl_hpc.report import write_report

    out = Path(args.out) if args.out else trace.with_suffix(".report")
    try:
        files = write_report(trace, out)
    except OSError as e:
        print(f"pivotrl report: {trace} is not a readable trace: {e}", file=sys.stderr)
        return 2
    print((out / "summary.md").read_text(), end="")
    for f in files:
        print(f"wrote {f}")
    print(f"open {out / 'timeline.perfetto.json'} in https://ui.perfetto.dev")
    return 0
