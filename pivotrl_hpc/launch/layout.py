"""The rank layout of a job: which MPI rank is which node's agent or which device's worker.

Per node, G+1 consecutive ranks: local rank 0 is the node's GPS agent, local ranks 1..G are
the device workers of that node's G devices (global device index `node*G + local-1`). Global
rank 0 (node 0's agent rank) also runs the controller. The same arithmetic holds for both ways
in: `mpirun -n N*(G+1)` on one machine, where a "node" is just a block of G+1 ranks (named
n0, n1, ... unless PIVOTRL_NODE_NAMES says otherwise), and `srun --ntasks-per-node=G+1
--distribution=block` (issue 10), where a block is a real node and its name comes from
SLURM_JOB_NODELIST; `check_placement` then verifies SLURM_NODEID agrees with the block.

Rank 0 hosts the controller and node 0's agent in one process: the agent runs in a thread
(see entry.py for the measured reasons), so no extra rank and no extra process is needed and
the layout stays "G+1 ranks per node" on both launchers.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pivotrl_hpc import envs
from pivotrl_hpc.engines import ports

AGENT, WORKER = "agent", "worker"
CONTROLLER_RANK = 0


class LaunchError(RuntimeError):
    """The job cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: int
    node_name: str
    local_rank: int
    kind: str               # AGENT or WORKER
    device: int | None      # global device index of a worker rank
    controller: bool

    def describe(self) -> str:
        what = f"worker of device {self.device}" if self.kind == WORKER else "GPS agent"
        if self.controller:
            what += " + controller"
        return f"rank {self.rank} ({what}, node {self.node_name})"

    @property
    def tag(self) -> str:
        """Short prefix for log lines: r3 n0 worker d2."""
        dev = f" d{self.device}" if self.device is not None else ""
        ctl = "+ctl" if self.controller else ""
        return f"r{self.rank} {self.node_name} {self.kind}{ctl}{dev}"


@dataclass(frozen=True)
class RankLayout:
    nodes: int
    devices_per_node: int
    node_names: tuple[str, ...]
    # where each rank really runs (Slurm node or host name), gathered at start-up (entry.py)
    hosts: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise LaunchError(f"need >= 1 node and >= 1 device per node, got {self.nodes} x "
                              f"{self.devices_per_node}")
        if len(self.node_names) != self.nodes or len(set(self.node_names)) != self.nodes:
            raise LaunchError(f"need {self.nodes} distinct node names, got {self.node_names}")

    @classmethod
    def from_config(cls, cfg, env: Mapping[str, str] | None = None) -> "RankLayout":
        nodes = cfg.cluster.nodes
        return cls(nodes, cfg.cluster.devices_per_node, node_names(nodes, env or {}))

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def ranks_per_node(self) -> int:
        return self.devices_per_node + 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def devices(self) -> range:
        return range(self.nodes * self.devices_per_node)

    # ---- rank -> role -------------------------------------------------------------------------
    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the world of {self.world_size}")

    def node_of(self, rank: int) -> int:
        self._check(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        self._check(rank)
        return rank % self.ranks_per_node

    def kind(self, rank: int) -> str:
        return AGENT if self.local_rank(rank) == 0 else WORKER

    def device(self, rank: int) -> int | None:
        local = self.local_rank(rank)
        return None if local == 0 else self.node_of(rank) * self.devices_per_node + local - 1

    def info(self, rank: int) -> RankInfo:
        node = self.node_of(rank)
        return RankInfo(rank, node, self.node_names[node], self.local_rank(rank),
                        self.kind(rank), self.device(rank), rank == CONTROLLER_RANK)

    def table(self) -> list[RankInfo]:
        return [self.info(r) for r in range(self.world_size)]

    # ---- role -> rank -------------------------------------------------------------------------
    def worker_rank(self, device: int) -> int:
        if device not in self.devices:
            raise ValueError(f"device {device} outside 0..{len(self.devices) - 1}")
        node, local = divmod(device, self.devices_per_node)
        return node * self.ranks_per_node + local + 1

    def agent_rank(self, node: int) -> int:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} outside 0..{self.nodes - 1}")
        return node * self.ranks_per_node

    @property
    def agent_ranks(self) -> tuple[int, ...]:
        return tuple(self.agent_rank(n) for n in range(self.nodes))

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        return tuple(self.worker_rank(d) for d in self.devices)

    def node_devices(self, node: int) -> tuple[int, ...]:
        g = self.devices_per_node
        return tuple(range(node * g, (node + 1) * g))

    def placement(self) -> list[dict]:
        """Per rank: its role in the layout and the host it runs on (the trace's meta)."""
        return [{"rank": i.rank, "node": i.node_name, "kind": i.kind, "device": i.device,
                 "host": self.hosts[i.rank] if self.hosts else None} for i in self.table()]

    def describe(self) -> str:
        lines = [f"{self.nodes} nodes x (1 GPS agent + {self.devices_per_node} device workers)"
                 f" = {self.world_size} ranks; rank 0 also runs the controller"]
        lines += [f"  {i.describe()}" for i in self.table()]
        return "\n".join(lines)


