"""A node agent in a child process, for single-node runs, tests and benchmarks.

In a job the agent is MPI local rank 0 (`NodeAgent(cfg, comm).start(); serve_forever()`);
here it is `pivotrl gps serve` started with `subprocess`, stopped with a shutdown request
(SIGTERM as the fallback), and its segments are swept either way. What the agent's own
cleanup left behind is recorded first (`LocalAgent.leftover`): a leak is an error even though
the sweep removes it.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from pivotrl_hpc.gps.agent import control_path
from pivotrl_hpc.gps.segment import SHM_DIR, segment_prefix, sweep

log = logging.getLogger(__name__)
_CLEAN_EXITS = (0, 128 + signal.SIGTERM)  # the agent ran its own cleanup


class AgentLeakError(RuntimeError):
    """The agent stopped gracefully but left segments (removed by the helper's sweep)."""


@dataclass
class LocalAgent:
    job: str
    node: str
    proc: subprocess.Popen
    leftover: list[str] | None = None  # after a clean exit: what the agent itself left

    def client(self):
        from pivotrl_hpc.gps.client import GPSClient
        return GPSClient(self.job, self.node)


@contextmanager
def local_agent(models: Mapping[str, str], *, job: str | None = None, node: str = "n0",
                budget_mb: float | None = None, env: Mapping[str, str] | None = None,
                wait_s: float = 120.0) -> Iterator[LocalAgent]:
    """Raises `AgentLeakError` at exit if the agent's graceful stop left segments (unless the
    body raised)."""
    job = job or f"local{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve", "--job", job,
           "--node", node]
    for name, folder in models.items():
        cmd += ["--model", f"{name}={folder}"]
    if budget_mb is not None:
        cmd += ["--budget-mb", str(budget_mb)]
    agent = LocalAgent(job, node, subprocess.Popen(cmd, env={**os.environ, **(env or {})}))
    try:
        _wait_ready(agent, wait_s)
        yield agent
    except BaseException:
        _stop(agent)
        raise
    _stop(agent)
    if agent.leftover:
        raise AgentLeakError(f"GPS agent {job}/{node} left {agent.leftover} after its graceful "
                             f"stop (removed now)")


def _wait_ready(agent: LocalAgent, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not control_path(agent.job, agent.node).exists():
        if agent.proc.poll() is not None:
            raise RuntimeError(f"GPS agent exited with {agent.proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"GPS agent {agent.job}/{agent.node} not ready after {wait_s} s")
        time.sleep(0.02)


STOP_ASK_S = 5.0     # the shutdown request's deadline (a stopped agent never answers)
STOP_TERM_S = 10.0   # then SIGTERM (and SIGCONT, for a stopped one), then SIGKILL


def _stop(agent: LocalAgent) -> None:
    """Bounded: a shutdown request, SIGTERM, SIGKILL; at most ~40 s even when the agent is
    stopped (SIGSTOP) or ignores signals."""
    if agent.proc.poll() is None:
        try:
            from pivotrl_hpc.gps.client import GPSClient
            c = GPSClient(agent.job, agent.node, wait_s=STOP_ASK_S, request_s=STOP_ASK_S)
            try:
                c.shutdown_agent()
            finally:
                c.close()
            agent.proc.wait(timeout=20)
        except Exception:  # noqa: BLE001 - fall back to the signal path
            agent.proc.terminate()
            agent.proc.send_signal(signal.SIGCONT)   # a stopped agent handles SIGTERM now
            try:
                agent.proc.wait(timeout=STOP_TERM_S)
            except subprocess.TimeoutExpired:   # it ignores SIGTERM: the sweep still runs
                agent.proc.kill()
                agent.proc.wait()
    if agent.proc.returncode in _CLEAN_EXITS:
        prefix = segment_prefix(agent.job, agent.node)
        agent.leftover = sorted(p.name for p in SHM_DIR.glob(prefix + "*"))
        if agent.leftover:
            log.error("GPS agent %s/%s left %s", agent.job, agent.node, agent.leftover)
    sweep(agent.job, agent.node)
