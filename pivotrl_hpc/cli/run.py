"""`pivotrl run CONFIG [key=value ...]`: run an RL job on this machine with mpirun.

Every check runs before any process starts (config, overrides, files, CPU shares, cgroups);
a failing one prints one line saying what to change and exits 2. Then the MPI world starts
in the layout of `launch/layout.py`; stdout shows the controller's progress and the summary,
each rank logs into <trace>.logs/rank-N.log. Exit: 0 done, 1 failed (the rank is named),
128+signal when stopped by Ctrl-C / SIGTERM.
"""
from __future__ import annotations

import argparse
import sys

from pivotrl_hpc.launch.diagnose import BAD_INPUT, bad_input
from pivotrl_hpc.config import load_config
from pivotrl_hpc.launch.preflight import preflight
from pivotrl_hpc.launch.resume import complete, continue_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (configs/tiny-cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.steps=3")
    parser.add_argument("--dry-run", action="store_true",
                        help="check, print the mpirun command and the rank layout, start nothing")
    parser.add_argument("--np-check", action="store_true",
                        help="start the MPI world once with a probe (no job) and check that "
                             "every rank of the layout answers")
    parser.add_argument("--no-cpu-cap", action="store_true",
                        help="do not cap emulated devices with cgroup CPU quotas (when cgroups "
                             "are not writable; paradigm comparisons then mean nothing)")


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.launch import local

    try:
        cfg = load_config(args.config, args.overrides)
        if not (args.dry_run or args.np_check) and (done := complete(cfg)) is not None:
            print(f"pivotrl run: {done}")   # before the task is built or any rank starts
            return 0
        preflight(cfg)
        run = local.prepare(cfg, cpu_cap=not args.no_cpu_cap)
    except BAD_INPUT as e:
        print(f"pivotrl run: {bad_input(e, args.config)}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(run.shell_line())
        print(run.layout.describe())
        print(f"run folder: {run.paths.logs}")
        return 0
    if args.np_check:
        ok, message = local.np_check(run)
        print(f"np check {'ok' if ok else 'FAILED'}: {message}")
        return 0 if ok else 1
    code = local.launch(run)
    if code > 128:   # stopped by a signal (Ctrl-C): how to go on
        print(f"pivotrl run: {continue_line(args.config, args.overrides, run.paths.trace)}",
              file=sys.stderr)
    return code
