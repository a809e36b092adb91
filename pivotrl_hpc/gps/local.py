"""A node agent in a child process, for single-node runs, tests and benchmarks.

In a job the agent is MPI local rank 0 (`NodeAgent(cfg, comm).start(); serve_forever()`);
here it is `pivotrl gps serve` started with `subprocess`, stopped with a shutdown request
(SIGTERM as the fallback), and its segments are swept either way.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from pivotrl_hpc.gps.agent import control_path
from pivotrl_hpc.gps.segment import sweep


@dataclass
class LocalAgent:
    job: str
    node: str
    proc: subprocess.Popen

    def client(self):
        from pivotrl_hpc.gps.client import GPSClient
        return GPSClient(self.job, self.node)


@contextmanager
def local_agent(models: Mapping[str, str], *, job: str | None = None, node: str = "n0",
                budget_mb: float | None = None, env: Mapping[str, str] | None = None,
                wait_s: float = 120.0) -> Iterator[LocalAgent]:
    job = job or f"local{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve", "--job", job,
           "--node", node]
    for name, folder in models.items():
        cmd += ["--model", f"{name}={folder}"]
    if budget_mb is not None:
        cmd += ["--budget-mb", str(budget_mb)]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + wait_s
        while not control_path(job, node).exists():
            if proc.poll() is not None:
                raise RuntimeError(f"GPS agent exited with {proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"GPS agent {job}/{node} not ready after {wait_s} s")
            time.sleep(0.02)
        yield LocalAgent(job, node, proc)
    finally:
        _stop(LocalAgent(job, node, proc))


def _stop(agent: LocalAgent) -> None:
    if agent.proc.poll() is None:
        try:
            c = agent.client()
            c.shutdown_agent()
            c.close()
            agent.proc.wait(timeout=20)
        except Exception:  # noqa: BLE001 - fall back to the signal path
            agent.proc.terminate()
            agent.proc.wait(timeout=20)
    sweep(agent.job, agent.node)
