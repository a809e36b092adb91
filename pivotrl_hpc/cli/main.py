"""`pivotrl` entry point: a thin dispatcher over one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `main(args) -> int`. A subcommand
whose work has not landed yet is listed with `pending=<issue title>`: it says so in one line
and exits 2, so nothing pretends to succeed.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import dataclass

from pivotrl_hpc.terminal import safe_logs


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    help: str
    pending: str | None = None


COMMANDS: tuple[Command, ...] = (
    Command("run", "pivotrl_hpc.cli.run", "run an RL job locally (mpirun) or inside an allocation"),
    Command("submit", "pivotrl_hpc.cli.submit", "submit an RL job to Slurm with submitit"),
    Command("resume", "pivotrl_hpc.cli.resume",
            "continue a stopped Slurm run in its run folder from its newest checkpoint"),
    Command("simulate", "pivotrl_hpc.cli.simulate",
            "the job on modeled devices in virtual time, paradigm vs paradigm"),
    Command("reproduce", "pivotrl_hpc.cli.reproduce",
            "the paper's evaluation on the simulator: figures as JSON and PNG"),
    Command("report", "pivotrl_hpc.cli.report",
            "turn an HDF5 trace into figures, a summary and a Perfetto timeline"),
    Command("trace", "pivotrl_hpc.cli.trace",
            "check a trace's invariants or print its samples (docs/trace.md)"),
    Command("export", "pivotrl_hpc.cli.export",
            "write a run's trained policy as a HuggingFace model folder"),
    Command("plan", "pivotrl_hpc.cli.plan", "replay one planner decision from a snapshot"),
    Command("bench", "pivotrl_hpc.cli.bench", "benchmarks printing one JSON object"),
    Command("profile", "pivotrl_hpc.cli.profile", "profile a real engine and fit A, B, C, D"),
    Command("gps", "pivotrl_hpc.cli.gps", "Global Parameter Storage operator tools"),
    Command("doctor", "pivotrl_hpc.cli.doctor", "check every real component"),
    Command("init-models", "pivotrl_hpc.cli.init_models", "create tiny models and the dataset"),
    Command("config", "pivotrl_hpc.cli.config_cmd", "validate and print a resolved config"),
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    parser = argparse.ArgumentParser(prog="pivotrl", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    by_name = {}
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.pending is None:
            importlib.import_module(cmd.module).add_arguments(p)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        by_name[cmd.name] = cmd
    return parser, by_name


def _quiet_engines(verbose: bool) -> None:
    """stdout belongs to the command's output (JSON for benchmarks): engine logs go to stderr,
    and only warnings unless -v."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if verbose else "WARNING")
    os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")  # NIXL crashes at exit without it


def main(argv: list[str] | None = None) -> int:
    parser, by_name = build_parser()
    # Dotted overrides (`rl.steps=3`) may come after options; argparse leaves those over.
    # A malformed one (no `=`) goes along too, so the command names it.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _quiet_engines(args.verbose)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    safe_logs()   # data's control characters reach the console escaped (terminal.py)
    if args.command is None:
        parser.print_help()
        return 2
    cmd = by_name[args.command]
    if cmd.pending is not None:
        print(f"pivotrl {cmd.name}: not available yet (arrives with {cmd.pending})",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(cmd.module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
