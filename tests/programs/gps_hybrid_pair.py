"""Two node agents on this host under the hybrid layout (k = 2: each holds about half of the
policy): `mpirun -n 2 python gps_hybrid_pair.py MODEL_DIR JOB TRANSPORT SCENARIO SYNC_DIR`.

Rank r is the agent of node n<r> (main thread) with a client thread beside it; the two
clients order their steps through files in SYNC_DIR. Each rank prints one JSON line.

slow-reader: n1 pins v0 while n0 Writes v1, v2, v3; then n1 Reads its pinned v0, whose other
  half only n0 holds (the Read fetches it from n0), releases the pin and waits until v0's
  memory is gone on both nodes.
faults: n0's agent refuses its first 7 MPI data requests (PIVOTRL_TEST_FAULTS=gps_nacks=7 on
  rank 0). n1 Reads v0 (its fetch from n0 fails 3 times: the Read raises);
  n0 Writes v1 (n1's replication fails 3 times: the Write raises on n0), then v2 (one
  failure, then it succeeds); n1 Reads v2.
full-shm: each rank has its own small shm file system (SHM_ROOTS: one folder per rank). n0's
  is filled to leave room for its own half of a version but not for the whole model its
  writer stores there until every node has it: the Write fails with the figure (never a
  SIGBUS), so does a Read's staging file there, v0 stays intact on both nodes (read again
  once the ballast is gone), and the agents go on.
"""
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

if "SHM_ROOTS" in os.environ:   # before pivotrl_hpc is imported: it reads the folder once
    os.environ["PIVOTRL_SHM_DIR"] = os.environ["SHM_ROOTS"].split(",")[
        int(os.environ["OMPI_COMM_WORLD_RANK"])]

import torch
from mpi4py import MPI
from safetensors.torch import load_file

from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.segment import SHM_DIR, segment_name

WAIT = 120.0


def weights(base: dict, v: int) -> dict:
    return {k: t * (1.0 + v) + 0.25 * v for k, t in base.items()}


def equal(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


class Sync:
    def __init__(self, folder: str):
        self.folder = Path(folder)

    def say(self, what: str) -> None:
        (self.folder / what).touch()

    def wait(self, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not (self.folder / what).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"never got {what}")
            time.sleep(0.01)


def v_files(job: str, v: int) -> list[str]:
    return [n for n in ("n0", "n1") if (SHM_DIR / segment_name(job, n, "policy", v)).exists()]


def wait_gone(job: str, v: int, seconds: float = 10.0) -> list[str]:
    """The nodes still holding version v once it is gone everywhere, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while v_files(job, v) and time.monotonic() < deadline:
        time.sleep(0.02)
    return v_files(job, v)


def slow_reader(c: GPSClient, rank: int, base: dict, sync: Sync, job: str, rep: dict) -> None:
    if rank == 0:
        sync.wait("pinned")
        for v in (1, 2, 3):
            assert c.write("policy", weights(base, v), ParallelPlace(), layout="hf").wait(WAIT) == v
        sync.say("written")
        return
    pin = c.pin("policy")
    sync.say("pinned")
    sync.wait("written")
    c.wait_version("policy", 3, WAIT)
    # v1, pinned nowhere, goes once both nodes released it; v0 must stay meanwhile
    rep["v1_held_on"] = wait_gone(job, 1)
    rep["v0_pinned_held_on"] = v_files(job, 0)
    rep["v0_equal"] = equal(c.read("policy", pin=pin), base)
    pin.release()
    rep["v0_released_held_on"] = wait_gone(job, 0)
    rep["v3_equal"] = equal(c.read("policy"), weights(base, 3))


def faults(c: GPSClient, rank: int, base: dict, sync: Sync, job: str, rep: dict) -> None:
    if rank == 0:
        sync.wait("read")
        try:
            c.write("policy", weights(base, 1), ParallelPlace(), layout="hf").wait(WAIT)
        except Exception as e:  # noqa: BLE001 - reported for the test to check
            rep["write_error"] = f"{type(e).__name__}: {e}"
        rep["v_next"] = c.write("policy", weights(base, 2), ParallelPlace(),
                                layout="hf").wait(WAIT)
        sync.say("written")
        return
    try:
        c.read("policy")
    except Exception as e:  # noqa: BLE001
        rep["read_error"] = f"{type(e).__name__}: {e}"
    sync.say("read")
    sync.wait("written")
    rep["current"] = c.wait_version("policy", 2, WAIT)
    rep["v2_equal"] = equal(c.read("policy"), weights(base, 2))
    rep["old_held_on"] = wait_gone(job, 0) + wait_gone(job, 1)   # v1 failed half-way


def full_shm(c: GPSClient, rank: int, base: dict, sync: Sync, job: str, rep: dict) -> None:
    if rank == 0:
        from pivotrl_hpc.gps.segment import SHM_ROOT
        store_half = sum(t.nbytes for t in base.values()) // 2
        st = os.statvfs(SHM_ROOT)
        with open(SHM_ROOT / "ballast", "wb") as f:   # room for this node's half, not more
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - store_half
                               - (1 << 20))
        try:
            c.write("policy", weights(base, 1), ParallelPlace(), layout="hf").wait(WAIT)
            rep["wrote"] = True
        except Exception as e:  # noqa: BLE001 - reported for the test to check
            rep["write_error"] = f"{type(e).__name__}: {e}"
        try:   # its staging file for n1's half does not fit either
            c.read("policy")
        except Exception as e:  # noqa: BLE001
            rep["read_error"] = f"{type(e).__name__}: {e}"
        (SHM_ROOT / "ballast").unlink()
        sync.say("failed")
    else:
        sync.wait("failed")
    rep["state"] = [c.state("policy").current, list(c.state("policy").live)]
    rep["v0_equal"] = equal(c.read("policy"), base)


def client_side(job, node, rank, model_dir, scenario, sync, rep) -> None:
    try:
        c = GPSClient(job, node)
        rep["k"] = c.ctl.group_size
        base = load_file(os.path.join(model_dir, "model.safetensors"))
        run = {"slow-reader": slow_reader, "faults": faults, "full-shm": full_shm}[scenario]
        run(c, rank, base, sync, job, rep)
        sync.say(f"done{rank}")
        sync.wait(f"done{1 - rank}")
        c.shutdown_agent()
        c.close()
    except BaseException as e:  # noqa: BLE001 - the report says what went wrong
        rep["error"] = f"{type(e).__name__}: {e}"
        sys.stderr.write(json.dumps(rep) + "\n")
        sys.stderr.flush()
        time.sleep(1)   # the agent's own traceback, if it failed, is printed meanwhile
        os._exit(3)


def main() -> None:
    model_dir, job, transport, scenario, sync_dir = sys.argv[1:6]
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    comm = MPI.COMM_WORLD
    node = f"n{comm.rank}"
    if scenario == "faults" and comm.rank == 0:
        os.environ["PIVOTRL_TEST_FAULTS"] = "gps_nacks=7"   # read by the MPI transport at start
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    cfg = AgentConfig(job, node, {"policy": model_dir}, budget_bytes=int(size * 0.75),
                      transport=transport)
    agent = NodeAgent(cfg, comm)
    agent.start()
    rep = {"rank": comm.rank}
    t = threading.Thread(target=client_side,
                         args=(job, node, comm.rank, model_dir, scenario, Sync(sync_dir), rep))
    t.start()  # the client only uses the socket and shared memory: MPI stays in this thread
    agent.serve_forever()
    t.join()
    sys.stdout.write(json.dumps(rep) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
