"""Single-node GPS Writes: versions, pins, recycling, a full version table, a writer or the
agent dying. Each test writes a model of its own (the tiny policy under several names), so
the tests pass in any order."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pivotrl_hpc.gps import control
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.control import GPSUnavailable
from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.local import local_agent
from pivotrl_hpc.gps.segment import SHM_DIR
from pivotrl_hpc.gps.shapes import ModelShape

ALIASES = ("recycle", "retire", "table", "dies", "dropped")  # the policy folder under these names
ROOT = str(Path(__file__).resolve().parents[1])
DYING = str(Path(__file__).parent / "programs" / "gps_dying_writer.py")


@pytest.fixture(scope="module")
def agent(tiny_models):
    models = {m: str(tiny_models / m) for m in ("policy", "genrm")}
    models.update({a: str(tiny_models / "policy") for a in ALIASES})
    with local_agent(models) as a:
        yield a
    assert a.leftover == []


@pytest.fixture(scope="module")
def client(agent):
    c = agent.client()
    yield c
    c.close()


def _hf(tiny_models, model="policy"):
    return load_file(str(tiny_models / model / "model.safetensors"))


def _write_tp2(client, model, weights, shape):
    handles = [client.write(model, hf_to_megatron(weights, shape, r, 2), ParallelPlace(2, r))
               for r in range(2)]
    return {h.wait(30) for h in handles}


def _files(agent, model):
    prefix = f"pivotrl-{agent.job}-{agent.node}-{model}-"
    return {p.name[len(prefix):] for p in SHM_DIR.glob(prefix + "*")}


def _inode(client, model, version):
    with client.pin(model, version) as pin:
        return os.stat(pin.segment.path).st_ino


def test_write_versions_pins_and_recycling(client, agent, tiny_models):
    """Megatron shards written at TP=2 come back bit-exact; a pinned old version stays
    readable and is freed once unpinned; a retired version's segment (one spare) carries the
    next version."""
    hf, m = _hf(tiny_models), "recycle"
    shape = ModelShape.from_hf_config(tiny_models / "policy")
    v0 = client.state(m).current
    old = client.pin(m)
    buf = client.buffers(m)   # one buffer, Read into again after every Write
    inodes = {}
    for step in (1, 2):
        new = {k: v + step for k, v in hf.items()}
        assert _write_tp2(client, m, new, shape) == {v0 + step}
        got = client.read(m)
        assert all(torch.equal(got[k], new[k]) for k in hf)
        client.read(m, out=buf)
        assert all(torch.equal(buf[k], new[k]) for k in hf)
        inodes[v0 + step] = _inode(client, m, v0 + step)
    client.sync()
    st = client.state(m)
    assert st.current == v0 + 2 and st.live == (v0, v0 + 2)  # pinned v0 stays, v1 retired
    assert torch.equal(old.segment.tensor("lm_head.weight"), hf["lm_head.weight"])
    assert _files(agent, m) == {f"v{v0}", f"v{v0 + 1}.spare", f"v{v0 + 2}"}
    old.release()
    client.sync()
    assert client.state(m).live == (v0 + 2,)
    assert _files(agent, m) == {f"v{v0 + 1}.spare", f"v{v0 + 2}"}  # one spare at most
    assert _write_tp2(client, m, {k: v + 3 for k, v in hf.items()}, shape) == {v0 + 3}
    client.sync()
    assert _inode(client, m, v0 + 3) == inodes[v0 + 1]  # the spare, renamed into place
    assert _files(agent, m) == {f"v{v0 + 2}.spare", f"v{v0 + 3}"}
    got = client.read(m)
    assert all(torch.equal(got[k], hf[k] + 3) for k in hf)
    client.read(m, out=buf)   # the spare's inode under a new version: mapped afresh
    assert all(torch.equal(buf[k], hf[k] + 3) for k in hf)
    # the client keeps mappings of live versions only (v0+1 under the spare's inode dropped)
    assert {v for name, v, _ in client._maps if name == m} == {v0 + 3}
    # DP replicas other than rank 0 do not write
    h = client.write(m, {}, ParallelPlace(dp_size=2, dp_rank=1))
    assert h.done()
    # ... and with `follow` they wait for the version rank 0 writes (seen live: a DP rank 1
    # re-shifting up to training asked GPS for "v-1", the plain handle's version)
    follow = client.write(m, {}, ParallelPlace(dp_size=2, dp_rank=1), follow=v0 + 4)
    assert follow.version == v0 + 4 and not follow.done()
    with pytest.raises(TimeoutError):
        follow.wait(timeout=0.05)
    _write_tp2(client, m, {k: v + 4 for k, v in hf.items()}, shape)
    client.sync()
    assert follow.wait(timeout=10) == v0 + 4 and follow.done()


def test_write_accepts_trainer_parameters(client, tiny_models):
    """Megatron shards are Parameters (requires_grad), possibly in a narrower dtype."""
    hf = _hf(tiny_models, "genrm")
    shape = ModelShape.from_hf_config(tiny_models / "genrm")
    new = {k: (v * 0.5).to(torch.bfloat16) for k, v in hf.items()}
    handles = []
    for r in range(2):
        shard = {k: torch.nn.Parameter(t) for k, t in hf_to_megatron(new, shape, r, 2).items()}
        handles.append(client.write("genrm", shard, ParallelPlace(2, r)))
    version = {h.wait(30) for h in handles}
    got = client.read("genrm")
    assert client.state("genrm").current in version
    assert all(torch.equal(got[k], new[k].float()) for k in hf)


def test_pin_of_a_retired_or_future_version_is_refused(client, tiny_models):
    hf, m = _hf(tiny_models), "retire"
    v0 = client.state(m).current
    client.write(m, {k: t + 1 for k, t in hf.items()}, ParallelPlace(), layout="hf").wait(30)
    client.sync()
    assert client.state(m).live == (v0 + 1,)
    for v in (v0, v0 + 2):
        with pytest.raises(LookupError, match=rf"{m} v{v} is not live"):
            client.pin(m, v)
    with client.pin(m) as pin:
        assert pin.version == v0 + 1


def test_wait_version_returns_or_times_out(client):
    cur = client.state("genrm").current
    assert client.wait_version("genrm", cur, timeout=0) == cur
    with pytest.raises(TimeoutError, match=rf"genrm v{cur + 1} not published"):
        client.wait_version("genrm", cur + 1, timeout=0.1)


def test_more_versions_than_the_table_holds(client, agent, tiny_models):
    """With every slot of the control block pinned, the next version waits for a slot (the
    agent lives on) and is published as soon as a reader lets go of one."""
    hf, m = _hf(tiny_models), "table"
    v0 = client.state(m).current
    pins = [client.pin(m)]
    for v in range(v0 + 1, v0 + control.MAX_LIVE):
        client.write(m, {k: t + v for k, t in hf.items()}, ParallelPlace(), layout="hf").wait(30)
        pins.append(client.pin(m, v))
    last = v0 + control.MAX_LIVE
    h = client.write(m, {k: t + last for k, t in hf.items()}, ParallelPlace(), layout="hf")
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.5)
    client.sync()
    assert client.state(m) == control.ModelState(last - 1, tuple(range(v0, last)))
    pins.pop(0).release()
    assert h.wait(30) == last
    client.sync()
    assert client.state(m) == control.ModelState(last, tuple(range(v0 + 1, last + 1)))
    for p in pins:
        p.release()
    client.sync()
    assert client.state(m).live == (last,)
    got = client.read(m)
    assert all(torch.equal(got[k], hf[k] + last) for k in hf)


def test_a_pin_dropped_without_release_frees_its_version(client, agent, tiny_models):
    """Issue 11.6: a Pin that is garbage-collected unreleased (an exception path that lost it)
    gives its version back, or the version could never be retired."""
    import gc
    hf, m = _hf(tiny_models), "dropped"
    v0 = client.state(m).current
    pin = client.pin(m)
    client.write(m, {k: t + 1 for k, t in hf.items()}, ParallelPlace(), layout="hf").wait(30)
    client.sync()
    assert client.state(m).live == (v0, v0 + 1)      # v0 held by the pin
    del pin
    gc.collect()
    client.sync()
    assert client.state(m).live == (v0 + 1,)
    assert f"v{v0}" not in _files(agent, m)


def test_writer_dying_mid_write(client, agent, tiny_models):
    """TP rank 1 dies inside its Write: rank 0's handle times out, readers keep the last whole
    version, and a new rank 1 completes the same version."""
    hf, m = _hf(tiny_models), "dies"
    shape = ModelShape.from_hf_config(tiny_models / "policy")
    v0 = client.state(m).current
    new = {k: t * 2 for k, t in hf.items()}
    h0 = client.write(m, hf_to_megatron(new, shape, 0, 2), ParallelPlace(2, 0))
    p = subprocess.run([sys.executable, DYING, agent.job, agent.node,
                        str(tiny_models / "policy"), m, "5"],
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert p.returncode == -signal.SIGKILL
    with pytest.raises(TimeoutError, match=f"{m} v{v0 + 1} not replicated"):
        h0.wait(timeout=0.5)
    client.sync()
    assert client.state(m) == control.ModelState(v0, (v0,))
    got = client.read(m)
    assert all(torch.equal(got[k], hf[k]) for k in hf)  # the whole old version
    h1 = client.write(m, hf_to_megatron(new, shape, 1, 2), ParallelPlace(2, 1))
    assert (h0.wait(30), h1.wait(30)) == (v0 + 1, v0 + 1)
    got = client.read(m)
    assert all(torch.equal(got[k], new[k]) for k in hf)  # nothing of the dead writer's x101


def test_agent_dying_under_a_client(tiny_models):
    """kill -9 of the agent: a waiting handle and later requests raise ConnectionError
    (GPSUnavailable); a new client is refused at once, though the control block is left."""
    hf = _hf(tiny_models)
    shape = ModelShape.from_hf_config(tiny_models / "policy")
    with local_agent({"policy": str(tiny_models / "policy")}) as agent:
        c = agent.client()
        h = c.write("policy", hf_to_megatron(hf, shape, 0, 2), ParallelPlace(2, 0))
        agent.proc.kill()
        agent.proc.wait(10)
        with pytest.raises(ConnectionError, match="closed the connection"):
            h.wait(timeout=120)
        with pytest.raises(ConnectionError):
            c.info()
        with pytest.raises(GPSUnavailable, match=r"\(pid \d+\) is gone"):
            GPSClient(agent.job, agent.node, wait_s=0)  # its control block is still there
        c.close()
    assert agent.leftover is None  # killed: nothing of its own cleanup to check
