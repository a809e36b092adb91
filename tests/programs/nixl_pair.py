"""Two MPI ranks move a DRAM buffer with NIXL over UCX: rank 1 READs rank 0's buffer, then
WRITEs its own into rank 0's, and rank 0 checks the bytes. Metadata travels over MPI.

usage: mpirun -n 2 python nixl_pair.py MIB
"""
from __future__ import annotations

import json
import sys
import time

import torch
from mpi4py import MPI
from nixl._api import nixl_agent, nixl_agent_config


def wait(agent, handle) -> str:
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    return state


def main(mib: int) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    agent = nixl_agent(f"rank{rank}", nixl_agent_config(backends=["UCX"]))
    n = mib * 2**20 // 4
    buf = torch.arange(n, dtype=torch.float32) * (rank + 1)
    agent.register_memory(buf)
    metas = comm.allgather(agent.get_agent_metadata())
    descs = comm.allgather(agent.get_serialized_descs(agent.get_xfer_descs(buf)))
    agent.add_remote_agent(metas[1 - rank])
    report = {}
    if rank == 1:
        remote = agent.deserialize_descs(descs[0])
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(buf), remote, "rank0", b"r")
        report["read_state"] = wait(agent, h)
        report["read_gbps"] = n * 4 / (time.perf_counter() - t0) / 1e9
        report["read_equal"] = bool(torch.equal(buf, torch.arange(n, dtype=torch.float32)))
        agent.release_xfer_handle(h)
        buf.mul_(3)  # now 3 * arange
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(buf), remote, "rank0", b"w")
        report["write_state"] = wait(agent, h)
        agent.release_xfer_handle(h)
    comm.Barrier()
    if rank == 0:
        report["write_equal"] = bool(torch.equal(buf, torch.arange(n, dtype=torch.float32) * 3))
    reports = comm.gather(report)
    if rank == 0:
        print(json.dumps({k: v for r in reports for k, v in r.items()}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
