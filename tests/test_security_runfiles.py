"""Run files another account can lock, plant links for, or leave FIFOs in: the trace, its
TensorBoard event file, the control files of the logs folder, and the modes of what the
writers make under any umask (the live job's run files: test_security_planted.py).

The attacker is the real `nobody` account (setpriv, the system Python, the standard library
only), a member of the run folder's group where the folder is shared on purpose
(`trace.group_shared`: a folder of root, group nogroup, 2770). Nothing here relies on
fs.protected_* (0 on this machine).
"""
from __future__ import annotations

import itertools
import logging
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_security_planted import NOBODY
from test_security_planted import _as_nobody as as_nobody
from test_security_planted import _root_only  # noqa: F401  (autouse: root and the system Python)
from test_security_planted import _run_nobody as run_nobody
from test_security_planted import _tmp_folder


def _as_nobody(code: str, *args: str) -> subprocess.Popen:
    """`nobody`, a member of the shared folders' group, its stdin held open by the test."""
    return as_nobody(code, *args, group=True, stdin=subprocess.PIPE)


def _run_nobody(code: str, *args: str) -> str:
    return run_nobody(code, *args, group=True)


@pytest.fixture
def top():
    """A folder of root that every account may enter (0755), as a home or project folder."""
    yield from _tmp_folder("pivotrl-runfiles-", 0o755)


def _group_folder(path: Path) -> Path:
    """A folder shared with a group on purpose: root's, group nogroup (nobody's), 2770."""
    path.mkdir()
    os.chown(path, 0, NOBODY)
    os.chmod(path, 0o2770)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _trace(path: Path, shared: bool, steps: int = 2, summary: dict | None = None):
    from pivotrl_hpc.trace import TraceWriter

    w = TraceWriter(path, {"run": path.name}, group_shared=shared)
    for step in range(steps):
        w.append("steps", step=step, tokens=10 * step)
    w.flush()
    if summary is not None:
        w.close(summary)
    return w


# ---- the trace's lock --------------------------------------------------------------------
OPEN_AND_LOCK = r"""
import errno, fcntl, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError as e:
    print(errno.errorcode[e.errno], flush=True)
    sys.exit(0)
print("locked", flush=True)
sys.stdin.read()          # held until the test closes stdin
"""


def test_nobody_cannot_open_a_trace_to_lock_it(top):
    """The trace is 0600 whatever the umask: another account cannot even open it, so it can
    take no lock on it (its path is public in every rank's cmdline)."""
    old = os.umask(0)
    try:
        path = top / "out" / "job.h5"
        _trace(path, False, summary={"ok": 1})
    finally:
        os.umask(old)
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    os.chmod(path.parent, 0o755)   # even where the folder lets it in
    assert _run_nobody(OPEN_AND_LOCK, str(path)).strip() == "EACCES"


def test_a_lock_a_group_member_holds_stops_neither_writer_nor_reader(top):
    """trace.group_shared: the group may read the trace (0640), so `nobody`, a member, can
    flock it. Our readers and writers take no HDF5 file lock: a reader of the finished trace,
    a fresh start over it (a new file renamed into place: the old one neither truncated nor
    failed), and the new writer under a second lock all go on."""
    from pivotrl_hpc.trace import open_trace

    out = _group_folder(top / "grp")
    path = out / "job.h5"
    _trace(path, True, steps=3, summary={"first": 1})
    assert _mode(path) == 0o640
    holders = [_as_nobody(OPEN_AND_LOCK, str(path))]
    try:
        assert holders[0].stdout.readline().strip() == "locked"
        with open_trace(str(path)) as t:      # `pivotrl trace check`'s reader
            assert t.summary == {"first": 1} and t.rows("steps") == 3
        old_inode = os.stat(path).st_ino
        w = _trace(path, True, steps=1)       # a fresh start over the locked trace
        assert os.stat(path).st_ino != old_inode and _mode(path) == 0o640
        holders.append(_as_nobody(OPEN_AND_LOCK, str(path)))
        assert holders[1].stdout.readline().strip() == "locked"
        for step in range(1, 40):              # the running writer under the lock
            w.append("steps", step=step, tokens=step)
            w.flush()
        with open_trace(str(path)) as t:
            assert t.rows("steps") == 40 and t.summary is None
        w.close({"second": 2})
        with open_trace(str(path)) as t:
            assert t.summary == {"second": 2}
    finally:
        for p in holders:
            p.communicate(timeout=30)
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == []


# ---- TensorBoard's event file --------------------------------------------------------------
PLANT_EVENT_LINKS = r"""
import os, sys
folder, victim, host, pid, t0 = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
for t in range(t0, t0 + 120):
    os.symlink(victim, os.path.join(folder, f"events.out.tfevents.{t}.{host}.{pid}"))
print(len(os.listdir(folder)))
"""


