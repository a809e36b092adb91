"""One node's versions of one model: segments, ownership under the hybrid layout, recycling.

The node agent owns a `ModelStore` per model. A version's segment is created (or recycled from
a retired version of the same model: its pages are already touched, so writing runs at memory
speed instead of page-fault speed), filled, then published in the control block. Old versions
are released when no reader pins them (see control.py), and freed or recycled once no other
node may still read them (`collect`).
"""
from __future__ import annotations

import json
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from pivotrl_hpc.gps import control
from pivotrl_hpc.gps.layout import hybrid_owner
from pivotrl_hpc.gps.plan import Range, merge_ranges
from pivotrl_hpc.gps.hf import hf_header
from pivotrl_hpc.gps.segment import SHM_DIR, Header, Segment, segment_name

log = logging.getLogger(__name__)


@dataclass
class Ownership:
    """Hybrid layout (appendix B.1): node i holds tensors whose owner == i % group_size."""
    group_size: int                 # nodes of a replication group (k of appendix B.1)
    n_nodes: int
    owner: dict[str, int]

    def holders(self, name: str) -> list[int]:
        return [i for i in range(self.n_nodes) if i % self.group_size == self.owner[name]]

    def owned(self, node_index: int) -> set[str]:
        return {n for n, o in self.owner.items() if o == node_index % self.group_size}


