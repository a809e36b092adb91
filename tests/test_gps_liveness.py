"""GPS under faults (issue 11): a client whose agent is gone gets GPSUnavailable within 5 s
without spinning; a failed pin frees its version; another account cannot use the agent or
make a client read planted files, nor put anything in the user's GPS folder; idle
connections and a client that never reads its replies do not stop the agent serving the job
(now in test_gps_agent_faults.py, with the floods of issue 35)."""
from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivotrl_hpc.gps import control, shmdir
from pivotrl_hpc.gps.agent import control_path, socket_address
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.control import ControlBlock, GPSUnavailable
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.local import local_agent
from pivotrl_hpc.gps.segment import SHM_DIR, SegmentError, segment_name

OTHER = "pivotrl-other"          # a second Unix account, made for these tests


def agent_address(job: str, node: str) -> str:
    """The agent's socket name: its random token is in the control file."""
    ctl = ControlBlock(control_path(job, node))
    try:
        return socket_address(job, node, ctl.token)
    finally:
        ctl.close()


def _timed(fn) -> tuple[float, float, BaseException | None]:
    """Wall and CPU seconds of fn(), and what it raised."""
    t, c = time.monotonic(), time.process_time()
    try:
        fn()
        err = None
    except BaseException as e:  # noqa: BLE001 - returned to the test
        err = e
    return time.monotonic() - t, time.process_time() - c, err


def test_a_client_of_a_killed_agent_gets_gpsunavailable_fast_and_idle(tiny_models):
    with local_agent({"policy": str(tiny_models / "policy")}) as agent:
        c = agent.client()
        c.read("policy", ParallelPlace(1, 0))                  # it worked
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
        wall, cpu, err = _timed(lambda: c.wait_version("policy", 5, timeout=60))
        assert isinstance(err, GPSUnavailable) and "is gone" in str(err), err
        assert wall < 5 and cpu < 0.5 * wall + 0.05, (wall, cpu)   # waited, did not spin
        print(f"GPSUnavailable after {wall * 1e3:.0f} ms, {cpu * 1e3:.0f} ms CPU")
        with pytest.raises(GPSUnavailable):
            c.read("policy", ParallelPlace(1, 0))
        c.close()


def test_a_seqlock_left_odd_by_a_dead_writer_does_not_spin_forever(tmp_path, monkeypatch):
    ctl = ControlBlock(tmp_path / "ctl", create=True)   # not in /dev/shm: nothing to leave
    try:
        ctl.publish("policy", 0, (0,))
        dead = subprocess.Popen(["true"])
        dead.wait()
        ctl.mm[8:16] = dead.pid.to_bytes(8, "little")          # the "agent" is gone
        i = (ctl._slot("policy") + 64) // 8
        ctl._words[i] += 1                                     # killed mid-publish
        wall, cpu, err = _timed(lambda: ctl.state("policy"))
        assert isinstance(err, GPSUnavailable) and "is gone" in str(err), err
        assert wall < 1 and cpu < 0.5
        ctl.mm[8:16] = os.getpid().to_bytes(8, "little")       # alive, but never finishing
        monkeypatch.setattr(control, "STALL_S", 0.5)
        wall, cpu, err = _timed(lambda: ctl.state("policy"))
        assert isinstance(err, GPSUnavailable) and "mid-publish" in str(err), err
        assert wall < 2 and cpu < 0.5 * wall + 0.05, (wall, cpu)
    finally:
        ctl.close()


def test_a_failed_pin_leaves_no_lock_behind(tiny_models, monkeypatch):
    with local_agent({"policy": str(tiny_models / "policy")}) as agent:
        c = agent.client()
        path = SHM_DIR / segment_name(agent.job, agent.node, "policy", 0)

        def broken(*a, **k):
            raise SegmentError("injected: a mapping that fails")  # the fault being tested
        monkeypatch.setattr(c, "_mapping", broken)
        with pytest.raises(SegmentError):
            c.pin("policy")
        fd = os.open(path, os.O_RDONLY)
        try:
            assert control.try_lock_exclusive(fd)              # nobody holds it shared
        finally:
            os.close(fd)
        c.close()


# ---- another account ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_user():
    if os.getuid() != 0:
        pytest.skip("creating a second account needs root")
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/false",
                        OTHER], check=True)
    return pwd.getpwnam(OTHER)


ATTACK = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])   # the agent's abstract address (argv cannot hold a NUL)
out = []
for req in json.loads(sys.argv[2]):
    try:
        s.sendall(json.dumps(req).encode() + b"\n")
        out.append(s.recv(65536).decode() or "closed")
    except OSError as e:
        out.append(type(e).__name__)
