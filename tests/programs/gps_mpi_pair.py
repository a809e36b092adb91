"""Two node agents on this host over MPI: `mpirun -n 2 python gps_mpi_pair.py MODEL_DIR JOB
TRANSPORT`.

Rank r is the agent of node n<r> (main thread); a client thread beside it Writes policy v1
(weights * 3 + 1, whole model) on n0, or on n1 waits for v1 and Reads it, which makes agent
n1 pull the whole model from n0 over the agents' transport. Each rank prints one JSON line:
the transport the agent reports (and why NIXL fell back, if it did), the number of MPI
messages its fetches used, and whether the Read equals the written weights.
"""
import json
import os
import sys
import threading

import torch
from mpi4py import MPI
from safetensors.torch import load_file

from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.layout import ParallelPlace


def client_side(job: str, node: str, rank: int, model_dir: str, report: dict) -> None:
    c = GPSClient(job, node)
    info = c.info()
    report.update(transport=info["transport"], fallback=info["transport_fallback"])
    new = {k: t * 3 + 1 for k, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    if rank == 0:
        report["version"] = c.write("policy", new, ParallelPlace(), layout="hf").wait(120)
    else:
        report["version"] = c.wait_version("policy", 1, timeout=120)
    got = c.read("policy")
    report["equal"] = all(torch.equal(got[k], new[k]) for k in new)
    c.shutdown_agent()
    c.close()


def main() -> None:
    model_dir, job, transport = sys.argv[1:4]
    comm = MPI.COMM_WORLD
    node = f"n{comm.rank}"
    agent = NodeAgent(AgentConfig(job, node, {"policy": model_dir}, transport=transport), comm)
    agent.start()
    report = {"rank": comm.rank}
    t = threading.Thread(target=client_side, args=(job, node, comm.rank, model_dir, report))
    t.start()  # the client only uses the socket and shared memory: MPI stays in this thread
    agent.serve_forever()
    t.join()
    report["chunks"] = getattr(agent.transport, "chunks_fetched", None)
    sys.stdout.write(json.dumps(report) + "\n")  # one write: ranks' lines do not mix
    sys.stdout.flush()


if __name__ == "__main__":
    main()
