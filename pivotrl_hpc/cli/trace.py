"""`pivotrl trace check TRACE...`: the invariants of docs/trace.md on a trace, one line each;
exit 0 when every one holds, 1 on any violation, 2 when a trace cannot be read."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    c = sub.add_parser("check", help="check a trace's invariants (docs/trace.md)",
                       description="check a trace's invariants (docs/trace.md)")
    c.add_argument("traces", nargs="+", metavar="TRACE", help="HDF5 trace(s), live or simulated")


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.trace.check import check

    worst = 0
    for path in map(Path, args.traces):
        if not path.is_file():
            print(f"pivotrl trace check: no trace at {path}", file=sys.stderr)
            return 2
        try:
            results = check(path)
        except (OSError, KeyError, ValueError) as e:
            print(f"pivotrl trace check: {path} is not a readable trace: {e}", file=sys.stderr)
            return 2
        print(f"{path}:")
        for r in results:
            print(f"  {r.line()}")
        worst = max(worst, 0 if all(r.ok for r in results) else 1)
    return worst
