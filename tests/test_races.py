"""Races that a busy machine shows and a quiet one hides (issue 47), each forced here:
a Reload whose version a publish retired between its send and its read; a shift up that
named the current version and Read it after a publish retired it; a GPS control segment
opened between its creation and its sizing. (The forker that leaves while a worker asks
again: tests/test_host_forker.py.)"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from pivotrl_hpc.protocol.engine import EngineOptions, Sampling
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.local import local_agent

MiB = 2**20
OPTS = EngineOptions(max_model_len=128, kv_cache_memory_bytes=16 * MiB)
GREEDY = Sampling(temperature=0.0, ignore_eos=True)


def _weights(tiny_models: Path, seed: int) -> dict:
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(tiny_models / "policy" / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def _publish(client, weights: dict, retire: bool = True) -> int:
    """A training step's Write, landed: the new current version. `retire`: wait until the
    agent has retired the one before it (it does once no reader pins it)."""
    before = client.state("policy").current
    v = client.write("policy", weights, ParallelPlace(), layout="hf").wait(60)
    deadline = time.monotonic() + 30
    while retire and before in client.state("policy").live:
        assert time.monotonic() < deadline, f"v{before} never retired"
        time.sleep(0.01)
    return v


class RacingStore:
    """The worker's GPS client, with a step published right after the worker first names
    the current version: the interleaving a busy machine makes of a shift up's 'name the
    version, then Read it'. Named by a look at the versions (`state`), the version is
    retired before the Read; named by a pin, it cannot be (the pin holds it)."""

    def __init__(self, client, weights: dict):
        self.client, self.weights, self.raced = client, weights, None

    def state(self, model: str):
        st = self.client.state(model)
        self._race("state")
        return st

    def pin(self, model: str, version: int | None = None):
        got = self.client.pin(model, version)
        self._race("pin")
        return got

    def _race(self, how: str) -> None:
        if self.raced is None:
            self.raced = how
            _publish(self.client, self.weights, retire=how == "state")

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.parametrize("hosted", [True, False], ids=["engine_host", "in_process"])
def test_a_reload_of_a_version_retired_before_it_is_read_loads_a_newer_one(tiny_models,
                                                                           hosted):
    """Seen in test_learning[shiftable] under load: the controller sent Reload(5), v6 was
    published and v5 retired before the worker read it, and the job died of `LookupError:
    policy v5 is not live`. The worker now loads v5 or newer: v6 here."""
    from pivotrl_hpc.protocol.messages import (AddSequences, Reload, RoleKind, SeqRequest, ShiftUp,
                                               Shutdown, Step)
    from pivotrl_hpc.runtime.worker import DeviceWorker, WorkerSpec

    with local_agent({m: str(tiny_models / m) for m in ("policy", "genrm")}) as agent:
        client = agent.client()
        store = client if hosted else RacingStore(client, _weights(tiny_models, 1))
        spec = WorkerSpec(model_dirs={m: str(tiny_models / m) for m in ("policy", "genrm")},
                          engine_options={"policy": OPTS}, engine_process=hosted, device=7)
        worker = DeviceWorker(spec, store)
        try:
            up = worker.handle(ShiftUp(RoleKind.ROLLOUT))
            assert up.ok, up.error
            # in process: v1 was published between naming v0 and reading it; v0 is read
            assert up.result["version"] == up.result["read"] == 0
            assert hosted or store.raced == "pin"
            v = _publish(client, _weights(tiny_models, 2))
            sent = Reload(v)                        # the controller sends Reload(v) ...
            newer = _publish(client, _weights(tiny_models, 3))  # ... v + 1 lands first
            assert client.state("policy").live == (newer,)
            r = worker.handle(sent)
            assert r.ok, r.error
            assert r.result["version"] == newer == worker.version
            assert "parameters.load" in r.phases
            seqs = (SeqRequest("a", (5, 17, 99, 3), max_new_tokens=4, sampling=GREEDY),)
            assert worker.handle(AddSequences(seqs)).ok
            step = worker.handle(Step(4))
            assert step.ok, step.error
        finally:
            shut = worker.handle(Shutdown())
            client.close()
        assert shut.ok, shut.error


def test_a_control_segment_opened_between_create_and_size_is_never_seen_short():
    """Seen in test_gpu_check under load: `...-ctl is not a GPS control segment of uid 0
    (uid 0, 0 bytes)`: the agent created the file, then sized it, and a client opened it in
    between and gave up. The agent now makes it whole under a temporary name and links it
    into place. Forced here: clients open the name while the agent is held inside its sizing
    step; a client's attach loop (GPSClient) then gets the segment once it is whole."""
    from pivotrl_hpc.gps import control, shmdir

    shmdir.ensure(shmdir.SHM_DIR)
    path = shmdir.SHM_DIR / f"pivotrl-race{os.getpid()}-n0-ctl"
    sizing, release = threading.Event(), threading.Event()
    real = control.reserve_file

    def held(fd, p, offset, size):   # the agent stops between its create and its sizing
        sizing.set()
        assert release.wait(30)
        return real(fd, p, offset, size)

    made: list = []
    maker = threading.Thread(target=lambda: made.append(
        control.ControlBlock(path, create=True, token="t0")))
    control.reserve_file = held
    try:
        maker.start()
        assert sizing.wait(30)
        with pytest.raises(FileNotFoundError):   # nothing under the name until it is whole
            control.ControlBlock(path)
        seen: list = []
        client = threading.Thread(target=lambda: seen.append(_attach(path, 30)))
        client.start()
        time.sleep(0.2)
        assert client.is_alive() and not seen   # waiting for the name, not failed
        release.set()
        maker.join(30)
        client.join(30)
        assert len(made) == 1 and len(seen) == 1
        assert seen[0].agent_pid == os.getpid() and seen[0].token == "t0"
        seen[0].close()
    finally:
        control.reserve_file = real
        release.set()
        for c in made:
            c.close()
        path.unlink(missing_ok=True)
    assert not list(shmdir.SHM_DIR.glob(f"{path.name}*"))   # no temporary name left either