print(json.dumps(out))
"""


def test_another_account_is_refused_by_the_agent(tiny_models, other_user):
    with local_agent({"policy": str(tiny_models / "policy")}) as agent:
        reqs = [{"op": "shutdown"}, {"op": "begin_write", "model": "policy"},
                {"op": "fetch", "model": "policy", "version": 0, "items": [[0, 8]],
                 "dest": "/etc/shadow"}]
        p = subprocess.run(["/usr/bin/python3", "-c", ATTACK,   # stdlib only: the venv is root's
                            agent_address(agent.job, agent.node)[1:],
                            json.dumps(reqs)], user=other_user.pw_uid, group=other_user.pw_gid,
                           capture_output=True, text=True, timeout=60)
        answers = json.loads(p.stdout)
        assert all(a in ("closed", "BrokenPipeError", "ConnectionResetError")
                   for a in answers), answers
        c = agent.client()                                  # the agent still serves the job
        assert c.info()["node"] == agent.node and c.state("policy").current == 0
        c.close()


def test_a_planted_control_file_or_segment_is_not_trusted(tiny_models, other_user, tmp_path):
    job, node = f"plant{os.getpid()}", "n0"
    ctl_path = control_path(job, node)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * control.SIZE)
    shmdir.ensure()   # as a killed agent would have left it
    os.symlink(target, ctl_path)                            # a symlink where the file should be
    try:
        with pytest.raises(OSError):                        # ELOOP: O_NOFOLLOW
            GPSClient(job, node, wait_s=0)
    finally:
        ctl_path.unlink()
    planted = SHM_DIR / segment_name(job, node, "policy", 0)
    planted.write_bytes(b"\0" * 64)
    os.chown(planted, other_user.pw_uid, other_user.pw_gid)  # another account's file
    try:
        from pivotrl_hpc.gps.segment import open_own
        with pytest.raises(PermissionError, match="not a regular file of uid"):
            open_own(planted, os.O_RDONLY)
    finally:
        planted.unlink()
        shmdir.remove_if_unused()


# ---- two runs on one machine --------------------------------------------------------------------
def test_a_second_agent_with_the_same_job_refuses_and_leaves_the_first_intact(tiny_models):
    models = {"policy": str(tiny_models / "policy")}
    with local_agent(models) as first:
        cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve", "--job",
               first.job, "--node", first.node, "--model", f"policy={models['policy']}"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and f"GPS agent pid {first.proc.pid} still serves" in p.stderr
        clean = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "clean",
                                "--job", first.job], capture_output=True, text=True, timeout=60)
        assert clean.returncode == 1 and "still serves" in clean.stderr
        c = first.client()                                  # the first run is untouched
        assert c.state("policy").current == 0 and c.read("policy", ParallelPlace(1, 0))
        c.close()


def test_two_agents_without_a_job_id_get_their_own(tiny_models):
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "PIVOTRL_RUN_ID")}
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve", "--node", "n0",
           "--model", f"policy={tiny_models / 'policy'}"]
    procs = [subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    jobs = []
    try:
        for p in procs:
            for line in p.stderr:
                if "ready" in line:
                    jobs.append(line.split("GPS agent ")[1].split("/")[0])
                    break
        assert len(set(jobs)) == 2 and all(j.startswith("local") for j in jobs), jobs
        for job in jobs:
            c = GPSClient(job, "n0")
            assert c.state("policy").current == 0
            c.close()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
    assert not [p for job in jobs for p in SHM_DIR.glob(f"pivotrl-{job}-*")]


def test_sweep_leaves_another_users_files(other_user):
    from pivotrl_hpc.gps.segment import sweep

    job = f"sw{os.getpid()}"
    mine, theirs = (SHM_DIR / f"pivotrl-{job}-n0-{n}" for n in ("a", "b"))
    shmdir.ensure()
    mine.write_bytes(b"x")
    theirs.write_bytes(b"y")
    os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
    try:
        assert sweep(job) == [mine.name] and theirs.exists()
    finally:
        theirs.unlink(missing_ok=True)
        shmdir.remove_if_unused()


# ---- this user's 0700 folder (issue 11.2) -----------------------------------------------
def _serve(job: str, tiny_models, env: dict) -> subprocess.Popen:
    """`pivotrl gps serve` of the tiny policy on node n0 for `job`, its stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve",
                             "--job", job, "--node", "n0", "--model",
                             f"policy={tiny_models / 'policy'}"], env=env,
                            stderr=subprocess.PIPE, text=True)


