"""Process checks the engine host and forker tests share, read from /proc (a zombie counts as
gone: its parent has not reaped it yet, but it runs nothing)."""
from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_gone(pid: int, seconds: float) -> bool:
    """True once `pid` is gone, False if it still runs after `seconds`."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)
