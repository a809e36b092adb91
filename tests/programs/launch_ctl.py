"""Test controllers for `pivotrl run` (PIVOTRL_CONTROLLER=launch_ctl:NAME), with run_job's
signature: (cfg, comm, layout, trace_path) -> summary dict; Shutdown to every worker on every
exit path."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pivotrl_hpc.runtime import cgroup
from pivotrl_hpc.launch.layout import RunPaths
from pivotrl_hpc.protocol.messages import QueryState, Shutdown
from pivotrl_hpc.runtime.serve import WorkerClient

PROGRESS = logging.getLogger("pivotrl_hpc.controller.launch_test")  # -> rank 0's stdout


def _handles(comm, layout):
    return {d: WorkerClient(comm, layout.worker_rank(d)) for d in layout.devices}


def _shutdown(handles) -> dict:
    return {d: h.call(Shutdown()).ok for d, h in handles.items()}


def _caps(cfg, layout) -> dict:
    paths = RunPaths.for_config(cfg)
    caps = {}
    for d in layout.devices:
        pid = int(paths.rank_pid(layout.worker_rank(d)).read_text().split()[0])
        caps[d] = cgroup.quota_of(pid) if cgroup.caps_enabled(cfg, os.environ) else None
    return caps


def query_all(cfg, comm, layout, trace_path, stopper=None):
    """Every worker answers a QueryState; report their states and CPU caps; Shutdown."""
    handles = _handles(comm, layout)
    try:
        states = {d: h.call(QueryState()) for d, h in handles.items()}
        caps = _caps(cfg, layout)
    finally:
        shut = _shutdown(handles)
    Path(trace_path).write_text("test trace\n")
    return {"states": {d: [r.ok, r.result["role"]] for d, r in states.items()},
            "caps": caps, "shutdown": shut, "world": comm.Get_size()}


def until_stopped(cfg, comm, layout, trace_path, stopper=None):
    """Query the workers in a loop until a signal interrupts; Shutdown on the way out."""
    handles = _handles(comm, layout)
    trace = Path(trace_path)
    trace.write_text("open\n")
    rounds = 0
    try:
        while True:
            for h in handles.values():
                h.call(QueryState())
            rounds += 1
            if rounds == 1:
                PROGRESS.info("controller running")
            time.sleep(0.1)
    finally:
        _shutdown(handles)
        trace.write_text(f"closed after {rounds} rounds\n")


def fails(cfg, comm, layout, trace_path, stopper=None):
    """A controller that raises after shutting the workers down."""
    _shutdown(_handles(comm, layout))
    raise RuntimeError("test controller failure")


def idle(cfg, comm, layout, trace_path, stopper=None):
    """Query the workers once, then leave them waiting for commands (blocked in MPI recv)
    until a signal interrupts; Shutdown on the way out."""
    handles = _handles(comm, layout)
    try:
        for h in handles.values():
            h.call(QueryState())
        PROGRESS.info("controller running")
        while True:
            time.sleep(0.1)
    finally:
        _shutdown(handles)
