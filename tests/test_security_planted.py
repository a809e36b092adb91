"""Issue 46: files and names another account can create before the job does.

The attacker is the real `nobody` account (setpriv), with the system Python and the standard
library only; the job is root's, as in the third review.

- a checkpoint planted in a run folder `nobody` made first: its pickle must run nothing
  (checkpoints load without unpickling: checkpoint/treefile.py), and the folder is refused
  before any work, one line naming its owner and mode, exit 2;
- a run file planted as a symlink: never written through (the folder refused; in a folder
  shared on purpose, `trace.group_shared`, the link is replaced, not followed);
- a planted "previous job" marker (`*`): another job's GPS files stay;
- the GPS agent's listen backlog churned by `nobody`: the job's own connects all succeed,
  and a backlog refilled as fast as the agent accepts does not stop it serving;
- a stopped (SIGSTOP) agent: a request fails within seconds naming the state, not after the
  whole request deadline.
(The GPS folder squat is tests/test_security_gps.py, the TP rendezvous and shm names
test_security_tp.py.)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"


@pytest.fixture(scope="module", autouse=True)
def _root_only():
    if os.getuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("running code as a second account needs root and the system Python")


def _as_nobody(code: str, *args: str, group: bool = False, **kw) -> subprocess.Popen:
    """The attacker: setpriv execs the system Python as nobody (group nogroup: a member of a
    group-shared folder when `group`)."""
    groups = ["--groups=65534"] if group else ["--clear-groups"]
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", *groups,
                             "/usr/bin/python3", "-I", "-c", code, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _run_nobody(code: str, *args: str, group: bool = False) -> str:
    p = _as_nobody(code, *args, group=group)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return out


def _tmp_folder(prefix: str, mode: int):
    """A fresh folder of root under /tmp with `mode` (a fixture's body: yields it, then
    removes it with everything in it)."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(root, mode)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shared():
    """A world-writable sticky folder standing in for /tmp or a group scratch."""
    yield from _tmp_folder("pivotrl-planted-", 0o1777)


def _cfg(trace: Path, *more: str):
    from pivotrl_hpc.config import load_config

    return load_config(str(CONFIG), [f"trace.path={trace}", *more], check_files=False)


# ---- a planted checkpoint ------------------------------------------------------------------
PLANT_CHECKPOINT = r"""
import json, os, pickle, sys
out, marker = sys.argv[1], sys.argv[2]
os.mkdir(out, 0o755)
step = os.path.join(out, "job.checkpoints", "step-000001")
os.makedirs(os.path.join(step, "policy"))
os.makedirs(os.path.join(step, "optim"))
class Run:
    def __reduce__(self):
        return (os.system, ("touch " + marker,))
for name in ("rank-000.pt", "rank-000.safetensors"):   # the old name and the new one
    with open(os.path.join(step, "optim", name), "wb") as f:
        f.write(pickle.dumps(Run()))
with open(os.path.join(step, "state.json"), "w") as f:
    json.dump({"format": "pivotrl-checkpoint/1", "step": 1, "version": 1, "fixed": {}}, f)
open(os.path.join(step, "COMPLETE"), "w").close()
"""


def test_a_planted_checkpoint_is_refused_and_its_pickle_runs_nothing(shared):
    from pivotrl_hpc.checkpoint.layout import CheckpointError
    from pivotrl_hpc.checkpoint.state import prepare
    from pivotrl_hpc.runtime.checkpoint import load_training

    out, marker = shared / "out", shared / "ran"
    _run_nobody(PLANT_CHECKPOINT, str(out), str(marker))
    # the rank's optimizer file itself, as a training rank would load it: never unpickled
    # (the trainer is only the loader's device here: nothing of it is reached)
    try:
        load_training(SimpleNamespace(device="cpu"), out / "job.checkpoints" / "step-000001", 0)
        err = None
    except Exception as e:  # noqa: BLE001 - which one is asserted below
        err = e
    assert not marker.exists(), "the planted pickle ran as root"
    assert isinstance(err, CheckpointError), repr(err)
    # resume=auto would take it: the run folder (nobody's) is refused first, by name
    with pytest.raises(CheckpointError, match=r"out is a folder of uid 65534 \(nobody\) with "
                                              r"mode 755: not a folder of uid 0"):
        prepare(_cfg(out / "job.h5"))


