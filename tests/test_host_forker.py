"""The node's engine host forker (`runtime/host_forker.py`): one vLLM import for every worker
of a node, shared through an abstract socket, gone with the last session and host."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from proc_util import alive, ppid, wait_gone

from pivotrl_hpc.runtime import cgroup
from pivotrl_hpc.runtime import host_forker
from pivotrl_hpc.runtime.engine_host import EngineHost

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "programs" / "forker_peer.py"


@pytest.fixture
def node(monkeypatch):
    """A node's forker address of its own (not the test process's private forker)."""
    name = host_forker.node_address(f"t{uuid.uuid4().hex[:8]}", "n0", uuid.uuid4().hex[:16])
    monkeypatch.setenv(host_forker.ADDRESS_ENV, name)
    yield name
    host_forker.leave()


def _peer(tiny_models, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEER), str(tiny_models / "policy"), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_two_workers_of_a_node_share_one_forker_that_leaves_after_the_last(tiny_models, node):
    host = EngineHost(tiny_models / "policy", start=False, name="first")
    peer = _peer(tiny_models)
    try:
        host.preloaded()
        server = host_forker.server_pid()
        seen = json.loads(peer.stdout.readline())
        # the peer's host is a child of the same forker, which imported vLLM for both
        assert seen["server"] == server and seen["parent"] == server
        assert seen["host"] != host.pid and alive(host.pid)
        host.close()
        host_forker.leave()
        assert alive(server)            # the peer's session keeps it
        peer.communicate("\n", timeout=60)
        assert peer.returncode == 0
        assert wait_gone(server, 10)    # no session, no host: it leaves
    finally:
        peer.kill()
        host.close()


def test_a_hosts_exit_code_comes_from_the_forker_and_survives_its_death(tiny_models, node):
    first = EngineHost(tiny_models / "policy", start=False, name="first")
    second = EngineHost(tiny_models / "policy", start=False, name="second")
    try:
        first.preloaded()
        second.preloaded()
        os.kill(first.pid, signal.SIGKILL)
        first._proc.join(10)
        assert first._proc.exitcode == -signal.SIGKILL
        server = host_forker.server_pid()
        os.kill(server, signal.SIGKILL)
        # the forker is gone, the host is not: still alive, still answering
        time.sleep(0.2)
        assert second._proc.exitcode is None and second.call("preload") < 1.0
        second._proc.kill()                      # through its pidfd
        second._proc.join(10)
        assert second._proc.exitcode == host_forker.UNKNOWN_EXIT
        assert not alive(second.pid)
        # a worker whose forker was killed gets its next host from a new one (issue 47)
        third = EngineHost(tiny_models / "policy", start=False, name="third")
        try:
            third.preloaded()
            assert ppid(third.pid) == host_forker.server_pid() != server
            assert third.call("preload") < 1.0
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_a_host_forked_for_a_capped_worker_joins_its_cap(tiny_models, node):
    """The forker is outside every device's cap; a host forked for a capped worker is moved
    into that worker's group, so a later host cannot run uncapped."""
    job = f"forker{uuid.uuid4().hex[:6]}"
    cgroup.check_writable(job)
    peer = _peer(tiny_models, job)
    try:
        seen = json.loads(peer.stdout.readline())
        assert seen["quota"] == pytest.approx(0.5)
        assert cgroup.quota_of(seen["server"]) is None   # the forker itself: uncapped
        peer.communicate("\n", timeout=60)
        assert peer.returncode == 0
    finally:
        peer.kill()
        cgroup.remove_job(job, wait_s=5)


def test_a_worker_that_leaves_the_forker_and_asks_again_at_once_gets_a_host(tiny_models,
                                                                            node):
    """Issue 47: a forker that decided to leave held its name while it tore down (5 s and
    more), so a worker that ended the forker's last session and asked again at once, or a
    second worker of the node arriving then, met `ConnectionResetError` and got no engine
    host. The forker now gives up its name before anything else, and a worker that meets a
    leaving forker starts a new one."""
    host = EngineHost(tiny_models / "policy", start=False, name="first")
    host.preloaded()
    first = host_forker.server_pid()
    host.close()
    host_forker.leave()                  # the forker's last session and host: it leaves
    again = EngineHost(tiny_models / "policy", start=False, name="again")   # asks at once
    peer = None
    try:
        again.preloaded()
        second = host_forker.server_pid()
        assert ppid(again.pid) == second and again.call("preload") < 1.0
        again.close()
        host_forker.leave()              # it leaves again; a second worker arrives then
        peer = _peer(tiny_models)
        seen = json.loads(peer.stdout.readline() or "{}")
        assert seen and seen["parent"] == seen["server"], seen
        peer.communicate("\n", timeout=60)
        assert peer.returncode == 0
        assert wait_gone(first, 10) and wait_gone(second, 10) and wait_gone(seen["server"], 10)
    finally:
        if peer is not None:
            peer.kill()
        again.close()
