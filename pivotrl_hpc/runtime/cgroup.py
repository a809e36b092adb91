"""CPU caps for emulated devices: each worker rank gets `cluster.cpu_share` cores as a cgroup
CPU quota, so an idle "device" really wastes its capacity, as an idle GPU does.

The worker rank caps itself early in its start-up (before torch spawns its threads; threads
and children follow the process anyway): group `pivotrl-<job>/<node>-d<device>` under the
CPU controller, quota = share x period. The period is 10 ms, not the kernel's default 100:
a capped process runs at most share x period before it waits for the next period, and a
TP group's collectives wait for every member's turn, so a coarse period makes a TP=2 replica
stall in 80 ms gaps a real device never has. At 10 ms (measured with `bench e2e`, 8 steps, 2
runs each) disaggregated's steady tokens/s rose from 99.7 to 139.3 and shiftable's from
102.6 to 119.8. Shares too small for the kernel's 1 ms minimum quota get a longer period
instead of a larger share.

- cgroup v1 (these machines): the `cpu` controller's mount (from /proc/mounts), files
  `cpu.cfs_period_us` and `cpu.cfs_quota_us`.
- cgroup v2: the unified mount; `+cpu` is enabled in the root's and the job group's
  `cgroup.subtree_control`, the cap is `cpu.max` ("quota period").

PIVOTRL_CGROUP_ROOT names another parent group (a delegated subtree on a shared machine).
On exit a rank moves itself back to the root group and removes its group; the launcher
removes whatever is left of the job (ranks killed with SIGKILL).

Opt-out: when the groups cannot be created (not root, no delegation), the launcher and the
ranks fail with a message naming the path. `pivotrl run --no-cpu-cap`, or PIVOTRL_CPU_CAP=off
in the ranks' environment (under Slurm), runs uncapped instead: every device then competes
for every core, so measured paradigm comparisons mean nothing. On GPUs
(`cluster.device_kind: gpu`) nothing is capped.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc import envs

log = logging.getLogger(__name__)

OPT_OUT_ENV = envs.CPU_CAP.name   # "off" disables the caps
ROOT_ENV = envs.CGROUP_ROOT.name  # where the job's groups go (default: the controller's mount)
PERIOD_US = 10_000                # see the module doc: fine enough for TP collectives
MIN_QUOTA_US = 1_000              # the kernel's lower bound for cfs quotas
MAX_PERIOD_US = 1_000_000         # and its upper bound for periods
OPT_OUT_HINT = ("run as root (or with a delegated cgroup), or opt out with `pivotrl run "
                f"--no-cpu-cap` / {OPT_OUT_ENV}=off (devices then share all cores and paradigm "
                "comparisons mean nothing)")


class CgroupError(RuntimeError):
    """A CPU cap cannot be set; the message names the path and the opt-out."""


@dataclass(frozen=True)
class CpuRoot:
    version: int   # 1 or 2
    path: Path     # mount point of the cpu controller (v1) or of the unified hierarchy (v2)


@dataclass(frozen=True)
class CpuCap:
    root: CpuRoot
    group: Path
    quota_us: int
    period_us: int

    @property
    def cores(self) -> float:
        return self.quota_us / self.period_us


def caps_enabled(cfg, env: Mapping[str, str]) -> bool:
    return cfg.cluster.device_kind == "cpu" and envs.CPU_CAP.get(env).lower() != "off"


def find_root(mounts: str | None = None) -> CpuRoot:
    """The CPU controller's mount, v1 preferred when both exist (hybrid systems), or
    ROOT_ENV (a delegated group to create the job's groups in; v2 if it has
    cgroup.controllers)."""
    if envs.CGROUP_ROOT.is_set():
        path = Path(envs.CGROUP_ROOT.get())
        return CpuRoot(2 if (path / "cgroup.controllers").exists() else 1, path)
    if mounts is None:
        mounts = Path("/proc/mounts").read_text()
    unified = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        _, where, fstype, opts = parts[:4]
        if fstype == "cgroup" and "cpu" in opts.split(","):
            return CpuRoot(1, Path(where))
        if fstype == "cgroup2" and unified is None:
            unified = CpuRoot(2, Path(where))
    if unified is None:
        raise CgroupError(f"no cgroup CPU controller is mounted (see /proc/mounts); "
                          f"{OPT_OUT_HINT}")
    return unified


def job_dir(root: CpuRoot, job: str) -> Path:
    return root.path / f"pivotrl-{job}"


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value.strip()!r} to {path}: {e.strerror}; "
                          f"{OPT_OUT_HINT}") from e


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as e:
        raise CgroupError(f"cannot create the cgroup {path}: {e.strerror}; {OPT_OUT_HINT}") from e


def _prepare_job(root: CpuRoot, job: str) -> Path:
    d = job_dir(root, job)
    if root.version == 2:
        _enable_cpu(root.path)
    _mkdir(d)
    if root.version == 2:
        _enable_cpu(d)
    return d


def _enable_cpu(group: Path) -> None:
    control = group / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        _write(control, "+cpu")


def check_writable(job: str, root: CpuRoot | None = None) -> Path:
    """Launcher check before any process starts: create and remove the job's group."""
    root = root or find_root()
    d = _prepare_job(root, job)
    try:
        d.rmdir()
    except OSError:
        pass
    return d


