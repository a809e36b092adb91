"""Issue 35, the GPS half: a second account (`nobody`, the system Python and the standard
library only) against root's GPS agent, client, folder and Slurm epilog.

- N3: a process holding the dead agent's pid and its socket name gets no weights: the client
  checks the agent's start time (pidfd), the peer's uid and pid (SO_PEERCRED), and opens only
  the file it expects, in the folder, by descriptor.
- N4: the socket name carries the uid and a random token, so predictable names squatted by
  `nobody` do not stop `gps serve`; a name already bound is one line naming its owner, exit 2.
- The epilog cannot be made to create a file through a folder swapped for a symlink.
- A folder squatted by another account: one line naming the owner and the fix, exit 2, and
  nothing inside it is swept.
- A folder name taken after the user's job (issue 55): a fresh name is drawn and recorded
  (processes starting at once agree on one), `gps serve` and `pivotrl run` go on, and no
  cleanup removes a folder of another account.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pivotrl_hpc.gps import control, shmdir
from pivotrl_hpc.gps.agent import control_path, socket_address
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.control import GPSUnavailable
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.local import local_agent

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _root_only():
    if os.getuid() != 0:
        pytest.skip("running code as a second account needs root")


def _as_nobody(code: str, *args: str, **kw) -> subprocess.Popen:
    """The attacker: setpriv execs the system Python as nobody in this very process (no fork
    in between: the pid the test arranged is the attacker's)."""
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                             "--clear-groups", "/usr/bin/python3", "-I", "-c", code, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _shared_root() -> Path:
    """A world-writable sticky folder standing in for /dev/shm (PIVOTRL_SHM_DIR)."""
    root = Path(tempfile.mkdtemp(prefix="pivotrl-shmroot-", dir="/tmp"))
    os.chmod(root, 0o1777)
    return root


# ---- N3: the client authenticates its agent -------------------------------------------------
FAKE_AGENT = r"""
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(bytes.fromhex(sys.argv[1]).decode())   # the dead agent's name
s.listen(8)
print(os.getpid(), flush=True)
target = sys.argv[2]                          # a root-owned 0644 file with a valid header
while True:
    c, _ = s.accept()
    f = c.makefile("rwb")
    for line in f:
        req = json.loads(line)
        op = req["op"]
        rep = {"op": op}
        if op == "begin_write":
            rep = {"op": op, "version": 1, "path": target}
        elif op == "written":
            rep = {"op": op, "version": 1}
        elif op == "ping":
            rep = {"op": "ping", "node": "n0", "index": 0, "n_nodes": 1, "transport": None,
                   "transport_fallback": None}
        f.write(json.dumps(rep).encode() + b"\n")
        f.flush()
"""


def _spawn_with_pid(pid: int, code: str, *args: str) -> subprocess.Popen:
    """Start the attacker with exactly `pid`: what nobody got by cycling pids for 5-15 s in
    the review, arranged here at once through /proc/sys/kernel/ns_last_pid (root)."""
    for _ in range(200):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = _as_nobody(code, *args)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"could not arrange pid {pid} (a busy machine forks in between)")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_n3_a_process_holding_the_dead_agents_pid_and_name_gets_no_weights(tiny_models):
    """The review's attack: the agent is SIGKILLed, nobody takes its pid and binds its name,
    answers begin_write with a root-owned 0644 file outside the GPS folder (here: the
    checkpoint the agent loaded) and a new root client would write the weights into it."""
    folder = Path(tempfile.mkdtemp(prefix="pivotrl-ckpt-", dir="/tmp"))
    try:
        os.chmod(folder, 0o755)
        shutil.copytree(tiny_models / "policy", folder / "policy")
        target = folder / "policy" / "model.safetensors"
        os.chmod(target, 0o644)                       # root's, readable by every account
        before = _sha(target)
        with local_agent({"policy": str(folder / "policy")}) as agent:
            c = agent.client()
            shard = c.read("policy", ParallelPlace(1, 0), layout="megatron")
            c.close()
            ctl = control.ControlBlock(control_path(agent.job, agent.node))
            address = socket_address(agent.job, agent.node, ctl.token)
            pid = ctl.agent_pid
            agent.proc.kill()
            agent.proc.wait()
            attacker = _spawn_with_pid(pid, FAKE_AGENT, address.encode().hex(), str(target))
            try:
                assert int(attacker.stdout.readline()) == pid          # bound, listening
                with pytest.raises(GPSUnavailable, match=f"pid {pid}.* is gone"):
                    c = GPSClient(agent.job, agent.node, wait_s=1)
                    c.write("policy", {n: t + 1 for n, t in shard.items()}, ParallelPlace(1, 0))
                # Even were the start-time check fooled, the peer's uid is not the job's:
                # the test (root) makes the record name the attacker's process.
                ctl.mm[32:40] = struct.pack("<Q", control.start_time(pid))
                with pytest.raises(GPSUnavailable, match=f"is pid {pid}, uid {NOBODY}, not "):
                    GPSClient(agent.job, agent.node, wait_s=1)
            finally:
                ctl.close()
                attacker.kill()
                attacker.wait()
        assert _sha(target) == before                 # not one weight written into it
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_n3_a_reply_naming_a_file_outside_the_folder_is_refused(tmp_path):
    """The path check alone: a fake agent in this very process (so uid and pid pass) names a
    file of root outside the folder in its begin_write reply."""
    import threading

    from pivotrl_hpc.gps import shmdir
    job, node = f"fake{os.getpid()}", "n0"
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"keep")
    shmdir.ensure()
    ctl = control.ControlBlock(control_path(job, node), create=True, token="t0k")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(socket_address(job, node, "t0k"))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        f = conn.makefile("rwb")
        for line in f:
            op = line.split(b'"op": "')[1].split(b'"')[0].decode()
            rep = (f'{{"op": "begin_write", "version": 1, "path": "{outside}"}}'
                   if op == "begin_write" else f'{{"op": "{op}"}}')
            f.write(rep.encode() + b"\n")
            f.flush()
    threading.Thread(target=serve, daemon=True).start()
    try:
        c = GPSClient(job, node, wait_s=1)
        with pytest.raises(GPSUnavailable, match="named .*elsewhere.safetensors.* refused"):
            c._expected(c._request({"op": "begin_write", "model": "policy"}, "begin_write"),
                        "policy")
        c.close()
        assert outside.read_bytes() == b"keep"
    finally:
        srv.close()
        ctl.close()
        control_path(job, node).unlink()
        shmdir.remove_if_unused()