def test_pivotrl_run_refuses_a_folder_nobody_made_in_one_line_exit_2(shared, tiny_models):
    out = shared / "out"
    _run_nobody("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)",
                str(out))
    from live_util import model_overrides

    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "run", str(CONFIG),
                        *model_overrides(tiny_models), f"trace.path={out / 'job.h5'}",
                        "--dry-run"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("pivotrl run:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"{out} is a folder of uid 65534 (nobody) with mode 777" in lines[0]
    assert "trace.group_shared" in lines[0]


# ---- a run file planted as a symlink -------------------------------------------------------
PLANT_LINK = r"""
import os, sys
out, victim, mine = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if mine:
    os.mkdir(out, 0o755)
os.symlink(victim, os.path.join(out, "job.config.json"))
"""


def _write_run_files(trace: Path, *more: str):
    from pivotrl_hpc.launch import local

    run = local.prepare(_cfg(trace, *more), cpu_cap=False)
    local.write_files(run)
    return run


def test_a_run_file_planted_as_a_symlink_is_never_written_through(shared, tmp_path):
    from pivotrl_hpc.launch.layout import LaunchError

    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = shared / "out"
    _run_nobody(PLANT_LINK, str(out), str(victim), "1")
    with pytest.raises(LaunchError, match=r"out is a folder of uid 65534 \(nobody\)"):
        _write_run_files(out / "job.h5")
    assert victim.read_text() == "keep"


def test_in_a_group_shared_folder_a_planted_link_is_replaced_not_followed(shared, tmp_path):
    """trace.group_shared: a folder of root, group nogroup, 2770; `nobody` (a member)
    plants the link; the run's config replaces it and the victim stays."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = shared / "grp"
    out.mkdir()
    os.chown(out, 0, NOBODY)
    os.chmod(out, 0o2770)
    _run_nobody(PLANT_LINK, str(out), str(victim), "0", group=True)
    from pivotrl_hpc.launch.layout import LaunchError
    with pytest.raises(LaunchError, match="writable by its group"):   # no opt-in: refused
        _write_run_files(out / "job.h5")
    run = _write_run_files(out / "job.h5", "trace.group_shared=true")
    assert victim.read_text() == "keep"
    assert not run.paths.config_json.is_symlink()
    assert json.loads(run.paths.config_json.read_text())["trace"]["group_shared"] is True


# ---- a planted "previous job" marker ---------------------------------------------------------
SWEEP = r"""
import sys
from pathlib import Path
from pivotrl_hpc.config import load_config
from pivotrl_hpc.launch import local
cfg = load_config(sys.argv[1], [f"trace.path={sys.argv[2]}", *sys.argv[3:]], check_files=False)
try:
    local.write_files(local.prepare(cfg, cpu_cap=False))
except Exception as e:
    print(type(e).__name__, e, file=sys.stderr)
    sys.exit(3)
"""


@pytest.mark.parametrize("shared_opt_in", [False, True])
def test_a_planted_job_marker_sweeps_no_other_jobs_files(shared, tmp_path, shared_opt_in):
    """`job.logs/job` holding `*` made the launcher's sweep glob `pivotrl-*-*` in the user's
    GPS folder and unlink another live job's segments and control file."""
    shm = tmp_path / "shm"      # the old code's folder is <PIVOTRL_SHM_DIR>/pivotrl-u0: the
    gps = shm / "pivotrl-u0"   # same one, so a run on it sweeps only this test's files
    gps.mkdir(mode=0o700, parents=True)
    others = [gps / f"pivotrl-other{os.getpid()}-n0-{n}" for n in ("ctl", "policy-v3")]
    for f in others:
        f.write_bytes(b"x")
    out = shared / "out"
    if shared_opt_in:   # a group-shared folder: nobody, a member, plants the marker
        out.mkdir()
        os.chown(out, 0, NOBODY)
        os.chmod(out, 0o2770)
        (out / "job.logs").mkdir()
        os.chown(out / "job.logs", 0, NOBODY)
        os.chmod(out / "job.logs", 0o2770)
        _run_nobody("import sys; open(sys.argv[1], 'w').write('*\\n')",
                    str(out / "job.logs" / "job"), group=True)
    else:               # nobody made the run folder first
        _run_nobody("import os, sys; os.makedirs(sys.argv[1] + '/job.logs', 0o755); "
                    "open(sys.argv[1] + '/job.logs/job', 'w').write('*\\n')", str(out))
    env = {**os.environ, "PIVOTRL_SHM_DIR": str(shm), "PIVOTRL_GPS_DIR": str(gps)}
    more = ["trace.group_shared=true"] if shared_opt_in else []
    p = subprocess.run([sys.executable, "-c", SWEEP, str(CONFIG), str(out / "job.h5"), *more],
                       env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert all(f.exists() for f in others), f"another job's files were swept: {p.stderr}"
    if shared_opt_in:
        assert p.returncode == 0, p.stderr[-2000:]
        assert "ignored the job marker" in p.stderr
    else:
        assert p.returncode == 3 and "uid 65534 (nobody)" in p.stderr, p.stderr[-2000:]


# ---- the agent's listen backlog churned by nobody ----------------------------------------------
CHURN = r"""
import socket, sys, time
job = sys.argv[1]
name = None
while name is None:
    for line in open("/proc/net/unix"):
        part = line.split()[-1]
        if part.startswith("@") and ("pivotrl-" + job + "-n0-") in part:
            name = "\0" + part[1:]
    time.sleep(0.01)
print("found", flush=True)
end = time.monotonic() + float(sys.argv[2])
held = []
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(name)
        held.append(s)
    except OSError:
        s.close()
    if len(held) > 64:
        for s in held:
            s.close()
        held = []
"""


def _sweep(job: str) -> None:
    """What a killed agent left (a failed run): /dev/shm is clean on every exit."""
    from pivotrl_hpc.gps import segment

    segment.sweep(job)


def _serve(tiny_models, job: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve",
                             "--job", job, "--node", "n0", "--model",
                             f"policy={tiny_models / 'policy'}"],
                            stderr=subprocess.PIPE, text=True)


def test_nobody_churning_the_agents_backlog_fails_none_of_the_jobs_connects(tiny_models):
    from pivotrl_hpc.gps.agent import control_path
    from pivotrl_hpc.gps.client import GPSClient
    from pivotrl_hpc.gps.control import GPSUnavailable

    job = f"churn{os.getpid()}"
    agent = _serve(tiny_models, job)
    churners = []
    try:
        while not control_path(job, "n0").exists():
            assert agent.poll() is None, agent.stderr.read()[-2000:]
            time.sleep(0.05)
        churners = [_as_nobody(CHURN, job, "120") for _ in range(3)]
        for c in churners:
            assert c.stdout.readline().strip() == "found"
        # 100 connects: before the retry on a full backlog 187 of 300 failed (issue 46), so
        # none failing of 100 still tells the fix; they took ~40 s while the agent's accept
        # loop ran as long as the churners refilled its backlog, ~1 s since (issue 51)
        failed, n = [], 100
        for _ in range(n):
            try:
                c = GPSClient(job, "n0", wait_s=30)
                c.info()
                c.close()
            except GPSUnavailable as e:
                failed.append(str(e))
        assert not failed, f"{len(failed)} of {n} connects failed: {failed[:2]}"
        c = GPSClient(job, "n0", wait_s=30)
        c.shutdown_agent()
        c.close()
        assert agent.wait(60) == 0, agent.stderr.read()[-2000:]
    finally:
        for c in churners:
            c.kill()
            c.wait()
        agent.kill()
        agent.wait()
        _sweep(job)


def test_a_backlog_refilled_while_the_agent_accepts_does_not_stop_it_serving(monkeypatch):
    """The cause the test above found slow (issue 51): the agent's accept loop ran until the
    backlog was empty, and churners refilled it as fast as it accepted, so a registered
    client's request waited. A churner exactly as fast as the agent cannot be made on demand:
    here each accept's credential check refills the backlog (a mock injecting that fault);
    the request is answered within the turn, after at most ACCEPTS_PER_TURN accepts."""
    import socket

    from pivotrl_hpc.gps import conns

    address = f"\0pivotrl-test-accept-{os.getpid()}"
    listener = conns.ClientListener(address, token="t")
    job = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def connect_one() -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(address)
        except BlockingIOError:   # the backlog is full
            return False
        finally:
            s.close()   # still queued: the agent accepts it (and reads its end)
        return True

    accepted, served_after = [], []
    real = conns.peer_credentials

    def refilling(sock):   # each accept: one more connection queued, up to 1000
        accepted.append(1)
        if len(accepted) < 1000:
            connect_one()
        return real(sock)

    try:
        job.connect(address)
        job.sendall(b'{"op": "hello", "token": "t"}\n{"op": "ping"}\n')
        while not listener.conns or not next(iter(listener.conns.values())).registered:
            listener.poll(0.1, lambda c, m: served_after.append(len(accepted)))
        served_after.clear()
        job.sendall(b'{"op": "ping"}\n')
        while connect_one():   # the backlog full
            pass
        monkeypatch.setattr(conns, "peer_credentials", refilling)
        accepted.clear()
        listener.poll(0.1, lambda c, m: served_after.append(len(accepted)))
        assert served_after and served_after[0] <= conns.ACCEPTS_PER_TURN, \
            (served_after, len(accepted))
    finally:
        job.close()
        listener.close()


# ---- a stopped agent -------------------------------------------------------------------------
def test_a_stopped_agent_fails_a_request_in_seconds_naming_the_state(tiny_models):
    from pivotrl_hpc.gps.agent import control_path
    from pivotrl_hpc.gps.channel import STOPPED_S
    from pivotrl_hpc.gps.client import GPSClient
    from pivotrl_hpc.gps.control import GPSUnavailable

    job = f"stop{os.getpid()}"
    agent = _serve(tiny_models, job)
    try:
        while not control_path(job, "n0").exists():
            assert agent.poll() is None, agent.stderr.read()[-2000:]
            time.sleep(0.05)
        c = GPSClient(job, "n0", wait_s=60, request_s=30)
        assert c.info()["node"] == "n0"
        os.kill(agent.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(GPSUnavailable, match=r"is T \(stopped\) for over 5 s"):
            c.info()
        took = time.monotonic() - t0
        assert STOPPED_S <= took < 15, took   # not the 30 s request deadline
        os.kill(agent.pid, signal.SIGCONT)
        c.close()
        c = GPSClient(job, "n0", wait_s=60)
        assert c.info()["node"] == "n0"   # running again: served again
        c.shutdown_agent()
        c.close()
        assert agent.wait(60) == 0, agent.stderr.read()[-2000:]
    finally:
        os.kill(agent.pid, signal.SIGCONT) if agent.poll() is None else None
        agent.kill()
        agent.wait()
        _sweep(job)
