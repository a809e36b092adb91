"""`pivotrl resume RUN_FOLDER [key=value ...] [--time M] [--wait]`: continue a Slurm run that
was cancelled, timed out or failed, in its own run folder, from its newest whole checkpoint
(submitit, like `pivotrl submit`). The job runs the run's resolved config
(`<name>.config.json`) with `resume=RUN_FOLDER`: its trace gets the next segment
(`<name>.segK.h5`), its checkpoints and logs stay together; extra overrides may extend it
(`rl.steps=40`). A run without a checkpoint, or a folder that is no run: one line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pivotrl_hpc.cli.submit import add_slurm_arguments, report, slurm_options
from pivotrl_hpc.launch.diagnose import BAD_INPUT, bad_input


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN_FOLDER",
                        help="the run folder (runs/<job name>-<job id>) of the job to continue")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.steps=40")
    add_slurm_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.launch.layout import LaunchError
    from pivotrl_hpc.launch.submit import environment_note, submit

    note = environment_note()
    if note:
        print(f"pivotrl resume: {note}", file=sys.stderr)
        return 2
    run = Path(args.run).resolve()
    try:
        configs = sorted(run.glob("*.config.json")) if run.is_dir() else []
        if len(configs) != 1:
            raise LaunchError(f"{args.run} is not a run folder (expected one <name>.config.json "
                              f"in it, found {len(configs)})")
        job_name = run.name.rsplit("-", 1)[0] if "-" in run.name else run.name
        job = submit(configs[0], [*args.overrides, f"resume={run}"], runs_root=run.parent,
                     cpus_per_gpu=args.cpus_per_gpu, job_name=job_name, **slurm_options(args))
    except BAD_INPUT as e:
        print(f"pivotrl resume: {bad_input(e, configs[0] if configs else args.run)}",
              file=sys.stderr)
        return 2
    return report(job, run, args.wait, "resume")