def _as_other(other_user, code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/usr/bin/python3", "-c", code, *args], user=other_user.pw_uid,
                          group=other_user.pw_gid, capture_output=True, text=True, timeout=60)


def test_another_account_cannot_create_anything_in_the_gps_folder(tiny_models, other_user):
    with local_agent({"policy": str(tiny_models / "policy")}) as agent:
        assert oct(os.lstat(SHM_DIR).st_mode & 0o777) == "0o700"
        planted = SHM_DIR / f"pivotrl-{agent.job}-{agent.node}-policy-v1"
        p = _as_other(other_user, "import sys; open(sys.argv[1], 'wb')", str(planted))
        assert "PermissionError" in p.stderr, p.stderr
        assert not planted.exists()


PROBE = ("import sys; from pivotrl_hpc.gps.client import GPSClient; "
         "from pivotrl_hpc.gps import shmdir; c = GPSClient(sys.argv[1], 'n0', wait_s=120); "
         "print(shmdir.SHM_DIR, c.state('policy').current, flush=True); "
         "c.shutdown_agent(); c.close()")


@pytest.mark.parametrize("planted", ["folder", "symlink"])
def test_a_gps_folder_planted_by_another_account_gets_a_fresh_name(tiny_models, other_user,
                                                                    planted, tmp_path):
    """Another account made the user's kept folder name first (a folder, or a symlink to
    /tmp): `gps serve` is not refused (the refusal needed an administrator); it draws a fresh
    name for this shm root, serves there with its clients, and the planted entry stays."""
    import shutil
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="pivotrl-shmroot-", dir="/tmp"))
    try:
        os.chmod(root, 0o1777)   # a shared shm file system, as /dev/shm is
        state = tmp_path / "state" / "pivotrl"   # the user's record: the test's own
        state.mkdir(parents=True, mode=0o700)
        (state / "gps-folder").write_text("ab" * 8 + "\n")
        os.chmod(state / "gps-folder", 0o600)
        mine = root / f"pivotrl-u0-{'ab' * 8}"
        code = ("import os, sys; os.mkdir(sys.argv[1], 0o755)" if planted == "folder" else
                "import os, sys; os.symlink('/tmp', sys.argv[1])")
        assert _as_other(other_user, code, str(mine)).returncode == 0
        env = {**{k: v for k, v in os.environ.items() if k != "PIVOTRL_GPS_DIR"},
               "PIVOTRL_SHM_DIR": str(root), "XDG_STATE_HOME": str(tmp_path / "state")}
        job = f"planted{os.getpid()}"
        agent = _serve(job, tiny_models, env)
        try:
            p = subprocess.run([sys.executable, "-c", PROBE, job], env=env, timeout=300,
                               capture_output=True, text=True)
            assert p.returncode == 0, p.stderr[-2000:]
            folder, current = p.stdout.split()
            assert Path(folder).parent == root and Path(folder) != mine and current == "0"
            assert agent.wait(60) == 0
            err = agent.stderr.read()
            assert f"{mine} is taken by uid {other_user.pw_uid}" in err, err[-2000:]
        finally:
            agent.kill()
            agent.wait()
        assert os.lstat(mine).st_uid == other_user.pw_uid
        assert (os.readlink(mine) == "/tmp") if planted == "symlink" else mine.is_dir()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- a full /dev/shm ----------------------------------------------------------------------------
@pytest.fixture
def small_shm(tmp_path):
    """A private 20 MiB tmpfs as the shm folder (the real /dev/shm is shared with the suite)."""
    where = tmp_path / "shm"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m,mode=1777", "tmpfs",
                       str(where)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_write_into_a_full_shm_fails_with_the_figure_and_keeps_the_last_version(
        tiny_models, small_shm):
    env = {**os.environ, "PIVOTRL_SHM_DIR": str(small_shm)}   # agent and client: the small one
    job = f"full{os.getpid()}"
    agent = _serve(job, tiny_models, env)
    try:
        for line in agent.stderr:
            if "ready" in line:
                break
        st = os.statvfs(small_shm)
        with open(small_shm / "ballast", "wb") as f:        # leave less than one version
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - (2 << 20))
        p = subprocess.run([sys.executable, "-c", FULL_WRITE, job, "n0"], env=env,
                           capture_output=True, text=True, timeout=120)
        out = p.stdout
        assert "FAILED" in out and "cannot hold" in out and "missing" in out, out + p.stderr
        assert "SAME True 0" in out, out                    # v0 intact, still current
        assert agent.poll() is None                         # the agent lives on
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    assert sorted(p.name for p in small_shm.iterdir()) == ["ballast"]   # folder gone too


