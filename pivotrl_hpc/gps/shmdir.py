"""Where GPS files live: a 0700 folder of this user in a shm file system (issues 11.2, 46).

Segments, control blocks and staging files of every job of this user sit in one folder,
named `pivotrl-<job>-<node>-...` inside. No other account can create, rename or read
anything there, so a name another user guessed cannot be planted. The folder's own name must
not be one another account can take first either (issue 46: `nobody` made
`/dev/shm/pivotrl-u0` and root's `gps serve` exited 2 for good), so it is, in order:

1. `PIVOTRL_GPS_DIR`: the folder the launcher chose, published to every rank of the job;
2. `/run/user/<uid>/pivotrl` where the system gives the user `/run/user/<uid>` (a 0700 tmpfs
   folder only the user can write into) and PIVOTRL_SHM_DIR does not say otherwise;
3. `<PIVOTRL_SHM_DIR or /dev/shm>/pivotrl-u<uid>-<suffix>`, the suffix 16 random hex digits
   made once per user and kept in a 0600 file of the user's own
   (`$XDG_STATE_HOME or ~/.local/state`/pivotrl/gps-folder): every process of the user, the
   agent, its clients and the launcher's sweep, finds the same folder, and no other account
   can know its name. The Slurm epilog finds it by its owner (gps/epilog.py).

The agent creates the folder and refuses one that is not a 0700 folder of its own user (a
symlink, or a folder planted under that name by someone else). Torch-free: the launcher's
cleanup imports it.

Nothing of GPS outlives its agents, the folder included: each agent holds a shared flock on
the folder while it runs (`hold`), and the last one out removes it if it is empty (`release`:
an exclusive flock it cannot get means another agent still uses it). An agent starting while
the folder is being removed finds the folder it locked unlinked and makes it again.
"""
from __future__ import annotations

import fcntl
import logging
import os
import pwd
import re
import secrets
import stat
from pathlib import Path

from pivotrl_hpc import envs

log = logging.getLogger(__name__)

RUN_USER = Path("/run/user")
FOLDER_ENV = envs.GPS_DIR.name   # the folder, as the launcher publishes it to the job
SUFFIX = re.compile(r"[0-9a-f]{16}")
_JOB = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]{0,63}")   # launch.layout.job_id's alphabet


class GPSMemoryError(MemoryError):
    """Not enough shared or host memory for what the GPS is asked to hold."""


class FolderRefused(PermissionError):
    """The user's GPS folder is not a 0700 folder of this user (squatted or planted)."""
    exit_code = 2   # a refusal, not a crash: the launchers end the job with 2 (launch/entry.py)


def _run_user_dir(uid: int) -> Path | None:
    """/run/user/<uid> if it is a real 0700 folder of `uid`."""
    path = RUN_USER / str(uid)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    ok = stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077
    return path if ok else None


def _suffix_file() -> Path:
    state = envs.XDG_STATE_HOME.raw() or os.path.join(
        os.path.expanduser("~"), ".local", "state")
    return Path(state) / "pivotrl" / "gps-folder"


def user_suffix() -> str:
    """This user's folder suffix: read from its 0600 file, made on first use."""
    path = _suffix_file()
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(2):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            os.makedirs(path.parent, mode=0o700, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue   # another process made it first: read theirs
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(8) + "\n")
            continue
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            text = f.read(64).strip()
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not SUFFIX.fullmatch(text):
            raise FolderRefused(f"{path} is not a 0600 file of uid {os.getuid()} holding 16 "
                                "hex digits: remove it (it is made again)")
        return text
    raise FolderRefused(f"{path} could not be made")


