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
import stat
from pathlib import Path

ROOT = Path(os.environ.get("PIVOTRL_SHM_DIR", "/dev/shm"))


def user_dir(uid: int | None = None) -> Path:
    return ROOT / f"pivotrl-u{os.getuid() if uid is None else uid}"


SHM_DIR = user_dir()


def check(path: Path = SHM_DIR) -> Path:
    """`path` if it is a real 0700 folder of this user; PermissionError naming what is wrong."""
    st = os.lstat(path)
    uid = os.getuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else \
            "a folder" if stat.S_ISDIR(st.st_mode) else "a file"
        raise PermissionError(
            f"{path} is {kind} of uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, not a "
            f"0700 folder of uid {uid}: GPS refuses to keep weights there. Remove it (it may "
            f"have been planted by another account) or set PIVOTRL_SHM_DIR elsewhere")
    return path


def ensure(path: Path = SHM_DIR) -> Path:
    """Create this user's folder if it is missing (0700), then `check` it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return check(path)


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