# ---- N4: socket-name squatting --------------------------------------------------------------
SQUAT = r"""
import socket, sys
held = []
for name in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\0" + name)
    s.listen(1)
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"""


def _serve(tiny_models, job: str, env: dict | None = None, *pre: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *pre, "gps", "serve", "--job", job, "--node",
                             "n0", "--model", f"policy={tiny_models / 'policy'}"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def test_n4_predictable_names_squatted_by_nobody_do_not_stop_gps_serve(tiny_models):
    job = f"sq{os.getpid()}"
    names = [f"pivotrl-{job}-n0", f"pivotrl-u0-{job}-n0", f"pivotrl-u0-pivotrl-{job}-n0-"] + [
        f"pivotrl-{job}-n{i}" for i in range(1, 198)]
    squatter = _as_nobody(SQUAT, *names, stdin=subprocess.PIPE)
    try:
        assert int(squatter.stdout.readline()) == 200
        agent = _serve(tiny_models, job, None, "-m", "pivotrl_hpc.cli.main")
        try:
            while not control_path(job, "n0").exists():
                assert agent.poll() is None, agent.stderr.read()[-2000:]   # it must not die
                time.sleep(0.05)
            c = GPSClient(job, "n0", wait_s=120)
            assert c.info()["node"] == "n0" and c.state("policy").current == 0
            c.shutdown_agent()
            c.close()
            assert agent.wait(60) == 0, agent.stderr.read()[-2000:]
        finally:
            agent.kill()
            agent.wait()
    finally:
        squatter.kill()
        squatter.wait()


NAMED_TOKEN = ("import sys; import pivotrl_hpc.gps.agent as a; a.new_token = lambda: 'squat'; "
               "from pivotrl_hpc.cli.main import main; sys.exit(main(sys.argv[1:]))")


def test_n4_a_name_already_bound_is_one_line_naming_its_owner_exit_2(tiny_models):
    """The token cannot be guessed; to test the refusal the agent is given a known one (a
    test-only patch of `new_token` in the agent's process) that nobody has bound."""
    job = f"sq{os.getpid()}b"
    name = socket_address(job, "n0", "squat")[1:]
    squatter = _as_nobody(SQUAT, name, stdin=subprocess.PIPE)
    try:
        assert int(squatter.stdout.readline()) == 1
        agent = _serve(tiny_models, job, None, "-c", NAMED_TOKEN)
        err = agent.stderr.read()
        assert agent.wait(120) == 2, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        lines = [x for x in err.splitlines() if x.startswith("pivotrl gps serve:")]
        assert len(lines) == 1, err[-2000:]
        assert f"@{name} is already bound by pid {squatter.pid}, uid {NOBODY} (nobody)" in \
            lines[0], lines
        assert not list(shmdir.SHM_DIR.glob(f"pivotrl-{job}-*"))
    finally:
        squatter.kill()
        squatter.wait()


# ---- the epilog and a folder swapped for a symlink -------------------------------------------
SWAPPER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
a, b = sys.argv[1].encode(), sys.argv[2].encode()
os.mkdir(a, 0o700)
open(os.path.join(a, b"keep"), "w").close()   # not empty: the epilog's rmdir leaves it
os.symlink(sys.argv[3], b)          # where root must never create anything
print("ready", flush=True)
n, end = 0, time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    if libc.renameat2(-100, a, -100, b, 2) == 0:   # RENAME_EXCHANGE
        n += 1
print(n, flush=True)
"""


def test_the_epilog_creates_nothing_through_a_folder_swapped_for_a_symlink(tmp_path):
    """The job's user (nobody) swaps its folder and a symlink to a path in a root-only
    folder, back and forth, while root's epilog runs 150 times: the old `flock FILE` opened
    with O_CREAT after the `-L` check and created the file."""
    shm = _shared_root()
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    try:
        folder, link = shm / f"pivotrl-u{NOBODY}", shm / "swap"
        swapper = _as_nobody(SWAPPER, str(folder), str(link), str(secret / "created"), "60")
        assert swapper.stdout.readline().strip() == "ready"
        env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "4242", "SLURM_JOB_UID": str(NOBODY),
               "PIVOTRL_SHM_DIR": str(shm)}
        try:
            for _ in range(150):
                p = subprocess.run([str(ROOT / "slurm" / "epilog.sh")], env=env,
                                   capture_output=True, text=True, timeout=30)
                assert p.returncode == 0, p.stderr
                if list(secret.iterdir()):
                    break
        finally:
            swapper.kill()
            swapper.wait()
        assert not list(secret.iterdir()), "root created a file through the swapped folder"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# ---- a per-user folder squatted by another account --------------------------------------------
def test_a_squatted_folder_name_neither_stops_gps_serve_nor_is_used(tiny_models):
    """Issue 46: `nobody` made the folder names a GPS folder had (`pivotrl-u0`, and one with
    a suffix), with a control file naming a live pid inside: the agent's folder carries a
    suffix private to root, so `gps serve` starts and serves in its own folder, and nothing
    planted is touched (the old fixed name made it exit 2 for good)."""
    shm = _shared_root()
    try:
        job = f"sqf{os.getpid()}"
        planted = []
        plant = ("import os, struct, sys\nfor d, f in zip(sys.argv[2::2], sys.argv[3::2]):\n"
                 "    os.mkdir(d, 0o700); open(f, 'wb').write(struct.pack('<QQQQQ', "
                 "int(sys.argv[1]), 1, 1, 0, 0) + bytes(4096 - 40))")
        for name in ("pivotrl-u0", "pivotrl-u0-0000000000000000"):
            planted += [str(shm / name), str(shm / name / f"pivotrl-{job}-n0-ctl")]
        p = _as_nobody(plant, str(control.MAGIC), *planted)
        assert p.wait(30) == 0, p.stderr.read()
        before = [Path(f).read_bytes() for f in planted[1::2]]
        env = {"PIVOTRL_SHM_DIR": str(shm)}
        agent = _serve(tiny_models, job, env, "-m", "pivotrl_hpc.cli.main")
        try:
            probe = ("import sys, time; from pivotrl_hpc.gps.client import GPSClient; "
                     "from pivotrl_hpc.gps import shmdir; c = GPSClient(sys.argv[1], 'n0', "
                     "wait_s=120); print(shmdir.SHM_DIR, c.info()['node'], "
                     "c.state('policy').current, flush=True); c.shutdown_agent(); c.close()")
            out = subprocess.run([sys.executable, "-c", probe, job], capture_output=True,
                                 text=True, env={**os.environ, **env}, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            folder, node, current = out.stdout.split()
            assert (node, current) == ("n0", "0")
            assert Path(folder).parent == shm and Path(folder).name.startswith("pivotrl-u0-")
            assert Path(folder).name != "pivotrl-u0-0000000000000000"
            assert agent.wait(60) == 0, agent.stderr.read()[-2000:]
        finally:
            agent.kill()
            agent.wait()
        assert [Path(f).read_bytes() for f in planted[1::2]] == before
        for d, f in zip(planted[::2], planted[1::2]):
            assert os.listdir(d) == [Path(f).name] and os.lstat(d).st_uid == NOBODY
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# ---- a GPS folder name taken after the user's job: a fresh name, never a refusal ------------
def _own_state(tmp_path: Path, shm: Path) -> dict:
    """The user's record of its folder name in a home of the test's (the real one is left
    alone: other jobs of root use it meanwhile), the shm root a shared sticky one."""
    return {"PIVOTRL_SHM_DIR": str(shm), "XDG_STATE_HOME": str(tmp_path / "state")}


def _renewed(tmp_path: Path, shm: Path) -> str:
    """The suffix recorded for the user's folder under `shm` after a renewal there."""
    sha = hashlib.sha256(str(shm).encode()).hexdigest()[:16]
    record = tmp_path / "state" / "pivotrl" / f"gps-folder.{sha}"
    assert oct(os.stat(record).st_mode & 0o777) == "0o600"
    return record.read_text().strip()


def _clean_env(env: dict) -> dict:
    """os.environ without a GPS folder published to this pytest process, and `env`."""
    return {**{k: v for k, v in os.environ.items() if k != "PIVOTRL_GPS_DIR"}, **env}


PROBE = ("import sys, time; from pivotrl_hpc.gps.client import GPSClient; "
         "from pivotrl_hpc.gps import shmdir; c = GPSClient(sys.argv[1], 'n0', "
         "wait_s=120); print(shmdir.SHM_DIR, c.info()['node'], "
         "c.state('policy').current, flush=True); c.shutdown_agent(); c.close()")


def _serve_once(tiny_models, job: str, env: dict) -> tuple[int, Path | None, str]:
    """`gps serve` and a client that reads its state then stops it: (the agent's exit code,
    the folder the client found, the agent's stderr)."""
    agent = subprocess.Popen([sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve",
                              "--job", job, "--node", "n0", "--model",
                              f"policy={tiny_models / 'policy'}"],
                             stderr=subprocess.PIPE, text=True, env=_clean_env(env))
    try:
        out = subprocess.Popen([sys.executable, "-c", PROBE, job], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_clean_env(env))
        while out.poll() is None and agent.poll() is None:
            time.sleep(0.1)
        if agent.poll() not in (None, 0) and out.poll() is None:   # refused: the probe
            out.kill()                                  # waits on an agent that will not come
        stdout, _ = out.communicate(timeout=300)
        rc = agent.wait(120)
        folder = Path(stdout.split()[0]) if out.returncode == 0 else None
        if folder is not None:
            assert stdout.split()[1:] == ["n0", "0"], stdout
        return rc, folder, agent.stderr.read()
    finally:
        agent.kill()
        agent.wait()


def test_a_folder_name_taken_after_a_job_gets_a_fresh_one_and_is_left_alone(tiny_models,
                                                                            tmp_path):
    """The folder's name is in the listing of /dev/shm while the agent runs. After the job,
    nobody makes a folder of that name, with a file inside (no cleanup of the user's can
    remove it): the next `gps serve` (the old code: exit 2, FolderRefused, every later one
    too) draws a fresh name, records it and serves; the squatter's folder is untouched."""
    shm = _shared_root()
    try:
        env = _own_state(tmp_path, shm)
        rc, first, err = _serve_once(tiny_models, f"sqn{os.getpid()}", env)
        assert rc == 0 and first is not None, err[-2000:]
        assert first.parent == shm and not first.exists()   # the last agent out removed it
        p = _as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o755); "
                       "open(os.path.join(sys.argv[1], 'keep'), 'w').close()", str(first))
        assert p.wait(30) == 0, p.stderr.read()
        for k in range(2):   # the next start, and the one after it, both serve
            rc, folder, err = _serve_once(tiny_models, f"sqn{os.getpid()}x{k}", env)
            assert rc == 0 and folder is not None, err[-2000:]
            assert folder.parent == shm and folder != first
            assert folder.name == f"pivotrl-u0-{_renewed(tmp_path, shm)}"
            assert not folder.exists()
        assert os.lstat(first).st_uid == NOBODY and os.listdir(first) == ["keep"]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


