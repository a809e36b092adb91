"""Where GPS files live: a 0700 folder of this user in the shm file system (issue 11.2).

`<PIVOTRL_SHM_DIR or /dev/shm>/pivotrl-u<uid>/`: segments, control blocks and staging files
of every job of this user, named `pivotrl-<job>-<node>-...` inside. No other account can
create, rename or read anything there, so a name another user guessed cannot be planted; the
agent creates the folder and refuses one that is not a 0700 folder of its own user (a
symlink, or a folder planted under that name by someone else). Torch-free: the launcher's
cleanup imports it.

Nothing of GPS outlives its agents, the folder included: each agent holds a shared flock on
the folder while it runs (`hold`), and the last one out removes it if it is empty (`release`:
an exclusive flock it cannot get means another agent still uses it). An agent starting while
the folder is being removed finds the folder it locked unlinked and makes it again.
"""
from __future__ import annotations

import fcntl
import os
import pwd
import stat
from pathlib import Path

ROOT = Path(os.environ.get("PIVOTRL_SHM_DIR", "/dev/shm"))


def user_dir(uid: int | None = None) -> Path:
    return ROOT / f"pivotrl-u{os.getuid() if uid is None else uid}"


SHM_DIR = user_dir()


class GPSMemoryError(MemoryError):
    """Not enough shared or host memory for what the GPS is asked to hold."""


class FolderRefused(PermissionError):
    """The user's GPS folder is not a 0700 folder of this user (squatted or planted)."""
    exit_code = 2   # a refusal, not a crash: the launchers end the job with 2 (launch/entry.py)


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
        os.mkdir(path, 0o700)
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


def job_files(job: str) -> list[Path]:
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