def cap_process(pid: int, job: str, name: str, cores: float,
                root: CpuRoot | None = None) -> CpuCap:
    """Put `pid` (with its threads and future children) into group `name` of `job`, capped
    to `cores` CPUs."""
    root = root or find_root()
    group = _prepare_job(root, job) / name
    _mkdir(group)
    quota, period = quota_and_period(cores)
    if root.version == 1:
        _write(group / "cpu.cfs_period_us", str(period))
        _write(group / "cpu.cfs_quota_us", str(quota))
    else:
        _write(group / "cpu.max", f"{quota} {period}")
    _write(group / "cgroup.procs", str(pid))
    log.info("CPU cap %.3g cores (quota %d us / %d us) in %s", cores, quota, period, group)
    return CpuCap(root, group, quota, period)


def quota_and_period(cores: float) -> tuple[int, int]:
    """(quota, period) in microseconds for `cores`: the 10 ms period, lengthened where the
    quota would fall under the kernel's minimum (so the share stays what was asked)."""
    period = min(MAX_PERIOD_US, max(PERIOD_US, math.ceil(MIN_QUOTA_US / cores)))
    return max(MIN_QUOTA_US, int(round(cores * period))), period


def add_process(cap: CpuCap, pid: int) -> None:
    """Move one more process (and its threads) into an existing cap's group."""
    _write(cap.group / "cgroup.procs", str(pid))


def release(cap: CpuCap, pid: int | None = None) -> None:
    """Move `pid` (default: this process) back to the root group and remove its group."""
    try:
        (cap.root.path / "cgroup.procs").write_text(str(pid or os.getpid()))
        cap.group.rmdir()
    except OSError as e:
        log.warning("could not remove the cgroup %s: %s", cap.group, e)


def remove_job(job: str, root: CpuRoot | None = None, wait_s: float = 0.0) -> list[Path]:
    """Remove the job's groups (idempotent), waiting up to `wait_s` for killed processes to
    finish exiting (a group is busy until then); return the groups removed."""
    try:
        root = root or find_root()
    except CgroupError:
        return []
    d = job_dir(root, job)
    try:
        # the agents of nodes that share a host remove the same group at once
        groups = sorted(p for p in d.iterdir() if p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for group in [*groups, d]:
        _wait_empty(group, wait_s)
        try:
            group.rmdir()
            removed.append(group)
        except FileNotFoundError:
            continue                  # another rank of the job removed it first
        except OSError as e:
            log.warning("cgroup %s left in place: %s", group, e.strerror)
    return removed


def _wait_empty(group: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if not (group / "cgroup.procs").read_text().strip():
                return
        except OSError:
            return
        time.sleep(0.05)


def group_of(pid: int, root: CpuRoot | None = None) -> Path | None:
    """The CPU controller's group of `pid` (None: not found in /proc/<pid>/cgroup)."""
    root = root or find_root()
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (root.version == 1 and "cpu" in controllers.split(",")) or \
                (root.version == 2 and controllers == ""):
            return root.path / path.lstrip("/")
    return None


def _capped(group: Path | None) -> bool:
    """A device's group of some job (`<root>/pivotrl-<job>/<name>`)."""
    return group is not None and group.parent.name.startswith("pivotrl-")


def follow(pid: int) -> None:
    """Move `pid` into this process's device cap, if it has one: an engine host forked by
    the node's forker (outside every cap) for a worker already capped."""
    try:
        root = find_root()
        mine = group_of(os.getpid(), root)
        if _capped(mine) and group_of(pid, root) != mine:
            _write(mine / "cgroup.procs", str(pid))
    except (CgroupError, OSError) as e:
        log.warning("engine host %d not moved into this worker's CPU cap: %s", pid, e)


def leave_caps(pid: int) -> None:
    """Move `pid` out of a device cap it inherited (the node's host forker, started by a
    capped worker, serves every device of the node)."""
    try:
        root = find_root()
        if _capped(group_of(pid, root)):
            _write(root.path / "cgroup.procs", str(pid))
    except (CgroupError, OSError) as e:
        log.warning("process %d left in a device's CPU cap: %s", pid, e)


def quota_of(pid: int, root: CpuRoot | None = None) -> float | None:
    """The CPU cap of `pid` in cores (None: uncapped), read from its cgroup."""
    root = root or find_root()
    group = group_of(pid, root)
    if group is None:
        return None
    if root.version == 1:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    else:
        q, p = (group / "cpu.max").read_text().split()
        if q == "max":
            return None
        quota, period = int(q), int(p)
    return None if quota < 0 else quota / period