RACE = r"""
import os, sys, time
from pivotrl_hpc import envs   # the package imported; shmdir not yet
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
from pivotrl_hpc.gps import shmdir
print(shmdir.SHM_DIR, flush=True)
"""


@pytest.mark.parametrize("published", [False, True])
def test_processes_starting_at_once_on_a_taken_name_agree_on_one_fresh_one(tmp_path,
                                                                           published):
    """Six processes of the user (a job's agent and workers, or two jobs) find the kept name
    taken by nobody at the same instant; `published`: the launcher's PIVOTRL_GPS_DIR names
    it (a node where another account took it). All find the same fresh folder, drawn once
    (one renewal under the record's lock); the old code gave all six the squatted folder."""
    shm = _shared_root()
    try:
        env = _own_state(tmp_path, shm)
        suffix = "5a" * 8
        record = tmp_path / "state" / "pivotrl" / "gps-folder"
        record.parent.mkdir(parents=True, mode=0o700)
        record.write_text(suffix + "\n")
        os.chmod(record, 0o600)
        squatted = shm / f"pivotrl-u0-{suffix}"
        p = _as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o700)", str(squatted))
        assert p.wait(30) == 0
        if published:
            env["PIVOTRL_GPS_DIR"] = str(squatted)
        start = f"{time.time() + 8:.3f}"
        procs = [subprocess.Popen([sys.executable, "-c", RACE, start], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=_clean_env(env)) for _ in range(6)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [e[-1000:] for _, e in outs]
        folders = {o.strip() for o, _ in outs}
        fresh = shm / f"pivotrl-u0-{_renewed(tmp_path, shm)}"
        assert folders == {str(fresh)} and fresh != squatted
        assert record.read_text() == suffix + "\n"   # the user's record for other roots
        renewals = sum("a fresh name is recorded" in e for _, e in outs)
        assert renewals == 1, [e[-500:] for _, e in outs]
        assert os.lstat(squatted).st_uid == NOBODY
    finally:
        shutil.rmtree(shm, ignore_errors=True)


SWEEP_JOB = ("import sys; from pathlib import Path; "
             "from pivotrl_hpc.launch.local import sweep_segments; "
             "from pivotrl_hpc.gps import shmdir; print(sweep_segments(sys.argv[1]), "
             "shmdir.remove_if_unused(Path(sys.argv[2])))")


def test_the_cleanup_removes_no_folder_of_another_account(tmp_path):
    """nobody's empty folder under the user's published or kept name: the launcher's sweep
    after a killed job and `remove_if_unused` (run by root, who may remove anything in a
    sticky folder) leave it; the old code removed it (and the user's next start then raced
    nobody for the name)."""
    shm = _shared_root()
    try:
        env = _own_state(tmp_path, shm)
        folder = shm / f"pivotrl-u0-{'c3' * 8}"
        p = _as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o700)", str(folder))
        assert p.wait(30) == 0
        assert shmdir.remove_if_unused(folder) is False
        env["PIVOTRL_GPS_DIR"] = str(folder)
        out = subprocess.run([sys.executable, "-c", SWEEP_JOB, f"gone{os.getpid()}",
                              str(folder)], capture_output=True, text=True, timeout=300,
                             env=_clean_env(env))
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["[]", "False"], out.stdout
        assert folder.is_dir() and os.lstat(folder).st_uid == NOBODY
        mine = shm / f"pivotrl-u0-{'d4' * 8}"   # the user's own empty folder still goes
        mine.mkdir(mode=0o700)
        assert shmdir.remove_if_unused(mine) is True and not mine.exists()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.live   # a real job: the suite's live phase runs it, alone
