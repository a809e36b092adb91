"""Where GPS files live: a 0700 folder of this user in the shm file system (issue 11.2).

`<PIVOTRL_SHM_DIR or /dev/shm>/pivotrl-u<uid>/`: segments, control blocks and staging files
of every job of this user, named `pivotrl-<job>-<node>-...` inside. No other account can
create, rename or read anything there, so a name another user guessed cannot be planted; the
agent creates the folder and refuses one that is not a 0700 folder of its own user (a
symlink, or a folder planted under that name by someone else). Torch-free: the launcher's
cleanup imports it.
"""
from __future__ import annotations

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
