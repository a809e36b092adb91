"""POSIX shared-memory segments holding one (model, version) in the safetensors format.

A segment is a file in /dev/shm named `pivotrl-<job>-<node>-<model>-v<k>`, mode 0600,
containing exactly a safetensors file: 8-byte header length, JSON header (name -> dtype,
shape, data_offsets), then the tensors back to back. So `safetensors.safe_open` can read a
segment as is, and every node computes the same offsets from the same model.

Segments are opened with `os.open` + `mmap` (not `multiprocessing.SharedMemory`, whose
resource tracker unlinks segments when an attaching process exits). Under the hybrid layout a
node writes only the tensors it owns; tmpfs files are sparse, so untouched tensors cost no
memory.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pivotrl_hpc import envs
from pivotrl_hpc.gps import device
from pivotrl_hpc.gps.layout import TensorInfo
from pivotrl_hpc.gps.shmdir import ROOT as SHM_ROOT
from pivotrl_hpc.gps.shmdir import SHM_DIR, GPSMemoryError, reserve_file

log = logging.getLogger(__name__)

_ALIGN = 4096  # data start on a page boundary: tensors then start where safetensors puts them
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAME_PART = re.compile(r"^[A-Za-z0-9_.]+$")


MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit
MAX_HEADER_DEPTH = 8           # a safetensors header nests 3 deep: {name: {shape: [...]}}
_JSON_NESTING = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')   # strings skipped whole


class SegmentError(ValueError):
    """A segment or safetensors file whose header is malformed; names the file and tensor."""


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def segment_prefix(job: str, node: str) -> str:
    for part in (job, node):
        if not _NAME_PART.match(part):
            raise ValueError(f"job and node names must match {_NAME_PART.pattern}: {part!r}")
    return f"pivotrl-{job}-{node}-"


def segment_name(job: str, node: str, model: str, version: int) -> str:
    if not _NAME_PART.match(model):
        raise ValueError(f"model name must match {_NAME_PART.pattern}: {model!r}")
    return f"{segment_prefix(job, node)}{model}-v{version}"


@dataclass(frozen=True)
class Header:
    """The parsed header: tensors in data order, the data start, and free-form metadata."""
    tensors: dict[str, TensorInfo]
    data_start: int
    metadata: dict[str, str]

    @property
    def total_bytes(self) -> int:
        return self.data_start + max((t.stop for t in self.tensors.values()), default=0)

    def encode(self) -> bytes:
        body: dict = {"__metadata__": self.metadata}
        for t in self.tensors.values():
            body[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                            "data_offsets": [t.start, t.stop]}
        raw = json.dumps(body, separators=(",", ":")).encode()
        pad = self.data_start - 8 - len(raw)
        if pad < 0:
            raise ValueError("header larger than its reserved space")
        return struct.pack("<Q", len(raw) + pad) + raw + b" " * pad

    @classmethod
    def build(cls, specs: list[tuple[str, str, tuple[int, ...]]],
              metadata: dict[str, str]) -> "Header":
        """Lay out (name, dtype, shape) back to back in the given order."""
        tensors: dict[str, TensorInfo] = {}
        off = 0
        for name, dtype, shape in specs:
            n = itemsize(dtype)
            for d in shape:
                n *= d
            tensors[name] = TensorInfo(name, dtype, tuple(shape), off, off + n)
            off += n
        probe = cls(tensors, 0, metadata)
        raw_len = len(json.dumps({"__metadata__": metadata, **{
            t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.start, t.stop]}
            for t in tensors.values()}}, separators=(",", ":")).encode())
        start = -(-(8 + raw_len) // _ALIGN) * _ALIGN
        return cls(probe.tensors, start, metadata)

    @classmethod
    def parse(cls, buf, size: int | None = None, where: str = "segment") -> "Header":
        """Parse and validate a safetensors header. `size`: the file's bytes (default: the
        buffer's). Anything off raises SegmentError naming `where` and the tensor."""
        size = len(buf) if size is None else size
        if size < 8:
            raise SegmentError(f"{where}: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack_from("<Q", buf, 0)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise SegmentError(f"{where}: header length {n} exceeds the file ({size} bytes)")
        raw = bytes(buf[8:8 + n])
        _check_depth(raw, where)   # json.loads recurses: deep nesting is a RecursionError
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise SegmentError(f"{where}: header is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise SegmentError(f"{where}: header is not a JSON object")
        meta = body.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise SegmentError(f"{where}: __metadata__ must map names to strings")
        tensors = sorted((_tensor_info(where, k, v) for k, v in body.items()),
                         key=lambda t: (t.start, t.stop))
        end = 0
        for t in tensors:
            if t.start < end:
                raise SegmentError(f"{where}: tensor {t.name!r} overlaps the one before it "
                                   f"(starts at {t.start}, previous ends at {end})")
            end = t.stop
        if 8 + n + end > size:
            raise SegmentError(f"{where}: tensors end at {8 + n + end} but the file has "
                               f"{size} bytes")
        return cls({t.name: t for t in tensors}, 8 + n, meta)


def _check_depth(raw: bytes, where: str) -> None:
    depth = 0
    for m in _JSON_NESTING.finditer(raw):
        c = m.group()[0]
        if c in b"[{":
            depth += 1
            if depth > MAX_HEADER_DEPTH:
                raise SegmentError(f"{where}: header nests deeper than {MAX_HEADER_DEPTH} "
                                   "levels: not a safetensors header")
        elif c in b"]}":
            depth -= 1


def _tensor_info(where: str, name: str, v) -> TensorInfo:
    bad = f"{where}: tensor {name!r}"
    if not isinstance(v, dict):
        raise SegmentError(f"{bad}: entry is not an object")
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SegmentError(f"{bad}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 48
                                              for d in shape):
        raise SegmentError(f"{bad}: shape {shape!r} must be a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            type(o) is int and 0 <= o < 1 << 62 for o in offsets) and offsets[0] <= offsets[1]):
        raise SegmentError(f"{bad}: data_offsets {offsets!r} must be [start, stop], "
                           "0 <= start <= stop")
    want = itemsize(dtype)
    for d in shape:
        want *= d
    if offsets[1] - offsets[0] != want:
        raise SegmentError(f"{bad}: {offsets[1] - offsets[0]} bytes for shape {shape} of "
                           f"{dtype} ({want} bytes)")
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


class Segment:
    """An mmap of one segment file; tensors are zero-copy views of the mapping."""

    def __init__(self, path: Path, mm: mmap.mmap, header: Header, fd: int | None = None):
        self.path, self.mm, self.header, self.fd = path, mm, header, fd
        self._u8 = np.frombuffer(mm, dtype=np.uint8)
        self._registered: int | None = None   # address page-locked for device copies
        self._views: dict[str, torch.Tensor] = {}   # per tensor: ~25 us each to make

    @classmethod
    def create(cls, path: Path, header: Header,
               reserve: list[tuple[int, int]] | None = None) -> "Segment":
        """A new segment file. Its header page and the data ranges `reserve` (default: all)
        are allocated now (posix_fallocate): a full /dev/shm fails here, with how much is
        missing, instead of a SIGBUS at the first store into a hole later."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, header.total_bytes)
            data = header.total_bytes - header.data_start
            _reserve_data(fd, path, header, [(-header.data_start, 0),
                                             *(reserve if reserve is not None else [(0, data)])])
            mm = mmap.mmap(fd, header.total_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        mm[: header.data_start] = header.encode()
        return cls(path, mm, header, fd)

    @classmethod
    def attach(cls, path: Path, fd: int | None = None, writable: bool = False,
               populate: bool = True) -> "Segment":
        """Map an existing segment; the descriptor, if given, stays the caller's.

        Never populate a sparse (hybrid-layout) segment: touching its holes, even to read,
        makes tmpfs allocate them and the node would hold the whole model after all."""
        own = fd is None
        if own:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # MAP_POPULATE maps every page up front, in the kernel, instead of one minor
            # fault per 4 KiB page on first touch: ~2x on a cold Read of a large model.
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=prot)
        finally:
            if own:
                os.close(fd)
        try:
            header = Header.parse(mm, size, str(path))
        except SegmentError:
            mm.close()
            raise
        return cls(path, mm, header, None)

    def reserve(self, fd: int, ranges: list[tuple[int, int]]) -> None:
        """Allocate data ranges [a, b) of this segment (open as `fd`) now: a GPSMemoryError
        naming the missing bytes if shm is full."""
        _reserve_data(fd, self.path, self.header, ranges)

    @property
    def address(self) -> int:
        return self._u8.ctypes.data

    def bytes_view(self, start: int, stop: int) -> np.ndarray:
        """uint8 view of data bytes [start, stop) (offsets relative to the data start)."""
        d = self.header.data_start
        return self._u8[d + start: d + stop]

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name`, a view of the mapping, made once (a client Reads a kept mapping)."""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = self._view(name)
        return view

    def _view(self, name: str) -> torch.Tensor:
        t = self.header.tensors[name]
        raw = self.bytes_view(t.start, t.stop)
        with _quiet_readonly():
            flat = torch.frombuffer(raw, dtype=DTYPES[t.dtype]) if t.nbytes else torch.empty(
                0, dtype=DTYPES[t.dtype])
        return flat.view(t.shape)

    def register_device(self, writable: bool) -> bool:
        """Page-lock the mapping for DMA to and from the GPU, once (gps/device.py)."""
        if self._registered is None:
            if device.register(self.address, len(self.mm), writable=writable):
                self._registered = self.address
        return self._registered is not None

    def close(self) -> None:
        if self._registered is not None:   # before the unmap: the driver holds its pages
            device.unregister(self._registered)
            self._registered = None
        self._views.clear()
        self._u8 = None
        try:
            self.mm.close()
        except BufferError:  # views still alive: the mapping goes when they do
            log.debug("segment %s still has live views", self.path)


def staging_prefix(job: str, node: str) -> str:
    """Staging files of a hybrid-layout Read: `<prefix>stage-<pid>-<random>` (issue 11.3)."""
    return segment_prefix(job, node) + "stage-"


def open_own(path: Path, flags: int, dir_fd: int | None = None) -> int:
    """Open a file of this user only: no symlink followed, a regular file, owned by us. With
    `dir_fd` (the GPS folder's descriptor), `path.name` is opened in that folder (openat)."""
    if dir_fd is not None:
        fd = os.open(path.name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    else:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file of uid {os.getuid()} "
                              f"(uid {st.st_uid}, mode {st.st_mode:o}): refused")
    return fd


def _reserve_data(fd: int, path: Path, header: Header, ranges) -> None:
    """reserve_file for data ranges [a, b) (relative to the data start; a < 0 is header)."""
    for a, b in ranges:
        if b > a:
            reserve_file(fd, path, header.data_start + a, b - a)


class RawMap:
    """A writable mapping of a headerless file (a reader's staging buffer)."""

    def __init__(self, path: Path):
        fd = open_own(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self._u8 = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        self._u8 = None
        self.mm.close()


class _quiet_readonly:
    """torch.frombuffer warns on read-only buffers; readers never write through these views."""

    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", message="The given buffer is not writable")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def memory_available() -> tuple[int, int]:
    """(free bytes in the shm filesystem, MemAvailable bytes of the host)."""
    st = os.statvfs(SHM_ROOT)
    shm = st.f_bavail * st.f_frsize
    host = shm
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    return shm, host


def check_memory(needed: int, what: str) -> None:
    shm, host = memory_available()
    avail = min(shm, host)
    if needed > avail:
        raise GPSMemoryError(
            f"GPS needs {needed} bytes ({needed / 2**30:.2f} GiB) of shared memory for {what}, "
            f"but only {avail} bytes ({avail / 2**30:.2f} GiB) are available "
            f"({SHM_DIR}: {shm} bytes free, host MemAvailable: {host} bytes)")


class AgentAliveError(RuntimeError):
    """The files belong to an agent that is still running: not swept."""


def sweep(job: str, node: str | None = None) -> list[str]:
    """Remove every segment of `job` (on `node`, or all nodes) that this user owns; return
    the removed names. Refuses (AgentAliveError) while another process's agent still serves
    one of those nodes: a second run with the same id must not delete the first one's."""
    from pivotrl_hpc.gps.control import live_agent

    prefix = f"pivotrl-{job}-" + (f"{node}-" if node else "")
    for ctl in SHM_DIR.glob(prefix + "*ctl"):
        pid = live_agent(ctl)
        if pid is not None:
            raise AgentAliveError(f"GPS agent pid {pid} still serves {ctl.name}: not removing "
                                  f"its segments (a second run with job id {job!r}?)")
    removed, uid = [], os.getuid()
    for p in SHM_DIR.glob(prefix + "*"):
        try:
            if p.lstat().st_uid != uid:
                continue   # another user's file: neither ours to delete nor fatal
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d GPS segments of job %s: %s", len(removed), job, removed)
    return removed


def default_job() -> str | None:
    """The Slurm job id, else a local run id (PIVOTRL_RUN_ID), else None (no job known)."""
    job = envs.SLURM_JOB_ID.raw() or envs.RUN_ID.raw()
    return re.sub(r"[^A-Za-z0-9_.]", "_", job) if job else None


def default_node() -> str:
    """The Slurm node name (two fake nodes share one host and one /dev/shm), else the host."""
    import socket
    node = envs.SLURMD_NODENAME.raw() or socket.gethostname().split(".")[0]
    return re.sub(r"[^A-Za-z0-9_]", "_", node)