FULL_WRITE = r"""
import sys, torch
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.layout import ParallelPlace
c = GPSClient(sys.argv[1], sys.argv[2])
place = ParallelPlace(1, 0)
before = {n: t.clone() for n, t in c.read("policy", place).items()}
shard = c.read("policy", place, layout="megatron")
try:
    c.write("policy", {n: t + 1 for n, t in shard.items()}, place).wait(60)
    print("WROTE")
except Exception as e:
    print("FAILED", type(e).__name__, e)
after = c.read("policy", place)
print("SAME", all(torch.equal(after[n], before[n]) for n in before), c.state("policy").current)
"""


def _shm_root() -> dict:
    """PIVOTRL_SHM_DIR for the epilog when the test runs with one (an isolated shm root: the
    folder is shared by every process of the user, and one held by another is not removed)."""
    return {k: os.environ[k] for k in ("PIVOTRL_SHM_DIR",) if k in os.environ}


@pytest.fixture
def owned_gps_folder():
    """A test that asserts what is user-wide (the folder goes when nothing holds it) owns the
    folder for its duration: the folder's root is this pytest process's own 0700 folder
    (tests/conftest.py: one per xdist worker), where no other process of the user puts an
    agent, and nothing holds the folder as the test starts."""
    root = SHM_DIR.parent
    st = os.lstat(root)
    assert st.st_uid == os.getuid() and not st.st_mode & 0o077, (
        f"{root} is shared (mode {st.st_mode & 0o7777:o}): any agent of the user may hold "
        f"{SHM_DIR.name} while this test runs")
    assert not SHM_DIR.exists() or shmdir.remove_if_unused(), f"{SHM_DIR} held or not empty"
    return SHM_DIR


def test_the_slurm_epilog_removes_what_a_killed_job_left(other_user, owned_gps_folder):
    from slurm_util import ROOT

    job = f"{os.getpid()}9"
    left = [SHM_DIR / f"pivotrl-{job}-n1-{n}" for n in ("policy-v3", "ctl", "stage-1-ab")]
    theirs, other_job = SHM_DIR / f"pivotrl-{job}-n1-genrm-v0", SHM_DIR / f"pivotrl-{job}0-n1-x"
    shmdir.ensure()   # a SIGKILLed agent leaves the folder too
    for p in [*left, theirs, other_job]:
        p.write_bytes(b"x")
    os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
    try:
        p = subprocess.run([str(ROOT / "slurm" / "epilog.sh")], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": job,
                                "SLURM_JOB_UID": str(os.getuid()), **_shm_root()}, timeout=30)
        assert p.returncode == 0, p.stderr
        assert not any(q.exists() for q in left)
        assert theirs.exists() and other_job.exists()        # not the job's user, not the job
        assert sorted(p.stdout.split()) == sorted(str(q) for q in left)
        assert SHM_DIR.is_dir()                               # not empty: it stays
        theirs.unlink()
        other_job.unlink()
        p = subprocess.run([str(ROOT / "slurm" / "epilog.sh")], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": job,
                                "SLURM_JOB_UID": str(os.getuid()), **_shm_root()}, timeout=30)
        assert p.returncode == 0 and not SHM_DIR.exists(), p.stderr   # empty: removed
    finally:
        for q in [*left, theirs, other_job]:
            q.unlink(missing_ok=True)
        shmdir.remove_if_unused()


def test_the_gps_folder_goes_with_the_last_agent(tiny_models, owned_gps_folder):
    """Nothing of GPS outlives its agents: the user's folder stays while any agent holds it
    and goes with the last one (shmdir.hold / release)."""
    models = {"policy": str(tiny_models / "policy")}
    with local_agent(models) as first:
        with local_agent(models):
            assert SHM_DIR.is_dir()
        assert SHM_DIR.is_dir() and not list(SHM_DIR.glob(f"pivotrl-{first.job}-x*"))
        c = first.client()                                  # the first one still serves
        assert c.state("policy").current == 0
        c.close()
    assert not SHM_DIR.exists()


def test_a_client_cannot_make_up_versions(tiny_models):
    with local_agent({"policy": str(tiny_models / "policy")}) as agent:
        c = agent.client()
        for op in ({"op": "begin_write", "model": "policy", "version": 10**6},
                   {"op": "written", "model": "policy", "version": 7, "ranges": [[0, 8]]}):
            with pytest.raises(RuntimeError, match="cannot be written on n0: the next version"):
                c._request(op, op["op"])
        assert not list(SHM_DIR.glob(f"pivotrl-{agent.job}-n0-policy-v7"))
        c.close()
