"""`pivotrl doctor [--json]`: is every real component here, and how to fix what is not."""
from __future__ import annotations

import argparse
import json
import sys

from pivotrl_hpc.launch.doctor import run_checks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--shm-min-gb", type=float, default=1.0,
                   help="smallest /dev/shm that counts as ok")


def main(args: argparse.Namespace) -> int:
    results = run_checks(shm_min_gb=args.shm_min_gb)
    if args.json:
        json.dump({name: r.as_dict() for name, r in results.items()}, sys.stdout, indent=2)
        print()
    else:
        width = max(map(len, results))
        for name, r in results.items():
            mark = "ok  " if r.ok else "FAIL"
            print(f"{mark} {name:<{width}}  {r.version or '-':<14} {r.detail}")
        bad = [n for n, r in results.items() if not r.ok]
        print(f"\n{len(results) - len(bad)}/{len(results)} components ok"
              + (f"; fix: {', '.join(bad)}" if bad else ""))
    return 0 if all(r.ok for r in results.values()) else 1
