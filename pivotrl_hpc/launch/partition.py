"""What a Slurm partition can give, asked before a job is queued (`pivotrl submit`,
`pivotrl_hpc.submit`, `pivotrl resume`): a request it can never satisfy (more nodes than it
has, more GPUs or CPUs per node than any of its nodes, a time limit above its MaxTime) would
be accepted by sbatch and pend forever; it is refused here with one line instead.

The time limit a job gets when none is asked for is chosen here too: DEFAULT_TIME_MIN, or
the partition's MaxTime when that is shorter.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from pivotrl_hpc.launch.layout import LaunchError

DEFAULT_TIME_MIN = 24 * 60   # a day: a long run requeues itself before it (docs/checkpoints.md)


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int                   # nodes a job may get (TotalNodes, or MaxNodes if fewer)
    gpus: int                    # most GPUs (gres gpu) of one of its nodes
    cpus: int                    # most CPUs of one of its nodes
    max_time_min: int | None     # None: no limit


def _run(*cmd: str) -> str:
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, check=False)
    except OSError as e:
        raise LaunchError(f"{cmd[0]} failed: {e}") from None
    if p.returncode != 0:
        raise LaunchError(f"{' '.join(cmd)} failed: {' '.join(p.stderr.split())}")
    return p.stdout


def parse_minutes(text: str) -> int | None:
    """Slurm's time format (MaxTime): `UNLIMITED`/`INFINITE` -> None, `[D-]HH:MM:SS`,
    `MM:SS`, `MM` -> minutes (seconds rounded down)."""
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:                      # D-HH[:MM[:SS]]
        return int(days) * 1440 + parts[0] * 60 + (parts[1] if len(parts) > 1 else 0)
    return parts[0] * 60 + parts[1] if len(parts) == 3 else parts[0]


def fields(line: str) -> dict[str, str]:
    """`scontrol show ... -o` -> key -> value."""
    return dict(t.split("=", 1) for t in line.split() if "=" in t)


def query(name: str | None) -> Partition:
    """The partition `name` (None: the cluster's default one), from scontrol and sinfo."""
    rows = [fields(line) for line in _run("scontrol", "show", "partition", "-o").splitlines()
            if line.strip()]
    if name is None:
        row = next((r for r in rows if r.get("Default") == "YES"), None)
        if row is None:
            raise LaunchError("the cluster has no default partition: name one (--partition)")
    else:
        row = next((r for r in rows if r.get("PartitionName") == name), None)
        if row is None:
            have = ", ".join(r.get("PartitionName", "?") for r in rows)
            raise LaunchError(f"partition {name!r} does not exist (the cluster has: {have})")
    part = row["PartitionName"]
    gpus, cpus = 0, 0
    for line in _run("sinfo", "-h", "-N", "-p", part, "-o", "%N|%G|%c").splitlines():
        _node, gres, ncpu = line.split("|")
        m = re.search(r"gpu(?::[^:(,]+)?:(\d+)", gres)
        gpus, cpus = max(gpus, int(m.group(1)) if m else 0), max(cpus, int(ncpu))
    nodes = int(row.get("TotalNodes", 0))
    if row.get("MaxNodes", "UNLIMITED").isdigit():
        nodes = min(nodes, int(row["MaxNodes"]))
    return Partition(part, nodes, gpus, cpus, parse_minutes(row.get("MaxTime", "UNLIMITED")))


def check_request(p: Partition, nodes: int, gpus_per_node: int, cpus_per_node: int,
                  time_min: int) -> None:
    """Refuse (LaunchError, one line) what partition `p` can never give."""
    where = f"partition {p.name}"
    if nodes > p.nodes:
        raise LaunchError(f"{where} has {p.nodes} node(s) but the job asks for {nodes} "
                          f"(cluster.nodes): it would pend forever; set cluster.nodes="
                          f"{p.nodes} or less, or choose a larger partition")
    if gpus_per_node > p.gpus:
        raise LaunchError(f"{where}: its nodes have at most {p.gpus} GPUs but the job asks for "
                          f"{gpus_per_node} per node (cluster.devices_per_node)")
    if cpus_per_node > p.cpus:
        raise LaunchError(f"{where}: its nodes have at most {p.cpus} CPUs but the job asks for "
                          f"{cpus_per_node} per node (--cpus-per-gpu x GPUs)")
    if p.max_time_min is not None and time_min > p.max_time_min:
        raise LaunchError(f"{where} allows at most {p.max_time_min} min (MaxTime) but the job "
                          f"asks for {time_min}: ask for less (--time); a longer run requeues "
                          "itself before its limit and resumes")


def default_time(p: Partition) -> int:
    """The time limit (minutes) of a job that asks for none."""
    return DEFAULT_TIME_MIN if p.max_time_min is None else min(DEFAULT_TIME_MIN,
                                                                p.max_time_min)
