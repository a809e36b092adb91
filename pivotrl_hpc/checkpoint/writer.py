"""Writing a checkpoint (checkpoint.layout says the folder): its staging folder, the
controller's state file and the commit that makes it whole, with modes set whatever the
umask (checkpoint.folders) and COMPLETE holding the manifest of its files
(checkpoint.manifest)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pivotrl_hpc.checkpoint.folders import file_mode, open_folder, write_at
from pivotrl_hpc.checkpoint.layout import FORMAT, MARK, OPTIM, STATE, name, prunable
from pivotrl_hpc.checkpoint.manifest import build


def staging(root: Path, step: int, group_shared: bool = False) -> Path:
    """A fresh folder to write checkpoint `step` into (an older attempt's leftovers go): it,
    its `optim/` and the checkpoints folder made with `folders.folder_mode` whatever the
    umask, each level opened without following links and checked (checkpoint.folders)."""
    root = Path(os.path.abspath(root))
    tmp = root / f".{name(step)}.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    elif tmp.exists():
        shutil.rmtree(tmp)
    os.close(open_folder(tmp / OPTIM, own=3, create=True, group_shared=group_shared))
    return tmp


def write_state(folder: Path, state: dict[str, Any], group_shared: bool = False) -> None:
    _write_new(folder, STATE, json.dumps({"format": FORMAT, **state}, indent=1) + "\n",
               group_shared)


def commit(tmp: Path, keep: int, digests: dict[str, Any] | None = None,
           group_shared: bool = False) -> Path:
    """Make the checkpoint in `tmp` whole: fsync its files, write COMPLETE holding their
    manifest (checkpoint.manifest; `digests`: the entries the ranks sent for their files),
    rename it into place; then drop all but the newest `keep` whole ones and stale `.tmp`
    folders."""
    _write_new(tmp, MARK, json.dumps(build(tmp, digests)) + "\n", group_shared)
    final = tmp.parent / tmp.name[1:].removesuffix(".tmp")
    if final.exists():          # a requeued job that redid this step: the new one wins
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(tmp.parent)
    for old in prunable(final, keep):
        shutil.rmtree(old, ignore_errors=True)
    for stale in tmp.parent.glob(".step-*.tmp"):
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _write_new(folder: Path, name: str, text: str, group_shared: bool) -> None:
    """`text` as file `name` of checkpoint folder `folder` (opened and checked level by
    level, the file made O_EXCL | O_NOFOLLOW with `folders.file_mode`, fsynced)."""
    fd = open_folder(folder, own=2, group_shared=group_shared)
    try:
        write_at(fd, name, text, file_mode(group_shared))
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
