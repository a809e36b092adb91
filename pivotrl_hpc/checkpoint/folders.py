"""Run folders another account cannot plant in (issue 46).

A run's files sit beside its trace (`out/x.h5`, `out/x.config.json`, `out/x.logs/`,
`out/x.checkpoints/`), often under a shared, sticky directory such as /tmp or a group scratch.
Whoever makes such a folder first can plant what the job later reads (a checkpoint it resumes
from, a "previous job" marker it sweeps by) or a symlink it writes through. So before any work:

- every level of the path is opened with O_NOFOLLOW | O_DIRECTORY relative to the one above
  (a symlink is followed only when root or the user owns it: the user put it there); a level
  owned by another account, or writable by group or others without the sticky bit, is refused;
- the run folder and its `.logs` / `.checkpoints` folders must be the user's own and writable
  by no one else. `trace.group_shared: true` is the explicit opt-in for a group-shared folder
  (group-writable allowed; files are still opened without following links and what is read
  back is still checked, owner included, by the callers);
- a refusal is one line naming the folder, its owner and mode, and the fix (exit 2);
- run files are written to a fresh temp file (O_EXCL | O_NOFOLLOW) and renamed into place,
  both under the folder's descriptor: a planted symlink of that name is replaced, not followed;
- every file and folder made here gets its mode set explicitly, whatever the umask: 0600 and
  0700, or 0640 and 0750 with `trace.group_shared` (`file_mode`, `folder_mode`);
- a control file another process leaves for the job (`read_own`) is opened O_NONBLOCK |
  O_NOFOLLOW and used only when fstat says it is a regular file of this user (a FIFO never
  blocks the reader).
"""
from __future__ import annotations

import logging
import os
import pwd
import secrets
import stat
from pathlib import Path
from typing import Callable

from pivotrl_hpc.checkpoint.layout import CheckpointError, root_for

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40
log = logging.getLogger(__name__)


def file_mode(group_shared: bool = False) -> int:
    """A run file's mode: the user's alone, or also readable by a shared folder's group."""
    return 0o640 if group_shared else 0o600


def folder_mode(group_shared: bool = False) -> int:
    return 0o750 if group_shared else 0o700


class RunFolderError(CheckpointError):
    """A run folder another account owns or could write into."""
    exit_code = 2   # bad input: the launchers end with 2 (launch/entry.py)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def _kind(st: os.stat_result) -> str:
    return ("a symlink" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a file" if stat.S_ISREG(st.st_mode)
            else "a special file")


def _refuse(path: str, st: os.stat_result, why: str) -> RunFolderError:
    kind = _kind(st)
    return RunFolderError(
        f"{path} is {kind} of uid {st.st_uid} ({_user(st.st_uid)}) with mode "
        f"{stat.S_IMODE(st.st_mode):o}: {why}; another account could plant the run's files "
        "there. Fix: put trace.path in a folder of your own (chmod go-w), or set "
        "trace.group_shared=true for a folder your group shares on purpose")


def _check_level(path: str, st: os.stat_result, own: bool, group_shared: bool) -> None:
    """`own`: a run folder (the user's, writable by no one else); else a folder above one
    (root's or the user's; writable by others only with the sticky bit, as /tmp)."""
    uid = os.getuid()
    mode = st.st_mode
    if own and st.st_uid != uid:
        raise _refuse(path, st, f"not a folder of uid {uid} ({_user(uid)})")
    if not own and st.st_uid not in (0, uid) and not group_shared:
        raise _refuse(path, st, "a folder above the run's owned by another account")
    writable = stat.S_IWOTH | (0 if group_shared else stat.S_IWGRP)
    if mode & writable and (own or not mode & stat.S_ISVTX):
        raise _refuse(path, st, "writable by " + ("others" if mode & stat.S_IWOTH else "its group"))