def test_planted_event_file_links_are_replaced_never_written_through(top, tmp_path):
    """TensorBoard's folder left group-writable (2770: what umask 002 made of it before);
    `nobody` plants `events.out.tfevents.<t>.<host>.<pid>` links to a 0600 file of root for
    the next two minutes of this process: the writer replaces the link with its own file."""
    import socket

    from pivotrl_hpc.checkpoint.folders import RunFolderError
    from pivotrl_hpc.trace.tensorboard import EventWriter

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    victim.chmod(0o600)
    out = _group_folder(top / "grp")
    tb = _group_folder(out / "job.tensorboard")
    planted = _run_nobody(PLANT_EVENT_LINKS, str(tb), str(victim), socket.gethostname(),
                          str(os.getpid()), str(int(time.time())))
    assert int(planted) == 120
    with pytest.raises(RunFolderError, match="writable by its group"):   # no opt-in: refused
        EventWriter(tb)
    w = EventWriter(tb, group_shared=True)
    w.scalars(1, {"steps/loss": 0.5})
    w.close()
    assert victim.read_bytes() == b"keep"
    assert not w.path.is_symlink() and _mode(w.path) == 0o640
    assert w.path.read_bytes()[:8] != b"keep"
    assert len(os.listdir(tb)) == 120     # one link replaced by the event file


# ---- the control files of the logs folder -------------------------------------------------
PLANT_CONTROL = r"""
import os, sys
logs, name, kind = sys.argv[1], sys.argv[2], sys.argv[3]
path = os.path.join(logs, name)
if kind == "fifo":
    os.mkfifo(path, 0o666)
else:
    with open(path, "w") as f:
        f.write(kind)
"""


@pytest.fixture
def logs(top):
    out = _group_folder(top / "grp")
    return _group_folder(out / "job.logs")


_CLOCK = itertools.count(10.0, 10.0)   # each poll a new second of the controller's clock


def _poll(ck, timeout_s: float = 10.0) -> float:
    """Checkpointer.poll in a thread: how long it took (a FIFO held it for ever before)."""
    t0 = time.monotonic()
    th = threading.Thread(target=ck.poll, args=(next(_CLOCK),), daemon=True)
    th.start()
    th.join(timeout_s)
    assert not th.is_alive(), f"poll still blocked after {timeout_s:.0f} s"
    return time.monotonic() - t0


def test_a_planted_checkpoint_request_is_ignored_and_never_blocks(logs, top, caplog):
    """`nobody` (a group member) leaves a FIFO, then a file of its own, as the checkpoint
    request the controller polls: neither is read (the FIFO would hold the controller in
    read() until someone writes), each is removed with a warning; the user's own request
    still works, and a word that is no mode is ignored, not a ValueError."""
    from pivotrl_hpc.controller.checkpointing import REQUEST, Checkpointer

    ck = Checkpointer(top / "grp" / "job.checkpoints", 0, 2, {}, logs, True)
    caplog.set_level(logging.WARNING)
    for kind in ("fifo", "stop"):
        _run_nobody(PLANT_CONTROL, str(logs), REQUEST, kind)
        assert _poll(ck) < 5.0
        assert ck.mode is None and not os.path.lexists(logs / REQUEST)
    assert "a FIFO of uid 65534 (nobody)" in caplog.text
    assert "a file of uid 65534 (nobody)" in caplog.text
    (logs / REQUEST).write_text("pwned\n")
    _poll(ck)
    assert ck.mode is None and "'pwned' is not one of" in caplog.text
    (logs / REQUEST).write_text("requeue\n")
    _poll(ck)
    assert ck.mode == "requeue"


def test_a_planted_requeue_marker_requeues_nothing(logs, caplog):
    """The batch step's requeue marker (launch.slurm.execute takes it with take_own): a FIFO
    or a file of `nobody` is no marker; the controller's own one is."""
    from pivotrl_hpc.checkpoint.folders import take_own
    from pivotrl_hpc.checkpoint.layout import REQUEUE_FILE

    caplog.set_level(logging.WARNING)
    for kind in ("fifo", '{"step": 9, "checkpoint": "/root/.ssh", "why": "stop"}'):
        _run_nobody(PLANT_CONTROL, str(logs), REQUEUE_FILE, kind)
        assert take_own(logs, REQUEUE_FILE) is None
        assert not os.path.lexists(logs / REQUEUE_FILE)
    assert caplog.text.count("not a regular file of this user") == 2
    (logs / REQUEUE_FILE).write_text('{"step": 1}\n')
    assert take_own(logs, REQUEUE_FILE) == '{"step": 1}\n'