def _locate() -> tuple[Path, Path]:
    """(the shm file system's folder the GPS folder sits in, the GPS folder)."""
    uid = os.getuid()
    if envs.GPS_DIR.is_set():
        folder = Path(envs.GPS_DIR.get())
        return folder.parent, folder
    if not envs.SHM_DIR.is_set() and (run := _run_user_dir(uid)) is not None:
        return run, run / "pivotrl"
    root = Path(envs.SHM_DIR.get())
    try:
        suffix = user_suffix()
    except (OSError, FolderRefused) as e:   # no home to keep it in: a fresh one, published
        suffix = secrets.token_hex(8)          # to this process's children (the job's ranks)
        os.environ[FOLDER_ENV] = str(root / f"pivotrl-u{uid}-{suffix}")
        log.warning("GPS folder suffix not kept (%s): using %s for this process and its "
                    "children", e, os.environ[FOLDER_ENV])
    return root, root / f"pivotrl-u{uid}-{suffix}"


ROOT, SHM_DIR = _locate()


def check(path: Path = SHM_DIR) -> Path:
    """`path` if it is a real 0700 folder of this user; FolderRefused naming what is wrong."""
    _check_stat(path, os.lstat(path))
    return path


def _check_stat(path: Path, st: os.stat_result) -> None:
    uid = os.getuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else \
            "a folder" if stat.S_ISDIR(st.st_mode) else "a file"
        fix = ("an administrator must remove it (another account made it: it cannot be "
               "removed by you)" if st.st_uid != uid else "remove it")
        raise FolderRefused(
            f"{path} is {kind} of uid {st.st_uid} ({_user(st.st_uid)}) with mode "
            f"{stat.S_IMODE(st.st_mode):o}, not a 0700 folder of uid {uid}: GPS refuses to "
            f"keep weights there. Fix: {fix}, or set PIVOTRL_SHM_DIR to a folder of your own")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def open_dir(path: Path = SHM_DIR) -> int:
    """The folder opened (O_DIRECTORY | O_NOFOLLOW) and checked through its descriptor: files
    are then opened relative to it (`dir_fd=`), so a folder renamed or swapped for a symlink
    after the check cannot redirect them (issue 35, N3)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _check_stat(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure(path: Path = SHM_DIR) -> Path:
    """Create this user's folder if it is missing (0700), then `check` it."""
    try:
        os.mkdir(path, mode=0o700)
    except FileExistsError:
        pass
    return check(path)


def reserve_file(fd: int, path: Path, offset: int, length: int) -> None:
    """Allocate [offset, offset + length) of a shm file now (posix_fallocate): a full shm
    fails here, naming the bytes missing, instead of a SIGBUS at the first store into a hole
    of the mapping later (issue 11.8, 35)."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        st = os.statvfs(ROOT)
        free = st.f_bavail * st.f_frsize
        raise GPSMemoryError(f"{path.name}: {path.parent} cannot hold {length} more bytes "
                             f"({length / 2**20:.1f} MiB; {free} bytes free, "
                             f"{max(0, length - free)} missing): {e.strerror}") from None


def valid_job(job: str) -> bool:
    """A job id (launch.layout.job_id's alphabet), safe in a name pattern."""
    return bool(_JOB.fullmatch(job))


def job_files(job: str) -> list[Path]:
    """The files of `job` in the folder; a job id is checked before it makes a pattern
    (issue 46: a marker holding `*` swept every job's files)."""
    if not valid_job(job):
        raise ValueError(f"{job!r} is not a job id")
    return sorted(SHM_DIR.glob(f"pivotrl-{job}-*"))


def hold(path: Path = SHM_DIR) -> int:
    """`ensure` the folder and take a shared flock on it for an agent's lifetime; the fd."""
    for _ in range(10):
        ensure(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.fstat(fd).st_ino == os.lstat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)   # removed (and maybe made again) by the last agent out: once more
    raise RuntimeError(f"{path} kept vanishing while GPS agents stopped and started")


def release(fd: int, path: Path = SHM_DIR) -> None:
    """Drop an agent's hold; remove the folder if no other agent holds it and it is empty."""
    os.close(fd)   # drops the shared flock
    remove_if_unused(path)


def remove_if_unused(path: Path = SHM_DIR) -> bool:
    """Remove the folder if it is empty and no agent holds it (an exclusive flock it can
    get); True if it went. Also for cleanups after a killed agent, which held nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rmdir(path)
        return True
    except OSError:   # held by another agent (BlockingIOError), or not empty: it stays
        return False
    finally:
        os.close(fd)
