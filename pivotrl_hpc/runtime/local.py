"""A device worker with its node's GPS agent in the same process, for one-device runs.

In a job the node agent is MPI local rank 0 and workers are other ranks; for benchmarks,
profiling and single-process tests the agent runs in a thread of the worker's process. Same
agent, same client, same shared-memory segments, so the numbers are the real Read path.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from pivotrl_hpc.runtime.worker import DeviceWorker, WorkerSpec


@contextlib.contextmanager
def local_worker(spec: WorkerSpec, job: str | None = None,
                 node: str = "local") -> Iterator[DeviceWorker]:
    """Start a GPS node agent (thread) over `spec.model_dirs`, yield a worker reading from it;
    on exit shut the worker down and remove every segment."""
    from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
    from pivotrl_hpc.gps.client import GPSClient
    from pivotrl_hpc.runtime.messages import Shutdown

    job = job or f"local{os.getpid()}"
    agent = NodeAgent(AgentConfig(job=job, node=node, models=dict(spec.model_dirs)))
    agent.start()
    thread = threading.Thread(target=agent.serve_forever, name="gps-agent", daemon=True)
    thread.start()
    client = GPSClient(job, node)
    worker = DeviceWorker(spec, client)
    try:
        yield worker
    finally:
        worker.handle(Shutdown())
        client.shutdown_agent()
        thread.join(timeout=30)
        if not agent.closed:
            agent.close()
