"""Host-memory facts both engines need on CPU, where a "device" frees into the host heap."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def trim_host_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise, so RSS would not drop
    and the next role's process would not see the memory a shift down freed)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "malloc_trim"):  # not glibc: nothing to trim
        log.debug("malloc_trim unavailable")
        return
    libc.malloc_trim(0)


def _status_bytes(key: str, pid: int | str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not found in /proc/{pid}/status")


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS from /proc/self/status)."""
    return _status_bytes("VmRSS", "self")


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident set size (VmHWM) of a live process: this one or a child."""
    return _status_bytes("VmHWM", pid)
