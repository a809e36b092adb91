"""Naming the rank that failed, for both launchers: `pivotrl run` (mpirun) and the Slurm job
(srun). One line with the rank, its role in the layout, its host, its last role and its
error: from rank-N.error.json when the rank could write one (a Python failure), else from
the launcher's own message (a rank killed by a signal, or exiting without a word).
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import yaml

from pivotrl_hpc.config import ConfigError
from pivotrl_hpc.runtime.cgroup import CgroupError
from pivotrl_hpc.launch.layout import LaunchError, RankLayout, RunPaths

# config, allocation, cgroups, YAML: input refused before anything starts (exit 2)
BAD_INPUT = (ConfigError, LaunchError, CgroupError, yaml.YAMLError)


def bad_input(e: BaseException, config) -> str:
    """The one line a command prints for an exception of BAD_INPUT."""
    if isinstance(e, yaml.YAMLError):
        return f"{config} is not valid YAML: {' '.join(str(e).split())}"
    return str(e)

# mpirun (Open MPI 4.1)
_DIED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)"
                   r"(?: \(([^)]*)\))?")
_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+)")
_EXIT = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
# srun (Slurm 22.05): "srun: error: n2: task 7: Killed", "... tasks 0-4: Exited with exit code 1"
_SRUN = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:[-,]\S*)?: (Killed|Terminated|"
                   r"Exited with exit code (\d+)|.+)")


def diagnose(layout: RankLayout, paths: RunPaths, launcher_stderr: str, rc: int,
             launcher: str = "mpirun") -> str:
    """One line naming the rank that failed first, its host, role and error."""
    e = _first_error(paths)
    if e is not None:
        return rank_line(layout, paths, e["rank"], e["host"], e["error"])
    def named(rank: int, host: str | None, what: str) -> str:
        return rank_line(layout, paths, rank, host, what, launcher_stderr,
                         paths.logs / f"{launcher}.log")

    m = _DIED.search(launcher_stderr)
    if m:
        name = m.group(4) or signal.Signals(int(m.group(3))).name
        return named(int(m.group(1)), m.group(2), f"killed by signal {m.group(3)} ({name})")
    m = _SRUN.search(launcher_stderr)
    if m:
        what = f"exited with code {m.group(4)}" if m.group(4) else m.group(3).lower()
        return named(int(m.group(2)), m.group(1), what)
    for pattern, what in ((_ABORT, "called MPI Abort"), (_EXIT, "exited with code {}")):
        m = pattern.search(launcher_stderr)
        if m:
            return named(int(m.group(1)), None, what.format(*m.groups()[1:]))
    tail = " | ".join(line.strip() for line in launcher_stderr.strip().splitlines()[-3:])
    return f"{launcher} exited with code {rc}: {tail or 'no message'} (see {paths.logs})"


def job_exit_code(paths: RunPaths) -> int:
    """The exit code of a failed job: the first failing rank's (2: it was refused, e.g. a
    squatted socket name), else 1."""
    try:
        e = _first_error(paths)
    except (OSError, ValueError):
        return 1
    code = e.get("exit_code", 1) if e is not None else 1
    return code if code in (1, 2) else 1


def _first_error(paths: RunPaths) -> dict | None:
    """The error file of the rank that failed first (rank-N.error.json), if one wrote it."""
    errors = sorted(paths.logs.glob("rank-*.error.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(errors[0].read_text()) if errors else None


def rank_line(layout: RankLayout, paths: RunPaths, rank: int, host: str | None,
              error: str, launcher_stderr: str = "", launcher_log: Path | None = None) -> str:
    info = layout.info(rank)
    log_path = paths.rank_log(rank)
    role, last = _from_log(log_path)
    host = host or _pid_host(paths, rank)
    where = f"{info.describe()}, host {host or '?'}" + (f", role {role}" if role else "")
    if not log_path.exists():
        # it died before opening its log (an interpreter without the venv's packages, a
        # crash at import): what it said went to the launcher's stderr
        said = _said(launcher_stderr)
        return (f"{where} failed: {error} before opening its log"
                + (f" ({said})" if said else "") + f"; see {launcher_log or paths.logs}")
    detail = f" (last log line: {last})" if last and last not in error else ""
    return f"{where} failed: {error}{detail}; log {log_path}"


def _said(launcher_stderr: str) -> str:
    """The last error a process printed among the launcher's lines (its own excluded)."""
    lines = [line.strip() for line in launcher_stderr.splitlines() if line.strip()
             and not line.lstrip().startswith(("srun:", "slurmstepd:", "mpirun", "---",
                                               "Primary job", "prterun"))]
    errors = [line for line in lines if re.search(r"(Error|error|Exception)\b", line)]
    return " | ".join((errors or lines)[-2:])[:400]


def _from_log(path: Path) -> tuple[str | None, str | None]:
    """The rank's last role and its last error line, from its log."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None, None
    role = next((m.group(1) for line in reversed(lines)
                 for m in [re.search(r" role (\w+) \(replica", line)] if m), None)
    last = next((line.split(": ", 1)[-1] for line in reversed(lines)
                 if " ERROR " in line or " CRITICAL " in line), None)
    return role, last


def _pid_host(paths: RunPaths, rank: int) -> str | None:
    try:
        return paths.rank_pid(rank).read_text().split()[1]
    except (FileNotFoundError, IndexError):
        return None
