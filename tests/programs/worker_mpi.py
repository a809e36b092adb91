"""One controller loop (rank 0) drives two device workers over MPI: rollout (rank 1) and
training (rank 2), commands interleaved, both reading from one GPS node agent.

usage: mpirun -n 3 python worker_mpi.py MODELS_DIR OUT.json
The controller starts the agent and broadcasts its address; the training worker publishes
the policy the rollout worker then Reads; training gets Shutdown with a Write in flight.
"""
from __future__ import annotations

import json
import os
import sys

from mpi4py import MPI

from pivotrl_hpc.protocol.engine import EngineOptions, Sampling
from pivotrl_hpc.protocol.messages import (AddSequences, RoleKind, SeqRequest, ShiftDown, ShiftUp,
                                           Shutdown, Step, TrainBatch, TrainStep, WaitWrite)
from pivotrl_hpc.runtime.serve import WorkerClient, serve

GREEDY = Sampling(temperature=0.0, ignore_eos=True)
ROLLOUT, TRAINING = 1, 2  # worker ranks


def worker(comm, models: str) -> None:
    from rendezvous import init_world_of_one

    from pivotrl_hpc.engines.megatron.trainer import OptimConfig, TrainerConfig
    from pivotrl_hpc.gps.client import GPSClient
    from pivotrl_hpc.runtime.worker import DeviceWorker, WorkerSpec

    job, node = comm.bcast(None, root=0)
    store = init_world_of_one()  # noqa: F841 - each worker its own world of one
    opts = EngineOptions(max_model_len=64, kv_cache_memory_bytes=16 * 2**20)
    spec = WorkerSpec(model_dirs={"policy": f"{models}/policy"},
                      engine_options={"policy": opts},
                      trainer_config=TrainerConfig(optim=OptimConfig(lr=1e-2, clip_grad=0)))
    client = GPSClient(job, node)
    try:
        serve(comm, DeviceWorker(spec, client), controller=0)
    finally:
        client.close()


def reply_dict(r) -> dict:
    return {"ok": r.ok, "role": r.role.value, "command": r.command, "result": r.result,
            "phases": sorted(r.phases), "error": (r.error or "").splitlines()[:1]}


def generate(w: WorkerClient, prefix: str, n_new: int = 8) -> dict[str, tuple]:
    w.call(AddSequences(tuple(SeqRequest(f"{prefix}{i}", (1, 20 + i, 5), max_new_tokens=n_new,
                                         sampling=GREEDY) for i in range(3))))
    finished = {}
    while len(finished) < 3:
        for o in w.call(Step()).result:
            finished.update({f.seq_id: (list(f.token_ids), list(f.logprobs))
                             for f in o.finished})
    return dict(sorted(finished.items()))


def make_batch(done: dict) -> TrainBatch:
    """Plain lists, as the controller sends them (a RolloutBatch is no message of the wire)."""
    seqs = list(done.values())
    return TrainBatch(tuple((1, 20 + i, 5) for i in range(3)),
                      tuple(tuple(t) for t, _ in seqs), tuple(tuple(lp) for _, lp in seqs),
                      (1.0, 0.0, 0.5), (0, 0, 0))


def controller(comm, models: str, out: str) -> None:
    from pivotrl_hpc.gps.local import local_agent

    with local_agent({"policy": f"{models}/policy"}, job=f"wmpi{os.getpid()}") as agent:
        comm.bcast((agent.job, agent.node), root=0)
        report = drive(WorkerClient(comm, ROLLOUT), WorkerClient(comm, TRAINING))
        client = agent.client()
        report["gps_current"] = client.state("policy").current
        client.close()
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


def drive(roll: WorkerClient, train: WorkerClient) -> dict:
    report = {"idle_shift_down": reply_dict(roll.call(ShiftDown()))}
    sent = [roll.submit(ShiftUp(RoleKind.ROLLOUT, 0)), train.submit(ShiftUp(RoleKind.TRAINING))]
    report["up"] = [reply_dict(roll.result()), reply_dict(train.result())]
    MPI.Request.Waitall(sent)
    first = generate(roll, "q")
    report["finished"] = {k: t for k, (t, _) in first.items()}
    # training steps and publishes while the rollout worker generates: one loop, both busy
    sent = train.submit(TrainStep(make_batch(first)))
    report["during_training"] = {k: t for k, (t, _) in generate(roll, "p").items()}
    report["train"] = reply_dict(train.result())
    sent.wait()
    report["wait_write"] = reply_dict(train.call(WaitWrite()))
    report["down"] = reply_dict(roll.call(ShiftDown()))
    report["up_new"] = reply_dict(roll.call(ShiftUp(RoleKind.ROLLOUT, 0)))
    report["after_training"] = {k: t for k, (t, _) in generate(roll, "q").items()}
    # Shutdown while training, the second step's Write not waited for
    report["train2"] = reply_dict(train.call(TrainStep(make_batch(first))))
    report["train_shutdown"] = reply_dict(train.call(Shutdown()))
    report["shutdown"] = reply_dict(roll.call(Shutdown()))
    return report


if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        controller(comm, sys.argv[1], sys.argv[2])
    else:
        worker(comm, sys.argv[1])
