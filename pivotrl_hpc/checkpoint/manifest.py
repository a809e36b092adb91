"""A checkpoint's manifest: every file's size and SHA-256, written last, checked at resume.

A checkpoint is the state a resumed job trains on. A group member who could write one of its
files (a umask of 002 in a set-group-ID project folder made them 0664) zeroed every tensor of
the policy and the resume trained on them. The files are now the user's alone (0600 in 0700
folders; 0640 / 0750 with `trace.group_shared`), and what they held when written is recorded:

- `COMPLETE`, the mark that makes a checkpoint whole, holds the manifest: per file of the
  step (policy/, optim/rank-N.safetensors, state.json, ...) its size and SHA-256. A
  safetensors file is hashed per tensor (its header, each tensor's bytes, whatever lies
  between), every byte once, so a changed file is refused naming the tensor that changed;
- the ranks hash what they wrote (in parallel, the page cache hot) and send the entries in
  their replies; the controller hashes the rest, writes state.json, then COMPLETE;
- `verify` runs before a resume (`checkpoint.state.prepare`, rank 0, before any rank loads
  anything) and before an export: every file and folder must be a regular file / folder of
  this user writable by no one else (no link, no FIFO), none missing, none added, every hash
  equal. Anything else is a `ManifestError`, one line naming the file (and tensor).

A checkpoint written before manifests (an empty COMPLETE) is accepted with a warning when
nothing in it is writable by another account (then only the user could have changed it), and
refused otherwise, naming the file and how to proceed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pivotrl_hpc.checkpoint.layout import MARK, CheckpointError

log = logging.getLogger(__name__)

FORMAT = "pivotrl-manifest/1"
CHUNK = 1 << 22
MAX_HEADER = 100 << 20   # safetensors' own bound on a header
MAX_DEPTH = 8            # policy/ and optim/: a checkpoint is two levels deep
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

Entry = dict[str, Any]


class ManifestError(CheckpointError):
    """A checkpoint whose files are not what its manifest says, or could have been changed."""


# ---- hashing ---------------------------------------------------------------------------------
def digest(fd: int) -> Entry:
    """The manifest entry of the open file `fd`: {"bytes", "sha256"}, or for a safetensors
    file {"bytes", "header", "tensors": {name: sha256}, "rest"} (every byte hashed once)."""
    size = os.fstat(fd).st_size
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        layout = _tensor_spans(f, size)
        f.seek(0)
        if layout is None:
            return {"bytes": size, "sha256": _hash(f, size).hexdigest()}
        at, spans = layout
        out: Entry = {"bytes": size, "header": _hash(f, at).hexdigest(), "tensors": {}}
        rest = hashlib.sha256()
        for start, end, name in spans:
            if start > at:               # bytes between tensors (none in what we write)
                rest.update(f.read(start - at))
            out["tensors"][name] = _hash(f, end - start).hexdigest()
            at = end
        rest.update(f.read())
        out["rest"] = rest.hexdigest()
        return out


def _hash(f, n: int) -> "hashlib._Hash":
    h = hashlib.sha256()
    while n > 0:
        chunk = f.read(min(CHUNK, n))
        if not chunk:
            break
        h.update(chunk)
        n -= len(chunk)
    return h


def _tensor_spans(f, size: int) -> tuple[int, list[tuple[int, int, str]]] | None:
    """Where a safetensors file's data starts and its tensors' (start, end, name) in file
    offsets, in order; None when the file is not one (it is then hashed whole)."""
    head = f.read(8)
    if len(head) < 8:
        return None
    n = int.from_bytes(head, "little")
    if n > min(MAX_HEADER, size - 8):
        return None
    try:
        header = json.loads(f.read(n))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    base, spans = 8 + n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= size - base):
            return None
        spans.append((base + offsets[0], base + offsets[1], name))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    return base, spans


# ---- the files of a checkpoint ----------------------------------------------------------------
def _check_mode(where: Path, rel: str, st: os.stat_result) -> None:
    """A file or folder `rel` of checkpoint `where` that only this user can have written."""
    path = where / rel
    kind = "folder" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else None
    mode = stat.S_IMODE(st.st_mode)
    if kind is None:
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ManifestError(f"{path}: {what} (mode {st.st_mode:o}); a checkpoint holds "
                            "regular files and folders only")
    if st.st_uid != os.getuid():
        raise ManifestError(f"{path}: a {kind} of uid {st.st_uid}, not of this user "
                            f"(uid {os.getuid()}): another account could change it")
    if mode & 0o022:
        who = "others" if mode & 0o002 else "its group"
        raise ManifestError(f"{path}: a {kind} with mode {mode:o}, writable by {who}: "
                            "another account could have changed it. If you trust its content "
                            f"(a checkpoint of an older pivotrl): chmod -R go-w {where}; "
                            "else resume=PATH of another checkpoint or resume=false")


class _Files:
    """The files of checkpoint `folder` (relative name -> where): every level opened without
    following links and checked (`_check_mode`); a file is opened, and checked again, only
    when it is hashed, so a checkpoint of any number of ranks holds a few descriptors."""

    def __init__(self, folder: Path):
        self.folder, self.dirs, self.where = folder, [], {}
        try:
            fd = os.open(folder, _DIR)
        except OSError as e:
            raise ManifestError(f"{folder}: not a checkpoint folder ({e.strerror})") from None
        self.dirs.append(fd)
        try:
            _check_mode(folder, "", os.fstat(fd))
            self._walk(fd, "", 0)
        except BaseException:
            self.close()
            raise

    def _walk(self, dir_fd: int, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ManifestError(f"{self.folder / prefix}: folders nested deeper than "
                                f"{MAX_DEPTH}")
        for name in sorted(os.listdir(dir_fd)):
            rel = prefix + name
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            _check_mode(self.folder, rel, st)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _DIR, dir_fd=dir_fd)   # ELOOP: a link swapped in
                self.dirs.append(sub)
                _check_mode(self.folder, rel, os.fstat(sub))
                self._walk(sub, rel + "/", depth + 1)
            else:
                self.where[rel] = (dir_fd, name)

    def open(self, rel: str) -> int:
        dir_fd, name = self.where[rel]
        fd = os.open(name, _FILE, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            _check_mode(self.folder, rel, st)
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError(f"{self.folder / rel}: became a folder while read")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def entry(self, rel: str, given: Entry | None = None, sync: bool = False) -> Entry:
        """Its manifest entry: `given` when its size is the file's, else hashed here."""
        fd = self.open(rel)
        try:
            if sync:
                os.fsync(fd)
            if given is not None and given.get("bytes") == os.fstat(fd).st_size:
                return given
            return digest(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in self.dirs:
            os.close(fd)
        self.dirs = []


def build(folder: Path, given: dict[str, Entry] | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint being written in `folder` (before COMPLETE): the
    entries the ranks sent in `given` (their size checked), the other files hashed here;
    every file fsynced."""
    given = given or {}
    files = _Files(folder)
    try:
        names = [rel for rel in files.where if rel != MARK]
        with ThreadPoolExecutor(_threads(len(names))) as pool:
            entries = dict(zip(names, pool.map(
                lambda rel: files.entry(rel, given.get(rel), sync=True), names)))
    finally:
        files.close()
    return {"format": FORMAT, "files": entries}


def entry_at(dir_fd: int, name: str) -> Entry:
    """The entry of the file `name` a rank just wrote in the folder `dir_fd`."""
    fd = os.open(name, _FILE, dir_fd=dir_fd)
    try:
        return digest(fd)
    finally:
        os.close(fd)


def _threads(n: int) -> int:
    return max(1, min(n, os.cpu_count() or 1, 8))


# ---- at resume ----------------------------------------------------------------------------
def verify(folder: str | os.PathLike) -> int:
    """Check the whole checkpoint `folder` against its manifest (module docstring); returns
    the bytes hashed. ManifestError naming the first file (and tensor) that differs."""
    folder = Path(folder)
    files = _Files(folder)
    try:
        manifest = _read_manifest(folder, files)
        if manifest is None:
            log.warning("%s has no manifest of its files (written before checkpoints had "
                        "one); resuming from it: every file is this user's and writable by no "
                        "one else", folder)
            return 0
        want: dict[str, Entry] = manifest["files"]
        got = set(files.where) - {MARK}
        if missing := sorted(set(want) - got):
            raise ManifestError(f"{folder}: {missing[0]} is missing (the manifest lists it)")
        if extra := sorted(got - set(want)):
            raise ManifestError(f"{folder}: {extra[0]} is not in the manifest (added after "
                                "the checkpoint was written)")
        with ThreadPoolExecutor(_threads(len(want))) as pool:
            found = dict(zip(want, pool.map(files.entry, want)))
    finally:
        files.close()
    for rel in want:
        if (why := _differs(want[rel], found[rel])) is not None:
            raise ManifestError(f"{folder / rel} changed since the checkpoint was written: "
                                f"{why}; resume from another checkpoint (resume=PATH) or start "
                                "afresh (resume=false)")
    return sum(e["bytes"] for e in found.values())


def _read_manifest(folder: Path, files: _Files) -> dict[str, Any] | None:
    """COMPLETE's manifest; None for an empty one (a checkpoint of an older pivotrl)."""
    if MARK not in files.where:
        raise ManifestError(f"{folder}: no {MARK} (not a whole checkpoint)")
    with os.fdopen(files.open(MARK), "rb") as f:
        raw = f.read(MAX_HEADER + 1)
    if not raw.strip():
        return None
    try:
        manifest = json.loads(raw)
    except ValueError:
        manifest = None
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT
            and isinstance(manifest.get("files"), dict)
            and all(isinstance(e, dict) and type(e.get("bytes")) is int
                    and isinstance(e.get("tensors", {}), dict)
                    for e in manifest["files"].values())):
        raise ManifestError(f"{folder / MARK}: not a {FORMAT} manifest")
    return manifest


def _differs(want: Entry, got: Entry) -> str | None:
    """Why the file's entry `got` is not the manifest's `want` (None: equal)."""
    if want == got:
        return None
    if want.get("bytes") != got.get("bytes"):
        return f"{got.get('bytes')} bytes, the manifest says {want.get('bytes')}"
    if "tensors" not in want or "tensors" not in got or want.get("header") != got["header"]:
        return "its bytes differ" if "tensors" not in want else \
            "its safetensors header (names, shapes or offsets) differs"
    changed = [n for n in want["tensors"] if want["tensors"][n] != got["tensors"].get(n)]
    if changed:
        more = f" (and {len(changed) - 1} more of {len(want['tensors'])})" \
            if len(changed) > 1 else ""
        return f"tensor {changed[0]}{more} differs"
    return "bytes between its tensors differ"