def open_folder(path: str | os.PathLike, *, own: int = 1, create: bool = False,
                group_shared: bool = False) -> int:
    """The folder `path` opened level by level without following links, each checked: its
    last `own` levels are run folders (the user's own), the ones above them root's or the
    user's (`_check_level`). `create`: missing levels are made (`folder_mode` whatever the
    umask; a set-group-ID bit inherited from the level above kept). Returns the descriptor
    (the caller closes it). RunFolderError, or OSError."""
    parts = list(Path(os.path.abspath(path)).parts[1:])
    fd, shown, links, i = os.open("/", _DIR), "/", 0, 0
    made: set[tuple[int, str]] = set()
    try:
        while i < len(parts):
            name, is_own = parts[i], len(parts) - i <= own
            try:
                nxt = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, folder_mode(group_shared), dir_fd=fd)
                    made.add((fd, name))
                except FileExistsError:
                    pass
                continue
            except OSError as e:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise
                if st.st_uid not in (0, os.getuid()) or links >= MAX_LINKS:
                    raise _refuse(os.path.join(shown, name), st,
                                  "a symlink where a folder was expected") from e
                links += 1
                target = os.readlink(name, dir_fd=fd)
                rest = list(Path(target).parts)
                if target.startswith("/"):   # from the top again, the levels above dropped
                    os.close(fd)
                    fd, shown, parts, i = os.open("/", _DIR), "/", rest[1:] + parts[i + 1:], 0
                else:
                    parts[i:i + 1] = rest
                continue
            shown = os.path.join(shown, name)
            try:
                if (fd, name) in made:
                    os.fchmod(nxt, folder_mode(group_shared)
                              | os.fstat(nxt).st_mode & stat.S_ISGID)
                _check_level(shown, os.fstat(nxt), is_own, group_shared)
            except BaseException:
                os.close(nxt)
                raise
            os.close(fd)
            fd, i = nxt, i + 1
        return fd
    except BaseException:
        os.close(fd)
        raise


def run_folders(trace: str | os.PathLike) -> tuple[Path, Path, Path]:
    """The run folder and its logs and checkpoints folders."""
    trace = Path(os.path.abspath(trace))
    return trace.parent, trace.with_suffix(".logs"), root_for(trace)


def check_run(trace: str | os.PathLike, group_shared: bool = False,
              create: bool = False) -> None:
    """Check (and with `create`, make) the run folder of `trace` and its logs folder, and
    the checkpoints folder where it exists; RunFolderError naming the first that fails.
    Without `create` a missing folder is fine (the launch makes it) if the levels above it
    are safe."""
    run, logs, ckpts = run_folders(trace)
    for folder, own in ((run, 1), (logs, 2), (ckpts, 2)):
        if not os.path.lexists(folder) and not (create and folder != ckpts):
            if folder == run:
                _check_existing_above(run, group_shared)
                return
            continue
        os.close(open_folder(folder, own=own, create=create, group_shared=group_shared))


def _check_existing_above(run: Path, group_shared: bool) -> None:
    """The deepest existing folder above a run folder still to be made: a safe place for it."""
    above = run.parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    os.close(open_folder(above, own=0, group_shared=group_shared))


def write_text(folder: str | os.PathLike, name: str, text: str, group_shared: bool = False,
               own: int = 1) -> None:
    """`text` into `folder/name`: a fresh temp file, fsynced, renamed over `name`, all under
    the folder's descriptor (a symlink named `name` is replaced, never followed); its mode
    `file_mode(group_shared)`."""
    fd = open_folder(folder, own=own, group_shared=group_shared)
    try:
        write_at(fd, name, text, file_mode(group_shared))
    finally:
        os.close(fd)


