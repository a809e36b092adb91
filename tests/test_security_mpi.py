"""Open MPI's shared memory, the training world's rendezvous and what a live job holds open,
against the real `nobody` (the system Python, the standard library only; no reliance on
fs.protected_*, which are 0 here).

- Open MPI 4.1 names each rank's segment `vader_segment.<host>.<euid>.<jobid>.<rank>` and
  opens it O_CREAT|O_RDWR (no O_EXCL, no O_NOFOLLOW); the jobid is a 16-bit hash of the host
  name and mpirun's pid, which /proc shows before the ranks reach MPI_Init. `nobody` watches
  for mpirun, makes those names first in /dev/shm (regular files of its own, and for rank 0 a
  symlink to a 0600 file of the job's user in a 0700 folder), and the job must use none of
  them: every segment lives in the job's own 0700 folder (launch/mpi_private.py).
- `nobody` binds the job's port base, which was the training world's MASTER_PORT (its
  TCPStore): the job still trains, through the FileStore in its 0700 folder, and nothing of
  the job connects to `nobody`'s listener.
- While the job runs, every process of it (launcher, mpirun, ranks, engine hosts, forkers)
  is listed: each file it maps or holds open that lies below a world-writable folder lies
  below a 0700 folder of the user under it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

from live_util import model_overrides

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[1]
SECRET = b"the job user's own file\n"


@pytest.fixture(scope="module", autouse=True)
def _root_only():
    if os.getuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("running code as a second account needs root and the system Python")


def _as_nobody(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                             "--clear-groups", "/usr/bin/python3", "-I", "-c", code, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- the check before any rank starts ---------------------------------------------------------
def test_a_rank_refuses_open_mpis_default_folders_and_a_folder_nobody_made(tmp_path):
    from pivotrl_hpc.launch import mpi_private as mp

    with pytest.raises(mp.MPIFolderError, match=r"^Open MPI's shared memory would land in "
                       r"/dev/shm \(OMPI_MCA_btl_vader_backing_directory\), a folder other "
                       "accounts can write"):
        mp.check({})   # mpirun started by hand, without the launcher's settings
    squat = Path("/dev/shm") / f"pivotrl-mpi-test-{os.getpid()}"
    p = _as_nobody("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)",
                   str(squat))
    assert p.wait(30) == 0, p.stderr.read()
    try:
        env = mp.mca_env(squat)
        with pytest.raises(mp.MPIFolderError, match=f"MPI folder {squat} is a folder of uid "
                           "65534 with mode 777, not a 0700 folder of uid 0"):
            mp.check(env, create=True)
        env[mp.envs.OMPI_TMPDIR.name] = "/tmp"
        with pytest.raises(mp.MPIFolderError, match=r"would land in /tmp \(OMPI_MCA_orte_tmp"):
            mp.settings(env)
    finally:
        squat.rmdir()
    mine = mp.folder_name("j1")
    assert mp.check(mp.mca_env(mine), create=True) == mine
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700 and mine.stat().st_uid == 0
    assert mp.sweep("j1") == [mine.name] and not mine.exists()


def test_the_launchers_give_mpi_and_the_training_world_private_folders(tiny_models, tmp_path):
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.launch import local, mpi_private as mp

    cfg = load_config(str(ROOT / "configs" / "learn-cpu.yaml"),
                      [*model_overrides(tiny_models), f"trace.path={tmp_path / 'out' / 'j.h5'}"])
    run = local.prepare(cfg, job="runmpi1")
    folder = run.env["PIVOTRL_MPI_DIR"]
    assert folder.startswith(f"{mp.envs.SHM_DIR.get()}/pivotrl-mpi-runmpi1-")
    for name in ("OMPI_MCA_btl_vader_backing_directory", "OMPI_MCA_orte_tmpdir_base",
                 "UCX_POSIX_DIR"):
        assert run.env[name] == folder and ["-x", name] == \
            run.command[run.command.index(name) - 1:run.command.index(name) + 1]
    assert run.env["OMPI_MCA_shmem"] == "mmap"
    store = Path(run.env["PIVOTRL_TRAIN_STORE"])
    assert store.parent.parent == tmp_path / "out" / "j.logs" and store.name == "store"
    assert local.prepare(cfg, job="runmpi1").env["PIVOTRL_MPI_DIR"] != folder   # fresh


# ---- a live job against nobody ---------------------------------------------------------------
# nobody: wait for mpirun (a child of the launcher), work out the jobid as Open MPI does
# (orte/mca/plm/base/plm_base_jobid.c: OPAL_HASH_STR of the node name, xor mpirun's pid,
# folded to 16 bits; the application's job is family << 16 | 1) and make every rank's
# segment name first. Prints what it made.
PLANT_SEGMENTS = r"""
import json, os, socket, sys, time
launcher, ranks, victim = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def family(host, pid):
    h = 0
    for c in host.encode():
        h = (h + c) & 0xffffffff
        h = (h + (h << 10)) & 0xffffffff
        h ^= h >> 6
    h = (h + (h << 3)) & 0xffffffff
    h ^= h >> 11
    h = (h + (h << 15)) & 0xffffffff
    h ^= pid
    return ((h >> 16) ^ h) & 0xffff