# ---- modes whatever the umask -------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o000, 0o002])
@pytest.mark.parametrize("shared", [False, True])
def test_the_writers_set_their_modes_whatever_the_umask(tmp_path, umask, shared):
    """Every file and folder the run's writers make: 0600 / 0700, or 0640 / 0750 with
    trace.group_shared, under umask 000 and 002 alike."""
    from pivotrl_hpc.checkpoint.folders import create_in, open_folder, write_text
    from pivotrl_hpc.trace import TraceWriter

    f, d = (0o640, 0o750) if shared else (0o600, 0o700)
    run = tmp_path / "a" / "run"
    old = os.umask(umask)
    try:
        os.close(open_folder(run / "job.logs", own=2, create=True, group_shared=shared))
        w = TraceWriter(run / "job.h5", {}, tensorboard=run / "job.tensorboard",
                        group_shared=shared)
        w.append("steps", step=0)
        w.close({})
        write_text(run, "job.summary.json", "{}\n", shared)
        os.close(create_in(run / "job.logs", "mpirun.log", shared, own=2))
    finally:
        os.umask(old)
    tb = run / "job.tensorboard"
    files = [run / "job.h5", run / "job.summary.json", run / "job.logs" / "mpirun.log",
             *tb.iterdir()]
    assert {p.name: _mode(p) for p in files} == {p.name: f for p in files}
    folders = [tmp_path / "a", run, run / "job.logs", tb]
    assert {p.name: _mode(p) for p in folders} == {p.name: d for p in folders}


# ---- a live job in a group-shared folder ---------------------------------------------------
PLANT_RUN_LINKS = r"""
import fcntl, os, stat, sys, time
out, victims, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
logs = os.path.join(out, "job.logs")
names = [os.path.join(out, n) for n in ("job.h5", "job.summary.json")]
names += [os.path.join(logs, "mpirun.log")]
names += [os.path.join(logs, f"rank-{r}.{x}") for r in range(ranks) for x in ("pid", "log")]
deadline = time.time() + 600       # the launcher's last step before mpirun: the config
while not os.path.exists(os.path.join(out, "job.config.json")) and time.time() < deadline:
    time.sleep(0.002)
planted = 0
for i, name in enumerate(names):
    try:
        os.symlink(os.path.join(victims, f"v{i}"), name)
        planted += 1
    except FileExistsError:
        pass
os.mkfifo(os.path.join(logs, "checkpoint.request"), 0o666)
print(planted, len(names), flush=True)
trace = os.path.join(out, "job.h5")   # the running job's trace, once it is its (0640) file
while time.time() < deadline:
    try:
        if stat.S_ISREG(os.lstat(trace).st_mode):
            fd = os.open(trace, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("locked", time.time(), flush=True)
            break
    except FileNotFoundError:
        pass
    time.sleep(0.002)
sys.stdin.read()                      # held until the job has ended
"""


@pytest.mark.live
def test_a_live_job_in_a_group_shared_folder_writes_through_no_planted_link(top, tiny_models):
    """`trace.group_shared`, umask 002, a logs folder its group may write (2770, as an earlier
    start under umask 002 left it): `nobody`, a member, plants links to the user's 0600 files
    for the trace, the summary, mpirun.log and every rank's pid and log file as soon as the
    launcher has written the config, and a FIFO as the checkpoint request; then, as a
    member of the group, it holds an exclusive flock on the running job's trace (0640) from
    the moment the trace is in place to the job's end. The job ends 0;
    every victim is intact; every run file is a regular file of mode 0640, TensorBoard's
    folder 2750 (the set-group-ID bit of the shared folder kept); the FIFO was removed, not
    read."""
    import sys

    from live_util import model_overrides

    out = _group_folder(top / "grp")
    _group_folder(out / "job.logs")
    victims = top / "victims"
    victims.mkdir(mode=0o700)
    ranks = 10    # tiny-cpu: 2 nodes x (1 agent + 4 device workers)
    for i in range(2 + 1 + 2 * ranks):
        (victims / f"v{i}").write_text(f"keep {i}\n")
        (victims / f"v{i}").chmod(0o600)
    planter = _as_nobody(PLANT_RUN_LINKS, str(out), str(victims), str(ranks))
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
                        str(root / "configs" / "tiny-cpu.yaml"), *model_overrides(tiny_models),
                        f"trace.path={out / 'job.h5'}", "trace.group_shared=true",
                        "trace.tensorboard=true", "rl.steps=2"],
                       capture_output=True, text=True, timeout=900, cwd=root, umask=0o002,
                       env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    ended = time.time()
    said = planter.communicate(timeout=60)[0].split("\n")
    planted, wanted = map(int, said[0].split())
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert planted >= wanted - 1      # mpirun.log may be made before nobody sees the config
    changed = [v.name for v in sorted(victims.iterdir())
               if v.read_bytes() != f"keep {v.name[1:]}\n".encode()]
    assert changed == []
    locked = float(said[1].split()[1])   # nobody's exclusive lock on the running job's trace
    assert locked < ended - 10, (locked, ended)
    logs = out / "job.logs"
    files = [out / "job.h5", out / "job.summary.json", out / "job.config.json",
             logs / "mpirun.log", *(logs / f"rank-{r}.{x}" for r in range(ranks)
                                    for x in ("pid", "log")),
             *(out / "job.tensorboard").iterdir()]
    modes = {str(f.relative_to(out)): (stat.S_ISREG(os.lstat(f).st_mode), _mode(f))
             for f in files}
    assert modes == {name: (True, 0o640) for name in modes}
    assert _mode(out / "job.tensorboard") == 0o2750    # set-group-ID kept from the folder
    assert not os.path.lexists(logs / "checkpoint.request")
    assert "ignored" in (logs / "rank-0.log").read_text()
