"""A device worker with its node's GPS agent beside it, for one-device runs.

In a job the node agent is MPI local rank 0 and workers are other ranks; for benchmarks,
profiling and single-process tests the agent is a child process (`gps.local.local_agent`).
Same agent, same client, same shared-memory segments, so the numbers are the real Read path.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from pivotrl_hpc.runtime.worker import DeviceWorker, WorkerSpec


@contextlib.contextmanager
def local_worker(spec: WorkerSpec, job: str | None = None,
                 node: str = "local") -> Iterator[DeviceWorker]:
    """Start a GPS node agent over `spec.model_dirs`, yield a worker reading from it; on exit
    shut the worker down, stop the agent and remove every segment."""
    from pivotrl_hpc.gps.local import local_agent
    from pivotrl_hpc.protocol.messages import Shutdown

    with local_agent(spec.model_dirs, job=job or f"local{os.getpid()}", node=node) as agent:
        client = agent.client()
        worker = DeviceWorker(spec, client)
        try:
            yield worker
        finally:
            worker.handle(Shutdown())
            client.close()