def test_a_tiny_job_runs_while_nobody_holds_its_kept_folder_name(tiny_models, tmp_path):
    """No job of the user runs; nobody holds a folder under the user's kept name with a
    file inside. `pivotrl run` (a 1 x 2 job: its GPS agent, 2 workers, the test controller
    querying every rank) ends 0 in a fresh folder (the old code: exit 1, the agent refused
    nobody's folder); nobody's folder is untouched and nothing of the job is left."""
    from test_launch import Job, _cfg, _env

    shm = _shared_root()
    try:
        env = _own_state(tmp_path, shm)
        record = tmp_path / "state" / "pivotrl" / "gps-folder"
        record.parent.mkdir(parents=True, mode=0o700)
        record.write_text("7e" * 8 + "\n")
        os.chmod(record, 0o600)
        squatted = shm / f"pivotrl-u0-{'7e' * 8}"
        p = _as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o755); "
                       "open(os.path.join(sys.argv[1], 'keep'), 'w').close()", str(squatted))
        assert p.wait(30) == 0
        job = Job(_cfg(tiny_models, tmp_path, nodes=1, devices_per_node=2),
                  _clean_env({**_env(tmp_path, "query_all"), **env}))
        rc = job.finish(timeout=400)
        assert rc == 0, job.stderr[-3000:]
        fresh = shm / f"pivotrl-u0-{_renewed(tmp_path, shm)}"
        assert fresh != squatted and not fresh.exists()   # made for the job, gone with it
        assert "is taken by uid 65534 (nobody): a fresh name is recorded" in job.stderr
        assert os.lstat(squatted).st_uid == NOBODY and os.listdir(squatted) == ["keep"]
        assert [n for n in os.listdir(shm) if n.startswith("pivotrl-u0")] == [squatted.name]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
