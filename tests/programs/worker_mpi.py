"""Controller (rank 0) drives a device worker (rank 1) over MPI with the runtime's messages.

usage: mpirun -n 2 python worker_mpi.py MODELS_DIR OUT.json
"""
from __future__ import annotations

import json
import os
import sys

from mpi4py import MPI

from pivotrl_hpc.engines.vllm.types import EngineOptions, Sampling
from pivotrl_hpc.runtime.messages import (AddSequences, RoleKind, SeqRequest, ShiftDown, ShiftUp,
                                          Shutdown, Step)
from pivotrl_hpc.runtime.serve import WorkerHandle, serve

GREEDY = Sampling(temperature=0.0, ignore_eos=True)


def worker(comm, models: str) -> None:
    from pivotrl_hpc.runtime.local import local_worker
    from pivotrl_hpc.runtime.worker import WorkerSpec

    opts = EngineOptions(max_model_len=64, kv_cache_memory_bytes=16 * 2**20)
    spec = WorkerSpec(model_dirs={"policy": f"{models}/policy"},
                      engine_options={"policy": opts})
    with local_worker(spec, job=f"wmpi{os.getppid()}") as w:
        serve(comm, w, controller=0)


def controller(comm, out: str) -> None:
    w = WorkerHandle(comm, 1)
    report = {"idle_shift_down": w.call(ShiftDown()).__dict__}
    up = w.call(ShiftUp(RoleKind.ROLLOUT, 0))
    report["up_ok"] = up.ok
    w.call(AddSequences(tuple(SeqRequest(f"q{i}", (1, 20 + i, 5), max_new_tokens=8,
                                         sampling=GREEDY) for i in range(3))))
    finished = {}
    while len(finished) < 3:
        for o in w.call(Step()).result:
            finished.update({f.seq_id: f.token_ids for f in o.finished})
    report["finished"] = {k: list(v) for k, v in sorted(finished.items())}
    report["down"] = w.call(ShiftDown()).phases
    report["shutdown_ok"] = w.call(Shutdown()).ok
    report["idle_shift_down"]["role"] = report["idle_shift_down"]["role"].value
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        controller(comm, sys.argv[2])
    else:
        worker(comm, sys.argv[1])
