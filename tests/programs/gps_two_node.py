"""GPS across nodes: `srun --mpi=pmix -N2 --ntasks-per-node=3 python gps_two_node.py MODELS_DIR
[--budget-mb X] [--transport nixl|mpi] [--hold]`.

Local rank 0 of each node is the node agent; the other two ranks are workers (TP ranks 0, 1).
Workers print one JSON line each with the transport their agent runs and sha256 checksums of
what they Read against what they expect (computed from the HF files), per scenario:
  read0:  v0 of policy and GenRM at TP=2;
  write1: node 1's two workers Write policy v1 (Megatron shards, TP=2); every worker reads it;
  write2: TP rank 0 on node 1 and TP rank 1 on node 2 Write v2 together; every worker reads it.
`--hold` makes the agents serve until killed (the scancel test).
"""
import argparse
import hashlib
import json
import logging
import os
import sys
import time

from mpi4py import MPI
from safetensors.torch import load_file

from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace, target_index
from pivotrl_hpc.gps.shapes import ModelShape


WAIT = 120.0


def digest(sd: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def expected(hf: dict, shape: ModelShape, place: ParallelPlace) -> dict:
    out = {}
    for k, t in hf.items():
        idx = target_index(k, tuple(t.shape), shape, place)
        out[k] = t[idx]
    return out


def version_weights(hf: dict, v: int) -> dict:
    return {k: t * (1.0 + v) + 0.25 * v for k, t in hf.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models")
    ap.add_argument("--budget-mb", type=float, default=None)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--wait", type=float, default=120.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    global WAIT
    WAIT = a.wait
    world = MPI.COMM_WORLD
    job = os.environ["SLURM_JOB_ID"]
    node = os.environ["SLURMD_NODENAME"]
    # group by node name: also right under plain mpirun, where every rank shares one host
    nodes = sorted(set(world.allgather(node)))
    local = world.Split(nodes.index(node), world.rank)
    is_agent = local.rank == 0
    role_comm = world.Split(0 if is_agent else 1, world.rank)
    models = {m: os.path.join(a.models, m) for m in ("policy", "genrm")}
    if is_agent:
        budget = int(a.budget_mb * 2**20) if a.budget_mb else None
        agent = NodeAgent(AgentConfig(job, node, models, budget, a.transport), comm=role_comm)
        agent.start()
        world.Barrier()
        if a.hold:
            sys.stdout.write(json.dumps({"agent": node, "ready": True}) + "\n")
            sys.stdout.flush()
        agent.serve_forever()
        return
    world.Barrier()
    if a.hold:
        while True:
            time.sleep(1)
    run_worker(role_comm, local.rank - 1, job, node, models)


def run_worker(comm, tp_rank: int, job: str, node: str, models: dict) -> None:
    c = GPSClient(job, node)
    place = ParallelPlace(tp_size=2, tp_rank=tp_rank)
    hf = {m: load_file(os.path.join(d, "model.safetensors")) for m, d in models.items()}
    shapes = {m: ModelShape.from_hf_config(d) for m, d in models.items()}
    info = c.info()
    report = {"node": node, "tp_rank": tp_rank, "k": c.ctl.group_size,
              "transport": info["transport"], "transport_fallback": info["transport_fallback"]}
    t = time.perf_counter()
    for m in models:
        got = c.read(m, place)
        report[f"read0_{m}"] = [digest(got), digest(expected(hf[m], shapes[m], place))]
    report["read0_s"] = time.perf_counter() - t
    for m in models:  # hybrid layout: tmpfs pages actually held on this node vs full size
        with c.pin(m) as pin:
            st = os.stat(pin.segment.path)
            report[f"resident_{m}"] = [st.st_blocks * 512, st.st_size]
    on_first_node = comm.rank < 2
    # write1: node 1's two workers write v1
    if on_first_node:
        w = version_weights(hf["policy"], 1)
        h = c.write("policy", hf_to_megatron(w, shapes["policy"], tp_rank, 2), place)
        report["write1_version"] = h.wait(WAIT)
    comm.Barrier()
    c.wait_version("policy", 1, timeout=WAIT)
    got = c.read("policy", place, version=None)
    report["write1"] = [digest(got), digest(expected(version_weights(hf["policy"], 1),
                                                     shapes["policy"], place))]
    report["write1_full"] = [digest(c.read("policy")), digest(version_weights(hf["policy"], 1))]
    comm.Barrier()
    # write2: TP rank 0 on node 1 and TP rank 1 on node 2 write v2 together
    if (on_first_node and tp_rank == 0) or (not on_first_node and tp_rank == 1):
        w = version_weights(hf["policy"], 2)
        h = c.write("policy", hf_to_megatron(w, shapes["policy"], tp_rank, 2), place)
        report["write2_version"] = h.wait(WAIT)
    comm.Barrier()
    c.wait_version("policy", 2, timeout=WAIT)
    report["write2"] = [digest(c.read("policy", place)),
                        digest(expected(version_weights(hf["policy"], 2), shapes["policy"], place))]
    report["state"] = list(c.state("policy").live)
    comm.Barrier()
    if tp_rank == 1:
        c.shutdown_agent()
    c.close()
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