@dataclass
class ModelStore:
    model: str
    job: str
    node: str
    node_index: int
    header: Header
    ownership: Ownership
    source: dict[str, tuple[Path, int]] = field(default_factory=dict)
    versions: dict[int, Segment] = field(default_factory=dict)
    current: int | None = None
    spare: list[Segment] = field(default_factory=list)
    retiring: set[int] = field(default_factory=set)  # released, memory kept for other nodes

    @classmethod
    def from_folder(cls, model: str, folder: Path, job: str, node: str, node_index: int,
                    n_nodes: int, group_size: int) -> "ModelStore":
        config = (Path(folder) / "config.json").read_text()
        header, where = hf_header(Path(folder), {"model": model, "config": json.dumps(
            json.loads(config), separators=(",", ":"))})
        own = Ownership(group_size, n_nodes,
                        hybrid_owner(list(header.tensors.values()), group_size))
        return cls(model, job, node, node_index, header, own, where)

    @property
    def owned_names(self) -> set[str]:
        return self.ownership.owned(self.node_index)

    def owned_ranges(self, node_index: int | None = None) -> list[Range]:
        i = self.node_index if node_index is None else node_index
        names = self.ownership.owned(i)
        return merge_ranges([(t.start, t.stop) for t in self.header.tensors.values()
                             if t.name in names])

    def owned_bytes(self) -> int:
        return sum(b - a for a, b in self.owned_ranges())

    def path(self, version: int) -> Path:
        return SHM_DIR / segment_name(self.job, self.node, self.model, version)

    def new_version(self, version: int) -> Segment:
        """A segment for `version`: a recycled spare renamed into place, or a fresh one."""
        if version in self.versions:
            return self.versions[version]
        path = self.path(version)
        seg = self._valid_spare()
        if seg is not None:
            os.rename(seg.path, path)
            seg.path = path
        else:
            # reserve what this node keeps (all of it, but under the hybrid layout)
            seg = Segment.create(path, self.header, self.owned_ranges()
                                 if self.ownership.group_size > 1 else None)
        self.versions[version] = seg
        return seg

    def _valid_spare(self) -> Segment | None:
        """A spare still whole: the user's own processes can truncate or replace the file
        under its name, and a mapping of a truncated file is a SIGBUS at the first store."""
        while self.spare:
            seg = self.spare.pop()
            try:
                st, named = os.fstat(seg.fd), os.lstat(seg.path)
                held = st.st_blocks * 512
            except OSError:
                st = named = None
            if st is not None and (st.st_ino, st.st_dev) == (named.st_ino, named.st_dev) \
                    and st.st_size == self.header.total_bytes and held >= self.owned_bytes():
                return seg
            log.warning("GPS spare %s of %s was changed outside the agent (%s): not reused",
                        seg.path.name, self.model, "gone" if st is None else
                        f"{st.st_size} bytes, {held} held; want {self.header.total_bytes}")
            _dispose(seg, unlink=st is not None and (st.st_ino == named.st_ino))
        return None

    def live(self) -> tuple[int, ...]:
        return tuple(sorted(v for v in self.versions if self.current is not None
                            and v <= self.current and v not in self.retiring))

    def publish(self, ctl: control.ControlBlock, version: int) -> None:
        """Make `version` current on this node."""
        self.current = version if self.current is None else max(self.current, version)
        ctl.publish(self.model, self.current, self.live())

    def drop_unowned(self, version: int) -> None:
        """Hybrid layout, once every node has the version: free the tensors others hold."""
        if self.ownership.group_size > 1 and version in self.versions:
            self._drop_unowned(self.versions[version])

    def collect(self, ctl: control.ControlBlock, keep_spare: int = 1, on_retire=None,
                freeable=None) -> list[int]:
        """Retire every old version no local reader pins; return the versions released now.

        Retiring has two steps. *Release* takes the version off the live list (under the
        segment's exclusive lock, so no pin holds it and none can take it after: `pin`
        re-checks the list under its shared lock). *Free* recycles or unlinks its memory,
        once `freeable(v)` (default: at once). Under the hybrid layout readers on other
        nodes fetch this node's tensors of versions *they* pin, unseen by this node's
        locks, so the agent frees a version only when every node of the job has released
        it (issue 11.9). `on_retire(version)` runs before the memory goes (NIXL
        deregistration)."""
        released = []
        for v in sorted(self.versions):
            if self.current is None or v >= self.current or v in self.retiring:
                continue
            seg = self.versions[v]
            if not control.try_lock_exclusive(seg.fd):
                continue  # pinned by a reader: try again later
            try:
                self.retiring.add(v)
                ctl.publish(self.model, self.current, self.live())
            finally:
                control.unlock(seg.fd)
            released.append(v)
        for v in sorted(self.retiring):
            if freeable is None or freeable(v):
                if on_retire is not None:
                    on_retire(v)
                self._free(v, keep_spare)
        return released

    def _free(self, v: int, keep_spare: int) -> None:
        if len(self.spare) >= keep_spare:
            self.drop(v)
            return
        seg = self.versions.pop(v)
        self.retiring.discard(v)
        spare_path = SHM_DIR / (self.path(v).name + ".spare")
        os.rename(seg.path, spare_path)
        seg.path = spare_path
        self.spare.append(seg)

    def drop(self, v: int) -> None:
        """Unlink version `v` (retired, or a Write that failed here)."""
        self.retiring.discard(v)
        _dispose(self.versions.pop(v), unlink=True)

    def _drop_unowned(self, seg: Segment) -> None:
        """Punch out pages of tensors another node of the group holds (tmpfs frees them)."""
        page = mmap.PAGESIZE
        owned = self.owned_ranges()
        base = seg.header.data_start
        pos = 0
        for a, b in owned + [(self.header.total_bytes - base, 0)]:
            lo = -(-(base + pos) // page) * page
            hi = (base + a) // page * page
            if hi > lo:
                seg.mm.madvise(mmap.MADV_REMOVE, lo, hi - lo)
            pos = max(pos, b)

    def close(self, unlink: bool = True) -> None:
        for seg in list(self.versions.values()) + self.spare:
            _dispose(seg, unlink)
        self.versions.clear()
        self.spare.clear()


def _dispose(seg: Segment, unlink: bool) -> None:
    """Close a segment of this store (its fd and mapping), unlinking its file if asked."""
    if unlink:
        seg.path.unlink(missing_ok=True)
    if seg.fd is not None:
        os.close(seg.fd)
        seg.fd = None
    seg.close()
