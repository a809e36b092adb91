"""`pivotrl submit CONFIG [key=value ...] --nodes N --gpus-per-node G [...]`: submit the RL job
to Slurm (submitit; the batch step runs what `slurm/pivot.sbatch` runs). Prints the job id,
the run folder and submitit's log folder; `--wait` waits and prints the summary (exit 0) or
the error (exit 1). A config that does not load or validate is refused here, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from pivotrl_hpc.launch.diagnose import BAD_INPUT, bad_input


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.steps=10")
    parser.add_argument("--nodes", type=int, help="nodes (default: cluster.nodes)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node (default: cluster.devices_per_node)")
    parser.add_argument("--partition")
    parser.add_argument("--time", type=int, help="time limit in minutes")
    parser.add_argument("--account")
    parser.add_argument("--qos")
    parser.add_argument("--job-name", default="pivotrl")
    parser.add_argument("--cpus-per-gpu", type=int, default=2)
    parser.add_argument("--exclusive", action="store_true", help="whole nodes")
    parser.add_argument("--runs-root", default="runs",
                        help="run folders go to RUNS_ROOT/<job name>-<job id>/ (default runs)")
    parser.add_argument("--wait", action="store_true",
                        help="wait for the job and print its summary (or its error)")


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.launch.submit import environment_note, run_folder, submit

    note = environment_note()
    if note:
        print(f"pivotrl submit: {note}", file=sys.stderr)
        return 2
    options = {k: v for k, v in (("partition", args.partition), ("time", args.time),
                                 ("account", args.account), ("qos", args.qos)) if v}
    if args.exclusive:
        options["exclusive"] = True
    try:
        job = submit(args.config, args.overrides, nodes=args.nodes,
                     gpus_per_node=args.gpus_per_node, runs_root=args.runs_root,
                     cpus_per_gpu=args.cpus_per_gpu, job_name=args.job_name, **options)
    except BAD_INPUT as e:
        print(f"pivotrl submit: {bad_input(e, args.config)}", file=sys.stderr)
        return 2
    folder = run_folder(job, args.runs_root, args.job_name)
    print(f"submitted job {job.job_id}; run folder {folder}; submitit logs {job.paths.folder}")
    if not args.wait:
        return 0
    try:
        summary = job.result()
    except Exception as e:  # noqa: BLE001 - submitit's FailedJobError carries the job's text
        print(f"pivotrl submit: job {job.job_id} failed: {_last_line(str(e))}", file=sys.stderr)
        return 1
    print(json.dumps({k: summary[k] for k in ("steps", "tokens_per_s", "trace", "run_folder")
                      if k in summary}))
    return 0


def _last_line(text: str) -> str:
    """submitit's error holds the remote traceback; its last line is the exception."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text