def test_a_short_control_file_is_retried_not_refused():
    """A control file shorter than a segment (a crash mid-make, or a make by another tree)
    is 'not ready', which a client retries until its deadline, not a PermissionError that
    ends it at once."""
    from pivotrl_hpc.gps import control, shmdir

    shmdir.ensure(shmdir.SHM_DIR)
    path = shmdir.SHM_DIR / f"pivotrl-short{os.getpid()}-n0-ctl"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        with pytest.raises(control.ControlNotReady, match="holds 0 of"):
            control.ControlBlock(path)
    finally:
        path.unlink()


def _attach(path: Path, wait_s: float):
    """GPSClient's attach loop (gps.client): retry what is not there or not whole yet."""
    from pivotrl_hpc.gps import control

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return control.ControlBlock(path)
        except (FileNotFoundError, RuntimeError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_a_tp_replica_whose_ranks_reload_across_a_publish_is_reloaded_to_the_newer():
    """Each rank of a TP replica loads the current version when it reads the Reload; a step
    published between two ranks' reads splits the replica (v5 on one rank, v6 on the
    other). The controller records the oldest (what bounds staleness) and reloads the
    replica to the newer before it steps again. The devices here are a recorder that the
    test answers: the one way to force that interleaving (no engine runs)."""
    from types import SimpleNamespace

    from pivotrl_hpc.controller.actions import ReplicaInfo
    from pivotrl_hpc.controller.shifts import Executor
    from pivotrl_hpc.protocol.messages import Reload, Reply, RoleKind

    sent = []

    class Recorder:
        handles = {0: None, 1: None}

        def send(self, devices, cmd, on_done):
            sent.append((tuple(devices), cmd, on_done))

    def reply(device: int, version: int) -> Reply:
        r = Reply("Reload", True, RoleKind.ROLLOUT, 0, result={"version": version},
                  phases={"parameters.load": 0.1})
        r.device = device
        return r

    rows = []
    flow = SimpleNamespace(versions={"r0": 4})
    ex = Executor(Recorder(), {"rollout": flow}, None, {}, None,
                  SimpleNamespace(append=lambda table, **row: rows.append((table, row))),
                  lambda: 0.0, lambda: None)
    ex.book.replicas["r0"] = ReplicaInfo("rollout", (0, 1))
    ex.published = 5
    ex.reload("r0")
    devices, cmd, done = sent.pop()
    assert devices == (0, 1) and cmd == Reload(5)
    done([reply(0, 5), reply(1, 6)])          # rank 1 read after v6 landed
    assert flow.versions["r0"] == 5 and rows[-1][1]["version"] == 5
    devices, cmd, done = sent.pop()
    assert devices == (0, 1) and cmd == Reload(6)
    done([reply(0, 6), reply(1, 6)])
    assert flow.versions["r0"] == 6 and not sent