def temp_at(dir_fd: int, name: str, mode: int = 0o600, flags: int = os.O_WRONLY) -> tuple[int, str]:
    """A fresh file of the folder under a temp name beside `name` (O_EXCL | O_NOFOLLOW: never
    anything that was there), set to `mode` whatever the umask: (descriptor, temp name)."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, _NEW | flags, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        _unlink_quietly(dir_fd, tmp)
        raise
    return fd, tmp


def place_at(dir_fd: int, tmp: str, name: str) -> None:
    """Rename the temp file `tmp` over `name` (a planted link, FIFO or file of that name is
    replaced, never opened); the temp file removed if that fails."""
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _unlink_quietly(dir_fd, tmp)
        raise


def create_at(dir_fd: int, name: str, mode: int = 0o600,
              flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """A fresh, empty regular file `name` of the folder, open for writing (a log): made under
    a temp name and renamed into place (`temp_at`, `place_at`). The caller closes it."""
    fd, tmp = temp_at(dir_fd, name, mode, flags)
    try:
        place_at(dir_fd, tmp, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_in(folder: str | os.PathLike, name: str, group_shared: bool = False,
              own: int = 1) -> int:
    """`create_at` in `folder`, opened and checked as `open_folder` does, with
    `file_mode(group_shared)`."""
    dir_fd = open_folder(folder, own=own, group_shared=group_shared)
    try:
        return create_at(dir_fd, name, file_mode(group_shared))
    finally:
        os.close(dir_fd)


def new_folder_at(dir_fd: int, name: str, group_shared: bool = False) -> int | None:
    """A fresh folder `name` of the folder (never one that was there: None then), set to
    `folder_mode` whatever the umask, opened without following links: its descriptor (the
    caller closes it)."""
    try:
        os.mkdir(name, folder_mode(group_shared), dir_fd=dir_fd)
    except FileExistsError:
        return None
    fd = os.open(name, _DIR, dir_fd=dir_fd)
    os.fchmod(fd, folder_mode(group_shared))
    return fd


def write_at(dir_fd: int, name: str, text: str | bytes, mode: int = 0o600) -> None:
    fd, tmp = temp_at(dir_fd, name, mode)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        _unlink_quietly(dir_fd, tmp)
        raise
    place_at(dir_fd, tmp, name)


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def read_own(dir_fd: int, name: str, limit: int = 1 << 16) -> str | None:
    """A small file of the folder, opened without following links and without blocking (a
    FIFO is opened but never read), if it is a regular file of this user (None when missing,
    a link, a FIFO or another non-regular file, another account's, or larger than `limit`)."""
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                    dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(f, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > limit:
            return None
        return fh.read(limit).decode(errors="replace")


def take_own(folder: str | os.PathLike, name: str, *, own: int = 2,
             group_shared: bool = True) -> str | None:
    """A control file another process of this user leaves in `folder` (a request, a marker):
    its text if it is a regular file of this user (`read_own`), None when there is none. It
    is removed either way; one that is not the user's regular file is ignored with a warning
    naming it, owner and kind (a planted FIFO, link or file of another account)."""
    try:
        dir_fd = open_folder(folder, own=own, group_shared=group_shared)
    except FileNotFoundError:
        return None
    try:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        text = read_own(dir_fd, name)
        _unlink_quietly(dir_fd, name)
        if text is None:
            log.warning("ignored %s: %s of uid %d (%s), not a regular file of this user",
                        os.path.join(folder, name), _kind(st), st.st_uid, _user(st.st_uid))
        return text
    finally:
        os.close(dir_fd)


def write_by_path(dir_fd: int, name: str, mode: int, write: Callable[[str], None]) -> None:
    """For a library that writes only to a path (safetensors): `write(path)` with the path
    through the folder's descriptor (/proc/self/fd/N/name: no link above it followed), in a
    folder of this user no other account can write (checked: nothing can be planted in it);
    the file is then checked to be a regular file of this user, set to `mode` whatever the
    umask, and fsynced."""
    st = os.fstat(dir_fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise _refuse(f"/proc/self/fd/{dir_fd}", st, "a folder to write into must be "
                      "the user's own and writable by no one else")
    write(f"/proc/self/fd/{dir_fd}/{name}")
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise _refuse(name, st, "not the regular file just written")
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
