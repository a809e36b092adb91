"""The Slurm epilog's shm cleanup: `slurm/epilog.sh` runs this file as root with the system
Python (`python3 -I epilog.py JOB UID`), so it imports the standard library only.

The job's user owns the folder `<PIVOTRL_SHM_DIR or /dev/shm>/pivotrl-u<uid>-<suffix>` (or
`/run/user/<uid>/pivotrl`; gps/shmdir.py) and can rename it or swap it for a symlink at any
moment (RENAME_EXCHANGE), so root never uses a path into it twice (issue 35): the folder is
opened once, O_DIRECTORY | O_NOFOLLOW, its owner checked on the descriptor, and everything
after goes through that descriptor: listing, the owner check of each entry (never following
a link), unlinkat, and the flock that says no live agent of the user's other jobs holds it.
Nothing is ever created (the old `flock FILE` opened with O_CREAT after a `-L` check, and a
swap made root create a file wherever a symlink pointed).
The folder itself is removed by name from the shm root only if that name still is the
folder that was locked; the sticky shm root lets the user put nothing else there.
"""
from __future__ import annotations

import fcntl
import os
import re
import stat
import sys

# envs.SHM_DIR's name, written out: this file imports the standard library only
# (test_envs checks both)
SHM_DIR_ENV = "PIVOTRL_SHM_DIR"


def clean(root: str, uid: int, job: str) -> list[str]:
    """Remove the job's files in the user's GPS folders under `root` (owned by the user,
    regular files or symlinks), then each folder if it is empty and unheld; the removed paths.
    The folder's name carries a suffix private to the user (gps/shmdir.py, issue 46), so the
    folders are found by name pattern and owner: `pivotrl-u<uid>-<16 hex>` (and the
    `pivotrl-u<uid>` of versions before it)."""
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    removed = []
    try:
        pattern = re.compile(rf"pivotrl-u{uid}(-[0-9a-f]{{16}})?")
        for name in sorted(n for n in os.listdir(top) if pattern.fullmatch(n)):
            removed += [os.path.join(root, name, n) for n in _clean_folder(top, name, uid, job)]
    finally:
        os.close(top)
    return removed


def _clean_folder(top: int, name: str, uid: int, job: str) -> list[str]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
    except OSError:   # gone, a symlink (ELOOP) or not a folder (ENOTDIR): not touched
        return []
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            return []   # not the job user's folder
        removed = _remove_job_files(fd, uid, f"pivotrl-{job}-")
        _remove_folder(top, name, fd, st)
        return removed
    finally:
        os.close(fd)


def tp_clean(root: str, uid: int, job: str) -> list[str]:
    """vLLM's TP segments of the job's engine hosts, which shm_open puts in /dev/shm itself
    (`pivotrl-<job>-<node>-tp<port>-<token>-...`: runtime/tp_world.py): the user's files
    there, through a descriptor of the sticky root (no link followed)."""
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        return [os.path.join(root, n) for n in _remove_job_files(top, uid, f"pivotrl-{job}-")]
    finally:
        os.close(top)


def run_user_clean(uid: int, job: str) -> list[str]:
    """The folder `/run/user/<uid>/pivotrl`, where the system gives the user one (shmdir);
    /run/user/<uid> is the user's, so it is opened by descriptor and its owner checked."""
    try:
        top = os.open(f"/run/user/{uid}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        if os.fstat(top).st_uid != uid:
            return []
        return [os.path.join(f"/run/user/{uid}/pivotrl", n)
                for n in _clean_folder(top, "pivotrl", uid, job)]
    finally:
        os.close(top)


def _remove_job_files(fd: int, uid: int, prefix: str) -> list[str]:
    removed = []
    for entry in sorted(os.listdir(fd)):
        if not entry.startswith(prefix):
            continue
        try:
            est = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if est.st_uid == uid and (stat.S_ISREG(est.st_mode) or stat.S_ISLNK(est.st_mode)):
                os.unlink(entry, dir_fd=fd)
                removed.append(entry)
        except FileNotFoundError:
            pass
    return removed


def _remove_folder(top: int, name: str, fd: int, st: os.stat_result) -> None:
    """rmdir the folder once empty, unless a live agent holds its flock (shmdir.hold)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = os.stat(name, dir_fd=top, follow_symlinks=False)
        if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            os.rmdir(name, dir_fd=top)
    except OSError:   # held (BlockingIOError), not empty, or gone: it stays
        pass


def main(argv: list[str]) -> int:
    job, uid = argv
    if not uid.isdigit() or not job or not all(c.isalnum() or c in "_." for c in job):
        return 0   # never a name from odd input
    shm = os.environ.get(SHM_DIR_ENV) or None
    found = clean(shm or "/dev/shm", int(uid), job)
    if not shm:
        found += run_user_clean(int(uid), job)
    found += tp_clean("/dev/shm", int(uid), job)
    for path in found:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