# ---- names and ids from the environment --------------------------------------------------------
def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compact host lists: `n[1-3,5],gpu07` -> n1 n2 n3 n5 gpu07 (one bracket level)."""
    out: list[str] = []
    for prefix, body, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*),?", spec):
        if not (prefix or body or suffix):
            continue
        if not body:
            out.append(prefix + suffix)
            continue
        for part in body.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{i:0{width}d}{suffix}")
    return out


def node_names(nodes: int, env: Mapping[str, str]) -> tuple[str, ...]:
    """PIVOTRL_NODE_NAMES (comma separated), else the Slurm node list, else n0, n1, ..."""
    if envs.NODE_NAMES.is_set(env):
        names = envs.NODE_NAMES.get(env).split(",")
    elif hostlist := envs.SLURM_JOB_NODELIST.raw(env) or envs.SLURM_NODELIST.raw(env):
        names = expand_hostlist(hostlist)
    else:
        return tuple(f"n{i}" for i in range(nodes))
    if len(names) < nodes:
        raise LaunchError(f"cluster.nodes={nodes} but only {len(names)} nodes are given "
                          f"({','.join(names)}): lower cluster.nodes or ask for more nodes")
    return tuple(re.sub(r"[^A-Za-z0-9_]", "_", n.split(".")[0]) for n in names[:nodes])


def check_placement(layout: RankLayout, rank: int, env: Mapping[str, str]) -> None:
    """Under srun, rank r must run on node r // (G+1) (block distribution)."""
    node_id = envs.SLURM_NODEID.get(env)
    if node_id is not None and node_id != layout.node_of(rank):
        raise LaunchError(f"rank {rank} runs on Slurm node {node_id} but the layout puts it on "
                          f"node {layout.node_of(rank)}: use --ntasks-per-node="
                          f"{layout.ranks_per_node} --distribution=block")


def job_id(env: Mapping[str, str]) -> str:
    """The id that names the job's segments, sockets and cgroups: PIVOTRL_RUN_ID (set by the
    local launcher), else SLURM_JOB_ID."""
    job = envs.RUN_ID.raw(env) or envs.SLURM_JOB_ID.raw(env)
    if not job:
        raise LaunchError("no job id: start ranks with `pivotrl run` (sets PIVOTRL_RUN_ID) or "
                          "under Slurm (SLURM_JOB_ID)")
    return re.sub(r"[^A-Za-z0-9_.]", "_", job)


def port_base(job: str, env: Mapping[str, str]) -> int:
    """First TCP port of the job's range: PIVOTRL_PORT_BASE, else derived from the job id
    (every rank of every node derives the same one)."""
    if envs.PORT_BASE.is_set(env):
        return envs.PORT_BASE.get(env)
    # outside the ephemeral range (engines.ports says why)
    first, end = ports.aligned_window(PORTS_PER_JOB)
    slots = max(1, (end - first) // PORTS_PER_JOB - 1)
    return first + int(hashlib.sha1(job.encode()).hexdigest(), 16) % slots * PORTS_PER_JOB


# A job's TCP ports: base (training world), base + 100 + slot (GenRM TP worlds), base + 100 +
# devices + slot (policy TP worlds; runtime.spec). 1000 covers clusters up to 450 devices.
PORTS_PER_JOB = 1000


def job_ports(total_devices: int) -> int:
    return 100 + 2 * total_devices + 1


KEEP_STARTS = 3   # earlier starts whose logs a run folder keeps


# ---- files of a run ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPaths:
    """Everything of a run sits next to its trace: out/x.h5 -> out/x.config.json (resolved
    config), out/x.summary.json, out/x.logs/ (rank-N.log, rank-N.pid, rank-N.error.json,
    mpirun.log or srun.log); an earlier start's logs in out/x.logs/start-K/."""
    trace: Path

    @classmethod
    def for_config(cls, cfg) -> "RunPaths":
        return cls(Path(cfg.trace.path))

    @property
    def config_json(self) -> Path:
        return self.trace.with_suffix(".config.json")

    @property
    def summary_json(self) -> Path:
        return self.trace.with_suffix(".summary.json")

    @property
    def logs(self) -> Path:
        return self.trace.with_suffix(".logs")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def rank_pid(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.pid"

    def rank_error(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.error.json"

    def keep_previous_logs(self, keep: int = KEEP_STARTS) -> Path | None:
        """Move an earlier start's logs (a requeued or resumed job starts again in the same
        folder) to logs/start-K/, K counting up, the newest `keep` kept: what made that start
        stop is not overwritten by the next one. Returns the folder, None if nothing to move."""
        old = [p for p in self.logs.glob("*") if p.is_file() and
               (p.name.startswith("rank-") or p.suffix == ".log")]
        if not old:
            return None
        starts = sorted((int(d.name[6:]), d) for d in self.logs.glob("start-*")
                        if re.fullmatch(r"start-[0-9]{1,9}", d.name) and d.is_dir()
                        and not d.is_symlink())
        dest = self.logs / f"start-{starts[-1][0] + 1 if starts else 1}"
        dest.mkdir(mode=0o700)
        for p in old:
            p.rename(dest / p.name)
        for _, d in starts[:max(0, len(starts) + 1 - keep)]:
            shutil.rmtree(d, ignore_errors=True)
        return dest


def host_name() -> str:
    return os.uname().nodename.split(".")[0]
