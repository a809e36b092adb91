"""`pivotrl bench KIND`: each benchmark prints one JSON object on stdout.

Benchmarks live in their own modules (`add_arguments`, `main`); a kind whose issue has not
landed says so and exits 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# kind -> (module, help, pending issue or None)
BENCHES: dict[str, tuple[str, str, str | None]] = {
    "planner": ("pivotrl_hpc.cli.bench_planner", "planner latency vs cluster size", None),
    "dispatch": ("pivotrl_hpc.cli.bench_dispatch", "Dispatch latency", None),
    "gps": ("pivotrl_hpc.cli.bench_gps", "GPS Read/Write/replicate bandwidth", None),
    "shift": ("pivotrl_hpc.cli.bench_shift", "shift up / shift down seconds per role", None),
    "e2e": ("pivotrl_hpc.cli.bench_e2e", "end-to-end RL throughput, paradigm vs paradigm",
            None),
    "soak": ("pivotrl_hpc.cli.bench_soak", "a long job watched for leaks (RSS, fds, shm)",
             None),
    "gpu": ("pivotrl_hpc.cli.bench_gpu", "the GPU path: GPS Read into CUDA, Megatron shifts "
            "(profiling/gpu_check.sh)", None),
    "migration": ("pivotrl_hpc.cli.bench_migration",
                  "Abort, Dispatch, re-prefill seconds a sequence (Table 3)", None),
    "sim": ("pivotrl_hpc.cli.bench_sim", "wall seconds of a simulated RL step at N devices",
            None),
    "codec": ("pivotrl_hpc.cli.bench_codec",
              "the controller/worker wire against pickle on a Step's reply (issue 51)", None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="KIND", required=True)
    for kind, (module, help_, pending) in BENCHES.items():
        p = sub.add_parser(kind, help=help_, description=help_)
        if pending is None:
            importlib.import_module(module).add_arguments(p)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    module, _, pending = BENCHES[args.bench]
    if pending is not None:
        print(f"pivotrl bench {args.bench}: not available yet (arrives with {pending})",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(args) or 0)
