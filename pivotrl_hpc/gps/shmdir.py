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
   can know its name before the folder exists. The Slurm epilog finds it by its owner
   (gps/epilog.py).

A name is public once its folder exists (`/dev/shm` is listable), so another account can
make a folder of that name after the user's last agent removed it. A name taken so is never
refused: the process that finds the kept name (or the published one, on a node where it is
taken) another account's draws a fresh suffix and records it for that shm root in a 0600
file beside the user's record (`renew`: `gps-folder.<hash of the root>`, which then names
the folder under that root), under an exclusive flock of `gps-folder.lock`, re-reading the
record first: two of the user's processes starting at once on a node find the same fresh
name, the user's processes under other roots keep theirs, and the squatter's folder is left
alone. The launchers publish the folder they found to every rank
of the job (PIVOTRL_GPS_DIR), so the ranks of one job agree on every node where it is free;
on a node where it is taken they all renew from the one record (a shared home).

The agent creates the folder and refuses one that is not a 0700 folder of its own user (a
symlink of the user's, or a name taken by another account between the process's start and
the agent's: the record is renewed then, so the next start uses a fresh name). Torch-free:
the launcher's cleanup imports it.

Nothing of GPS outlives its agents, the folder included: each agent holds a shared flock on
the folder while it runs (`hold`), and the last one out removes it if it is empty (`release`:
an exclusive flock it cannot get means another agent still uses it; a folder of another
account is never removed). An agent starting while the folder is being removed finds the
folder it locked unlinked and makes it again.
"""
from __future__ import annotations

import fcntl
import hashlib
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


def _suffix_file(root: Path | None = None) -> Path:
    """The user's record `gps-folder`; with `root`, the record of the name renewed under that
    shm root (`gps-folder.<16 hex of its path's sha256>`): a renewal under one root leaves
    the processes of the user using another (a job's private root) as they are."""
    state = envs.XDG_STATE_HOME.raw() or os.path.join(
        os.path.expanduser("~"), ".local", "state")
    name = "gps-folder" if root is None else \
        f"gps-folder.{hashlib.sha256(str(root).encode()).hexdigest()[:16]}"
    return Path(state) / "pivotrl" / name


def _read_suffix(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        text = f.read(64).strip()
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode) \
            or not SUFFIX.fullmatch(text):
        raise FolderRefused(f"{path} is not a 0600 file of uid {os.getuid()} holding 16 "
                            "hex digits: remove it (it is made again)")
    return text


def user_suffix(root: Path | None = None) -> str:
    """This user's folder suffix (under `root`: the one renewed there, if any): read from its
    0600 file, made on first use."""
    if root is not None and (text := _read_suffix(_suffix_file(root))) is not None:
        return text
    path = _suffix_file()
    for _ in range(2):
        if (text := _read_suffix(path)) is not None:
            return text
        os.makedirs(path.parent, mode=0o700, exist_ok=True)
        _write_suffix(path, secrets.token_hex(8), replace=False)   # or another's first
    raise FolderRefused(f"{path} could not be made")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def taken(path: Path) -> int | None:
    """The uid of another account if `path` exists as its file or folder (the name is
    taken: this user cannot remove it from a sticky shm root); else None."""
    try:
        uid = os.lstat(path).st_uid
    except FileNotFoundError:
        return None
    return uid if uid != os.getuid() else None


def _write_suffix(path: Path, suffix: str, replace: bool = True) -> None:
    """The record written whole: a fresh 0600 temp file renamed over it (`replace`) or
    linked to its name unless a record is there already; a reader never sees it half made."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(suffix + "\n")
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.rename(tmp, path)
        else:
            os.link(tmp, path)
    except FileExistsError:
        pass   # another process made the record first: it stays
    finally:
        tmp.unlink(missing_ok=True)


def renew(root: Path) -> str:
    """The user's suffix, drawn afresh and recorded if the kept one names a folder another
    account has taken under `root`. Under an exclusive flock of the record's lock file, the
    record is read again first: of two processes starting at once, the second finds the
    first's fresh suffix and keeps it."""
    user_suffix()   # the record (and its folder) exist and are the user's
    record = _suffix_file(root)
    lock = os.open(record.with_name("gps-folder.lock"),
                   os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(16):
            suffix = user_suffix(root)
            folder = root / f"pivotrl-u{os.getuid()}-{suffix}"
            if (owner := taken(folder)) is None:
                return suffix
            _write_suffix(record, secrets.token_hex(8))
            log.warning("GPS folder %s is taken by uid %d (%s): a fresh name is recorded "
                        "in %s", folder, owner, _user(owner), record)
        raise FolderRefused(f"16 fresh GPS folder names under {root} were all taken by "
                            "other accounts")
    finally:
        os.close(lock)


def _locate() -> tuple[Path, Path]:
    """(the shm file system's folder the GPS folder sits in, the GPS folder)."""
    uid = os.getuid()
    if envs.GPS_DIR.is_set():
        folder = Path(envs.GPS_DIR.get())
        if (owner := taken(folder)) is None:
            return folder.parent, folder
        root = folder.parent   # taken on this node: the user's kept name here, renewed
        log.warning("GPS folder %s (published by the launcher) is taken by uid %d (%s) on "
                    "this node", folder, owner, _user(owner))
        folder = _kept(root, uid)
        os.environ[FOLDER_ENV] = str(folder)   # this process's children: the same one
        return root, folder
    if not envs.SHM_DIR.is_set() and (run := _run_user_dir(uid)) is not None:
        return run, run / "pivotrl"
    root = Path(envs.SHM_DIR.get())
    return root, _kept(root, uid)


def _kept(root: Path, uid: int) -> Path:
    """`root`/pivotrl-u<uid>-<the user's suffix>, renewed if another account took it."""
    try:
        suffix = user_suffix(root)
        if taken(root / f"pivotrl-u{uid}-{suffix}") is not None:
            suffix = renew(root)
    except (OSError, FolderRefused) as e:   # no home to keep it in: a fresh one, published
        suffix = secrets.token_hex(8)          # to this process's children (the job's ranks)
        os.environ[FOLDER_ENV] = str(root / f"pivotrl-u{uid}-{suffix}")
        log.warning("GPS folder suffix not kept (%s): using %s for this process and its "
                    "children", e, os.environ[FOLDER_ENV])
    return root / f"pivotrl-u{uid}-{suffix}"


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
        if st.st_uid != uid:
            fix = ("another account took the name after this process found it; a fresh name "
                   "is recorded now: start again")
        else:
            fix = "remove it, or set PIVOTRL_SHM_DIR to a folder of your own"
        raise FolderRefused(
            f"{path} is {kind} of uid {st.st_uid} ({_user(st.st_uid)}) with mode "
            f"{stat.S_IMODE(st.st_mode):o}, not a 0700 folder of uid {uid}: GPS refuses to "
            f"keep weights there. Fix: {fix}")


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
    """Create this user's folder if it is missing (0700), then `check` it.
    A name another account took since this process found it is refused once, and the record
    renewed, so that the next start uses a fresh name."""
    try:
        os.mkdir(path, mode=0o700)
    except FileExistsError:
        pass
    try:
        return check(path)
    except FolderRefused:
        if taken(path) is not None:
            try:
                renew(path.parent)   # if the record names this folder
            except (OSError, FolderRefused):
                log.warning("GPS folder name could not be renewed", exc_info=True)
        raise


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
    """Remove the folder if it is this user's, empty, and no agent holds it (an exclusive
    flock it can get); True if it went. Also for cleanups after a killed agent, which held
    nothing. Another account's folder of that name stays, whoever runs this (root too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = os.lstat(path)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return False   # the name is another folder now: not the one checked
        os.rmdir(path)
        return True
    except OSError:   # held by another agent (BlockingIOError), or not empty: it stays
        return False
    finally:
        os.close(fd)