deadline = time.monotonic() + 600   # the launcher's checks first: minutes on a loaded machine
while time.monotonic() < deadline:
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        if comm.endswith("(mpirun") and int(rest.split()[1]) == launcher:
            host = socket.gethostname().split(".")[0]
            job = (family(host, int(d)) << 16) | 1
            made = []
            for r in range(ranks):
                name = f"/dev/shm/vader_segment.{host}.0.{job:x}.{r}"
                if r == 0:
                    os.symlink(victim, name)
                else:
                    os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666))
                    os.chmod(name, 0o666)
                made.append(name)
            print(json.dumps({"mpirun": int(d), "made": made}), flush=True)
            sys.exit(0)
    time.sleep(0.002)
sys.exit("no mpirun seen")
"""

# nobody: listen on the port first, count what connects and what it sends, until told to stop
HOLD_PORT = r"""
import json, select, signal, socket, sys
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(16)
print("bound", flush=True)
seen = {"connections": 0, "bytes": 0}
conns = []
signal.signal(signal.SIGTERM, lambda *a: (print(json.dumps(seen), flush=True), sys.exit(0)))
while True:
    ready, _, _ = select.select([s, *conns], [], [], 0.2)
    for r in ready:
        if r is s:
            conns.append(s.accept()[0])
            seen["connections"] += 1
        else:
            data = r.recv(65536)
            seen["bytes"] += len(data)
            if not data:
                conns.remove(r)
