"""TCP ports for the torch worlds a job builds (trainer, TP engines), chosen outside the
kernel's ephemeral range.

A port found free by binding port 0 is an *ephemeral* port: between the check and the
world's own bind, any outgoing connection on the machine (gloo pairs, vLLM's sockets, MPI) may
be handed the same number, and the world then fails with EADDRINUSE. That happened in CI
once engines stayed alive across shifts. Ports below `ip_local_port_range` are never handed
out that way, so a range checked free there stays free unless someone binds it on purpose.
"""
from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000  # above the well-known and registered services most sites run
STEP = 100


def ephemeral_range() -> tuple[int, int]:
    """The kernel's (low, high) ephemeral ports; Linux's default where /proc does not say."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def port_window() -> tuple[int, int]:
    """Where job ports may lie: [LOWEST, low) below the ephemeral range, or above it when the
    site set the range low (ranges of at least 2000 ports, else the whole unprivileged space)."""
    low, high = ephemeral_range()
    if low - LOWEST >= 2000:
        return LOWEST, low
    if 65535 - high >= 2000:
        return high + 1, 65536
    return 1024, 65536


def aligned_window(step: int) -> tuple[int, int]:
    """`port_window` with its start rounded up to a multiple of `step` (range bases)."""
    start, end = port_window()
    return -(-start // step) * step, end


# Sockets bound on base + 1 of each range this process handed out, kept for its life.
_RESERVED: list[socket.socket] = []


def free_port_base(count: int, tries: int = 50) -> int:
    """A base port with `count` free ports above it (checked by binding each), outside the
    ephemeral range. Its base + 1 (a port no world of the job uses) stays bound by this
    process, the launcher, for its life: two jobs launched at the same moment found the same
    free base, and the second trainer's world failed with EADDRINUSE (CI, side-by-side jobs).
    Another launcher's check of that range now fails on base + 1."""
    first, end = aligned_window(STEP)
    if end - count <= first:
        raise OSError(f"no window of {count} ports between {first} and {end}")
    for _ in range(tries):
        base = random.randrange(first, end - count, STEP)
        if all(port_free(base + i) for i in range(count)) and _reserve(base + 1):
            return base
    raise OSError(f"no range of {count} free TCP ports found between {first} and {end}")


def _reserve(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))   # bound, never listening: nothing can connect to it
    except OSError:
        s.close()
        return False
    _RESERVED.append(s)
    return True


def free_port() -> int:
    """One free port outside the ephemeral range (a one-rank world's MASTER_PORT)."""
    start, end = port_window()
    for _ in range(200):
        port = random.randrange(start, end)
        if port_free(port):
            return port
    raise OSError(f"no free TCP port found between {start} and {end}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
