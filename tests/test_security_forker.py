"""Another account against the job's engine host forker and host pipes (issue 35 N1/N2/N4),
and the forker's end with its job (issue 36 point 8).

The attacker is the real `nobody` account (`runuser`), with the system Python and the
standard library only (tests/programs/forker_attacker.py); the job is this (root) process.
A command that would run in the job's processes creates a marker in a folder only root can
write: the marker's presence proves the attack ran code as the job's user.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from proc_util import alive, wait_gone

from pivotrl_hpc.runtime import host_forker
from pivotrl_hpc.runtime.engine_host import EngineHost, EngineHostError

ROOT = Path(__file__).resolve().parents[1]
ATTACKER = (ROOT / "tests" / "programs" / "forker_attacker.py").read_text()
STARTER = ROOT / "tests" / "programs" / "forker_starter.py"
SECRET = f"s3cret-{uuid.uuid4().hex}"
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path(RUNUSER).exists() or not Path("/usr/bin/python3").exists(),
    reason="needs root (the job) and runuser to act as `nobody` (the attacker)")


def _nobody(*args: str, pass_fds=()) -> subprocess.Popen:
    """The attacker: `nobody`, the system Python, this file's program given on -c."""
    return subprocess.Popen([RUNUSER, "-u", "nobody", "--", "/usr/bin/python3", "-c",
                             ATTACKER, *args], stdout=subprocess.PIPE, text=True,
                            pass_fds=pass_fds, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture
def marker(tmp_path):
    os.chmod(tmp_path, 0o700)   # `nobody` cannot create it itself
    path = tmp_path / "ran"
    yield path, f"id > {path}"


@pytest.fixture
def address(monkeypatch):
    name = host_forker.node_address(f"t{uuid.uuid4().hex[:8]}", "n0", uuid.uuid4().hex[:16])
    monkeypatch.setenv(host_forker.ADDRESS_ENV, name)
    monkeypatch.setenv("PIVOTRL_TEST_SECRET", SECRET)
    yield name
    host_forker.leave()


def test_a_pickle_sent_to_the_forker_by_another_account_runs_nothing(address, marker):
    """N1: the root forker unpickled a FORK request from `nobody` and ran its command."""
    path, cmd = marker
    host_forker.ensure_running()
    server = host_forker.server_pid()       # imported and serving
    attacker = _nobody("fork", address, cmd)
    out, _ = attacker.communicate(timeout=90)
    seen = json.loads(out)
    assert seen["reply"] is None            # closed unanswered
    time.sleep(0.5)
    assert not path.exists()
    assert alive(server) and host_forker.server_pid() == server   # and still serving
    # the job's own user gets a host only for itself: a typed request for another pid is
    # closed unanswered too
    assert _fork_for(address, worker_pid=1) == b""
    assert alive(server)


def _fork_for(name: str, worker_pid: int) -> bytes:
    payload = host_forker.FORKER_WIRE.encode(host_forker.ForkRequest(worker_pid, "x", {}))
    r, w = os.pipe()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect("\0" + name)
        socket.send_fds(sock, [host_forker.FORK + host_forker.REQUEST_LEN.pack(len(payload))
                               + payload], [r, w, 2])
        os.close(r)
        os.close(w)
        return sock.recv(8)


def test_a_squatted_forker_name_gets_nothing_from_the_worker(address, marker, tiny_models):
    """N2: `nobody` bound the forker's name first; the worker sent it its environment and
    pipe ends (and took a pickle back through the pipe). Now: a clear refusal naming the
    holder, and not a byte of the worker's reaches it."""
    path, cmd = marker
    squatter = _nobody("squat", address, "5", cmd)
    try:
        assert json.loads(squatter.stdout.readline()) == {"bound": address}
        with pytest.raises(host_forker.ForkerRefused, match=r"nobody \(uid 65534\), pid"):
            host = EngineHost(tiny_models / "policy", start=False, name="squatted")
            host.preloaded()                # old code: reads the squatter's pickle here
        seen = json.loads(squatter.communicate(timeout=30)[0])
    finally:
        squatter.kill()
    assert SECRET not in seen["received"] and seen["fds"] == 0
    assert seen["received"] == ""           # not even the session byte
    assert not path.exists()


def test_a_pickle_written_into_a_host_pipe_runs_nothing_in_the_worker(marker, tiny_models,
                                                                       monkeypatch):
    """A host pipe in the wrong hands (how N2 ran code in the worker). The peer checks keep
    the pipe's end from other accounts now, so it is handed over here on purpose: fault
    injection, `fork_host` replaced by one that gives the host's end to `nobody`."""
    path, cmd = marker
    attackers: list[subprocess.Popen] = []

    def fork_to_nobody(worker_pid, name, env, conn_fd):
        attackers.append(_nobody("pipe", str(conn_fd), cmd, pass_fds=(conn_fd,)))
        assert json.loads(attackers[-1].stdout.readline()) == {"written": True}
        status_r, status_w = os.pipe()
        os.close(status_w)   # no forker: the pidfd says whether the "host" lives
        return host_forker.ForkedHost(attackers[-1].pid, status_r)

    monkeypatch.setattr(host_forker, "fork_host", fork_to_nobody)
    host = EngineHost(tiny_models / "policy", start=False, name="handed over")
    try:
        with pytest.raises(EngineHostError, match="bad reply to preload"):
            host.preloaded()
        assert not path.exists()
        assert wait_gone(attackers[0].pid, 10)   # the worker killed what answered
    finally:
        host.close()
        for proc in attackers:
            proc.kill()


def _starter() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(STARTER)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, json.loads(proc.stdout.readline())["forker"]


def test_a_forker_dies_with_a_worker_killed_while_it_imports(address):
    """Issue 36 point 8: a job cancelled during its start-up left its forkers importing,
    then waiting out their 120 s orphan timeout."""
    starter, forker = _starter()
    try:
        assert alive(forker)
        starter.kill()                    # scancel's SIGKILL, mid-import
        assert wait_gone(forker, 5)
    finally:
        starter.kill()


def test_a_forker_outlives_its_starter_while_another_worker_holds_a_session(address,
                                                                            tiny_models):
    """The parent death signal covers the import only: a forker that serves the node stays
    while any worker's session is open, then leaves with the last one within seconds."""
    starter, forker = _starter()
    try:
        assert host_forker.server_pid() == forker   # this worker's session, after the import
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        time.sleep(1.0)
        assert alive(forker)
        host = EngineHost(tiny_models / "policy", start=False, name="after the starter")
        assert host.preloaded() < 1.0 and host.call("preload") < 1.0
        host.close()
        host_forker.leave()
        assert wait_gone(forker, 5)
    finally:
        starter.kill()

