"""`pivotrl submit CONFIG [key=value ...] --nodes N --gpus-per-node G [...]`: submit the RL job
to Slurm (submitit; the batch step runs what `slurm/pivot.sbatch` runs). Prints the job id,
the run folder, the time limit and submitit's log folder; `--wait` waits and prints the
summary (exit 0) or the failing rank's error (exit 1). A config that does not load or
validate, a request the partition can never satisfy or one sbatch refuses: one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from pivotrl_hpc.launch.diagnose import BAD_INPUT, bad_input


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.steps=10")
    parser.add_argument("--nodes", type=int, help="nodes (default: cluster.nodes)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node (default: cluster.devices_per_node)")
    parser.add_argument("--job-name", default="pivotrl")
    parser.add_argument("--runs-root", default="runs",
                        help="run folders go to RUNS_ROOT/<job name>-<job id>/ (default runs)")
    add_slurm_arguments(parser)


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `pivotrl submit` and `pivotrl resume` share."""
    parser.add_argument("--partition", help="default: the cluster's default partition")
    parser.add_argument("--time", type=int,
                        help="time limit in minutes (default: a day, or the partition's "
                             "MaxTime when shorter; the job requeues itself before it)")
    parser.add_argument("--account")
    parser.add_argument("--qos")
    parser.add_argument("--constraint", help="node features, e.g. a100 (sbatch --constraint)")
    parser.add_argument("--cpus-per-gpu", type=int, default=2)
    parser.add_argument("--exclusive", action="store_true", help="whole nodes")
    parser.add_argument("--wait", action="store_true",
                        help="wait for the job and print its summary (or its error)")


def slurm_options(args: argparse.Namespace) -> dict:
    options = {k: v for k, v in (("partition", args.partition), ("time", args.time),
                                 ("account", args.account), ("qos", args.qos),
                                 ("constraint", args.constraint)) if v}
    if args.exclusive:
        options["exclusive"] = True
    return options


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.launch.submit import environment_note, run_folder, submit

    note = environment_note()
    if note:
        print(f"pivotrl submit: {note}", file=sys.stderr)
        return 2
    try:
        job = submit(args.config, args.overrides, nodes=args.nodes,
                     gpus_per_node=args.gpus_per_node, runs_root=args.runs_root,
                     cpus_per_gpu=args.cpus_per_gpu, job_name=args.job_name,
                     **slurm_options(args))
    except BAD_INPUT as e:
        print(f"pivotrl submit: {bad_input(e, args.config)}", file=sys.stderr)
        return 2
    return report(job, run_folder(job, args.runs_root, args.job_name), args.wait, "submit")


def report(job, folder, wait: bool, command: str) -> int:
    """Print what was submitted; with `wait`, wait for the job and print its summary (0) or
    its error, which names the failing rank (1)."""
    print(f"submitted job {job.job_id}; run folder {folder}; {job.pivotrl.describe()}; "
          f"submitit logs {job.paths.folder}", flush=True)
    if not wait:
        return 0
    print(f"waiting for job {job.job_id} (Ctrl-C stops waiting, not the job)", file=sys.stderr,
          flush=True)
    try:
        summary = job.result()
    except Exception as e:  # noqa: BLE001 - submitit's FailedJobError carries the job's text
        print(f"pivotrl {command}: job {job.job_id} failed: {job_error(str(e))}",
              file=sys.stderr)
        return 1
    print(json.dumps({k: summary[k] for k in ("steps", "tokens_per_s", "trace", "run_folder",
                                              "job_id", "stopped") if k in summary}))
    return 0


_RAISED = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupted)\w*: (.+)$", re.M)


def job_error(text: str) -> str:
    """submitit's error holds the job's traceback and then where its logs are: the line of
    the exception it raised (SlurmJobError names the failing rank), else its first line."""
    found = _RAISED.findall(text)
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else text
