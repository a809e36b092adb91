"""Node agents on this host over MPI: `mpirun -n N python gps_mpi_pair.py MODEL_DIR JOB
TRANSPORT [relay-refuses|relay-stalls]`.

Rank r is the agent of node n<r> (main thread); a client thread beside it Writes policy v1
(weights * 3 + 1, whole model) on n0, or on every other node waits for v1 and Reads it, which
makes the other agents replicate the whole model from n0: n1 from n0, and with three nodes n2
from n1 (the chain of plan.chain), piece by piece. Each rank prints one JSON line: the
transport the agent reports (and why NIXL fell back, if it did), the number of MPI messages
its fetches used, the bytes its MPI transport served to each peer, how its replication came
(the agent's `replications`: bytes per source node, steps, relays dropped), and whether the
Read equals the written weights.

relay-refuses: the injected fault (transport.py) makes n1's MPI transport refuse every data
request it serves, as a relay whose segment is gone would: n2 must drop n1 and pull v1 from n0.
relay-stalls: n0's client stops n1's process (SIGSTOP) before it Writes; n2, whose agent waits
1 s on a silent relay, drops n1 and pulls v1 from n0; once n2 has published v1, n0's client lets
n1 go on (SIGCONT), which then replicates v1 too, and the Write completes.
"""
import json
import logging
import os
import signal
import sys
import threading

import torch
from mpi4py import MPI
from safetensors.torch import load_file

from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.layout import ParallelPlace


def client_side(job: str, node: str, rank: int, model_dir: str, stop: int | None,
                report: dict) -> None:
    c = GPSClient(job, node)
    info = c.info()
    report.update(transport=info["transport"], fallback=info["transport_fallback"])
    new = {k: t * 3 + 1 for k, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    if rank == 0:
        if stop is not None:
            os.kill(stop, signal.SIGSTOP)
        handle = c.write("policy", new, ParallelPlace(), layout="hf")
        if stop is not None:   # n2's agent published v1 without n1: let n1 go on
            GPSClient(job, "n2").wait_version("policy", 1, timeout=120)
            os.kill(stop, signal.SIGCONT)
        report["version"] = handle.wait(120)
        report["sources"] = c._chan.notices[("policy", 1)]["sources"]
    else:
        report["version"] = c.wait_version("policy", 1, timeout=120)
    got = c.read("policy")
    report["equal"] = all(torch.equal(got[k], new[k]) for k in new)
    c.shutdown_agent()
    c.close()


def main() -> None:
    model_dir, job, transport = sys.argv[1:4]
    scenario = sys.argv[4] if len(sys.argv) > 4 else ""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    comm = MPI.COMM_WORLD
    node = f"n{comm.rank}"
    if scenario == "relay-refuses" and comm.rank == 1:
        os.environ["PIVOTRL_TEST_FAULTS"] = "gps_nacks=1000"   # read by the MPI transport at start
    pids = comm.allgather(os.getpid())
    stop = pids[1] if scenario == "relay-stalls" and comm.rank == 0 else None
    agent = NodeAgent(AgentConfig(job, node, {"policy": model_dir}, transport=transport,
                                  relay_wait_s=1.0 if scenario == "relay-stalls" else 10.0),
                      comm)
    agent.start()
    report = {"rank": comm.rank}
    t = threading.Thread(target=client_side, args=(job, node, comm.rank, model_dir, stop,
                                                   report))
    t.start()  # the client only uses the socket and shared memory: MPI stays in this thread
    agent.serve_forever()
    t.join()
    report["chunks"] = getattr(agent.transport, "chunks_fetched", None)
    report["served"] = getattr(agent.transport, "bytes_served", None)
    report["replication"] = agent.replications.get("policy")
    sys.stdout.write(json.dumps(report) + "\n")  # one write: ranks' lines do not mix
    sys.stdout.flush()


if __name__ == "__main__":
    main()
