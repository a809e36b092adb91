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
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pivotrl_hpc.gps.layout import TensorInfo

log = logging.getLogger(__name__)

SHM_DIR = Path(os.environ.get("PIVOTRL_SHM_DIR", "/dev/shm"))
_ALIGN = 4096  # data start on a page boundary: tensors then start where safetensors puts them
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAME_PART = re.compile(r"^[A-Za-z0-9_.]+$")


class GPSMemoryError(MemoryError):
    """Not enough shared or host memory for what the GPS is asked to hold."""


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
    def parse(cls, buf) -> "Header":
        (n,) = struct.unpack_from("<Q", buf, 0)
        body = json.loads(bytes(buf[8:8 + n]))
        meta = body.pop("__metadata__", {}) or {}
        tensors = {k: TensorInfo(k, v["dtype"], tuple(v["shape"]), *v["data_offsets"])
                   for k, v in body.items()}
        tensors = dict(sorted(tensors.items(), key=lambda kv: kv[1].start))
        return cls(tensors, 8 + n, meta)


class Segment:
    """An mmap of one segment file; tensors are zero-copy views of the mapping."""

    def __init__(self, path: Path, mm: mmap.mmap, header: Header, fd: int | None = None):
        self.path, self.mm, self.header, self.fd = path, mm, header, fd
        self._u8 = np.frombuffer(mm, dtype=np.uint8)

    @classmethod
    def create(cls, path: Path, header: Header) -> "Segment":
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, header.total_bytes)
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
        return cls(path, mm, Header.parse(mm), None)

    @property
    def address(self) -> int:
        return self._u8.ctypes.data

    def bytes_view(self, start: int, stop: int) -> np.ndarray:
        """uint8 view of data bytes [start, stop) (offsets relative to the data start)."""
        d = self.header.data_start
        return self._u8[d + start: d + stop]

    def tensor(self, name: str) -> torch.Tensor:
        t = self.header.tensors[name]
        raw = self.bytes_view(t.start, t.stop)
        with _quiet_readonly():
            flat = torch.frombuffer(raw, dtype=DTYPES[t.dtype]) if t.nbytes else torch.empty(
                0, dtype=DTYPES[t.dtype])
        return flat.view(t.shape)

    def close(self) -> None:
        self._u8 = None
        try:
            self.mm.close()
        except BufferError:  # views still alive: the mapping goes when they do
            log.debug("segment %s still has live views", self.path)


class RawMap:
    """A writable mapping of a headerless file (a reader's staging buffer)."""

    def __init__(self, path: Path):
        fd = os.open(path, os.O_RDWR)
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


def hf_header(folder: Path, metadata: dict[str, str]) -> tuple[Header, dict[str, tuple[Path, int]]]:
    """Canonical header of an HF safetensors folder, and name -> (file, absolute offset)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    specs, where = [], {}
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            (n,) = struct.unpack("<Q", head)
            src = Header.parse(head + fh.read(n))
        for t in src.tensors.values():
            specs.append((t.name, t.dtype, t.shape))
            where[t.name] = (f, src.data_start + t.start)
    return Header.build(specs, metadata), where


def load_into(seg: Segment, where: dict[str, tuple[Path, int]], names: set[str] | None = None,
              threads: int = 4) -> int:
    """Read tensors from their safetensors files straight into the segment, in parallel."""
    todo = [t for t in seg.header.tensors.values() if names is None or t.name in names]

    def one(t: TensorInfo) -> int:
        path, off = where[t.name]
        dst = memoryview(seg.bytes_view(t.start, t.stop))
        with open(path, "rb", buffering=0) as fh:
            fh.seek(off)
            got = 0
            while got < t.nbytes:
                n = fh.readinto(dst[got:])
                if not n:
                    raise IOError(f"{path} ends inside {t.name}")
                got += n
        return t.nbytes

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(one, todo))


def memory_available() -> tuple[int, int]:
    """(free bytes in the shm filesystem, MemAvailable bytes of the host)."""
    st = os.statvfs(SHM_DIR)
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


def sweep(job: str, node: str | None = None) -> list[str]:
    """Remove every segment of `job` (on `node`, or all nodes); return the removed names."""
    prefix = f"pivotrl-{job}-" + (f"{node}-" if node else "")
    removed = []
    for p in SHM_DIR.glob(prefix + "*"):
        try:
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d GPS segments of job %s: %s", len(removed), job, removed)
    return removed


def default_job() -> str:
    """The Slurm job id, else a local run id (PIVOTRL_RUN_ID), else `local`."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("PIVOTRL_RUN_ID") or "local"
    return re.sub(r"[^A-Za-z0-9_.]", "_", job)


def default_node() -> str:
    """The Slurm node name (two fake nodes share one host and one /dev/shm), else the host."""
    import socket
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return re.sub(r"[^A-Za-z0-9_]", "_", node)