"""


def _tree(root: int) -> list[int]:
    """`root` and every process below it."""
    children = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat_line = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children[int(stat_line.rsplit(")", 1)[1].split()[1])].append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children[pid]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
    except OSError:
        return f"pid {pid} (gone)"


def _held(pid: int) -> set[str]:
    """The files `pid` maps or holds open (absolute paths, " (deleted)" kept)."""
    paths = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                paths.add(parts[5])
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/"):
                paths.add(target)
    except OSError:
        pass   # gone meanwhile
    return paths


# glibc's sem_open makes a POSIX semaphore in /dev/shm whatever the caller says: a file of a
# random name made O_CREAT|O_EXCL (mkstemp), then linked to its name; Python's multiprocessing
# unlinks it at once (its semaphores are never opened by name again). Nothing can be planted
# under such a name first, and none is reachable by name while the job holds it.
GLIBC_SEMAPHORE = "sem."
# The checkout and its venv: what the job maps from there (libraries, modules) is read-only
# code the user installed; test_the_installation_is_writable_by_no_one_else checks it.
INSTALLED = tuple({ROOT, Path(sys.prefix).resolve()})


def exposure(path: str) -> str | None:
    """The deepest world-writable folder above `path` with no 0700 folder of this user between
    it and `path`; None if there is none (or a folder on the way is already gone)."""
    deleted, path = path.endswith(" (deleted)"), Path(path.removesuffix(" (deleted)"))
    if deleted and path.parent == Path("/dev/shm") and path.name.startswith(GLIBC_SEMAPHORE):
        return None
    if not deleted and any(path.is_relative_to(top) for top in INSTALLED):
        return None   # code the user installed (a clone may live in /tmp), not the job's files
    open_to = None
    for folder in [*reversed(path.parents)][1:] + [path]:   # / left out; a folder held: itself
        try:
            st = os.lstat(folder)
        except OSError:
            return open_to if folder == path else None
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
            open_to = str(folder)
        elif stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and \
                stat.S_IMODE(st.st_mode) & 0o077 == 0:
            open_to = None
    return open_to


def test_the_installation_is_writable_by_no_one_else():
    for top in INSTALLED:
        st = os.stat(top)
        assert st.st_uid in (0, os.getuid()) and not st.st_mode & 0o022, (top, oct(st.st_mode))


def test_exposure_of_paths():
    private = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        assert exposure(str(private / "seg")) is None
        assert exposure("/dev/shm/vader_segment.vm.0.1.0") == "/dev/shm"
        assert exposure("/dev/shm/ucx_shm_posix_1 (deleted)") == "/dev/shm"
        assert exposure(str(private)) is None   # the 0700 folder itself, held open
        assert exposure("/dev/shm/sem.ab12Cd (deleted)") is None
        fd, name = tempfile.mkstemp(dir="/dev/shm")   # a 0600 file of the user, in the open
        os.close(fd)
        mine = Path(name)
        try:
            assert exposure(str(mine)) == "/dev/shm"
        finally:
            mine.unlink()
        assert exposure("/usr/lib/x86_64-linux-gnu/libc.so.6") is None
        os.chmod(private, 0o755)
        assert exposure(str(private / "seg")) == "/dev/shm"
    finally:
        private.rmdir()


@pytest.mark.timeout(1200)
def test_nobody_planting_segments_and_taking_the_port_base_gets_nothing(tiny_models, tmp_path):
    """One colocated job of 2 devices (a training world of 2: controller and agent, 2
    workers, their engine hosts); steps: 1."""
    victim_dir = Path(tempfile.mkdtemp(prefix="victim-"))   # root's, 0700
    victim = victim_dir / "secret"
    victim.write_bytes(SECRET)
    victim.chmod(0o600)
    trace = tmp_path / "out" / "job.h5"
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(tiny_models),
           f"trace.path={trace}", "paradigm.name=colocated", "cluster.devices_per_node=2",
           "cluster.cpu_share=0.8", "paradigm.initial_rollout_devices=1",
           "paradigm.initial_reward_devices=1", "rl.steps=1", "rl.batch_size=4"]
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    planter = _as_nobody(PLANT_SEGMENTS, str(job.pid), "3", str(victim))
    holder, exposed, seen, made = None, {}, set(), []
    try:
        while planter.poll() is None and job.poll() is None:
            time.sleep(0.1)
        if planter.poll() is None:   # the job ended before mpirun was seen
            planter.kill()
        plant_out, plant_err = planter.communicate(timeout=30)
        assert planter.returncode == 0, f"{plant_err}; the job: {job.communicate()[0][-2000:]}"
        planted = json.loads(plant_out)
        made = planted["made"]
        environ = Path(f"/proc/{planted['mpirun']}/environ").read_bytes().split(b"\0")
        port = int(next(v for v in environ if v.startswith(b"PIVOTRL_PORT_BASE="))
                   .split(b"=")[1])
        holder = _as_nobody(HOLD_PORT, str(port))
        assert holder.stdout.readline() == "bound\n", holder.stderr.read()
        while job.poll() is None:   # every process of the job, what it maps and holds open
            for pid in _tree(job.pid):
                for path in _held(pid) - seen:
                    seen.add(path)
                    if (where := exposure(path)) is not None:
                        exposed[path] = (where, _cmdline(pid))
            time.sleep(0.5)
        output = job.communicate()[0]
        holder.send_signal(signal.SIGTERM)
        listener = json.loads(holder.communicate(timeout=30)[0])
        used = [n for n in made[1:] if os.lstat(n).st_size]
        problems = []
        if used:
            problems.append(f"the job used {len(used)} of {len(made) - 1} planted segment "
                            f"files ({os.lstat(used[0]).st_size} bytes each)")
        if victim.read_bytes() != SECRET:
            problems.append(f"the job wrote through the planted link: {victim} is now "
                            f"{victim.stat().st_size} bytes")
        if job.returncode != 0:
            problems.append(f"job exit {job.returncode}: {output[-1500:]}")
        if listener["connections"]:
            problems.append(f"nobody's listener on the port base {port} got "
                            f"{listener['connections']} connections, {listener['bytes']} bytes")
        assert not problems, "; ".join(problems)
        assert not exposed, f"held below a world-writable folder: {exposed}"
        # the listing saw the job: its segments in its own folder, its GPS folder, its logs
        assert any("/pivotrl-mpi-" in p and "/vader_segment." in p for p in seen), seen
        assert any(p.startswith(str(trace.parent)) for p in seen), seen
        summary = json.loads((trace.parent / "job.summary.json").read_text())
        assert summary["steps"] == 1, summary
    finally:
        for proc in (job, holder):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for name in made:
            Path(name).unlink(missing_ok=True)
        victim.unlink()
        victim_dir.rmdir()


def test_the_slurm_epilog_removes_the_jobs_mpi_folders_and_nothing_else(tmp_path):
    """The epilog (root, every node) removes the job user's `pivotrl-mpi-<job>-<hex>` folders
    with what a killed rank left inside; not another job's, not another account's, and a
    symlink under such a name is removed at most, never followed."""
    root = Path(tempfile.mkdtemp(prefix="pivotrl-epilog-", dir="/tmp"))   # a shared shm
    root.chmod(0o1777)
    try:
        _epilog(root, tmp_path)
    finally:
        shutil.rmtree(root)


def _epilog(root: Path, tmp_path: Path) -> None:
    hexes = ["0123456789abcdef", "fedcba9876543210"]
    ours, other_job = root / f"pivotrl-mpi-77-{hexes[0]}", root / f"pivotrl-mpi-78-{hexes[0]}"
    for folder in (ours, other_job):
        folder.mkdir(0o700)
        (folder / "vader_segment.vm.0.1.0").write_bytes(b"x")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(SECRET)
    (root / f"pivotrl-mpi-77-{hexes[1]}").symlink_to(victim)
    p = _as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o700)",
                   str(root / "pivotrl-mpi-77-00000000000000ff"))
    assert p.wait(30) == 0, p.stderr.read()
    subprocess.run(["bash", str(ROOT / "slurm" / "epilog.sh")], check=True, timeout=60,
                   env={**os.environ, "SLURM_JOB_ID": "77", "SLURM_JOB_UID": "0",
                        "PIVOTRL_SHM_DIR": str(root)})
    assert sorted(p.name for p in root.iterdir()) == [
        "pivotrl-mpi-77-00000000000000ff", f"pivotrl-mpi-77-{hexes[1]}",
        f"pivotrl-mpi-78-{hexes[0]}"]
    assert (victim / "keep").read_bytes() == SECRET
