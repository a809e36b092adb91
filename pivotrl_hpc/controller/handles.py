"""The controller's handle on device workers, and the per-device command queues.

A `WorkerHandle` never blocks: `submit` hands a command over, `poll` returns the replies that
are due now. Live, commands travel over MPI (`controller.mpi_handle`); in simulation, modeled
workers answer at virtual times (`sim.modeled`). `Devices` keeps one command in flight per
device, in FIFO order, so a shift down always precedes the shift up queued after it, and
calls a completion when every device a command went to has answered (a replica may span
several devices: its commands go to all of them, SPMD, and the first device leads).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

from pivotrl_hpc.protocol.messages import Command, Reply


@runtime_checkable
class WorkerHandle(Protocol):
    device: int

    def submit(self, cmd: Command) -> None:
        """Send one command; never blocks."""

    def poll(self) -> list[Reply]:
        """Replies that arrived (in order); never blocks."""

    def next_reply_time(self) -> float | None:
        """When the next reply is due, if the handle knows (simulation); else None."""


OnDone = Callable[[list[Reply]], None]


@dataclass
class _Group:
    """One logical command sent to several devices; done when all have answered."""
    devices: tuple[int, ...]
    on_done: OnDone | None
    command: str = ""
    replies: dict[int, Reply] = field(default_factory=dict)


class Devices:
    def __init__(self, handles: Sequence[WorkerHandle]) -> None:
        self.handles = {h.device: h for h in handles}
        self._queues: dict[int, deque[tuple[_Group, Command]]] = {d: deque() for d in self.handles}
        self._inflight: dict[int, _Group | None] = {d: None for d in self.handles}

    def send(self, devices: Sequence[int], cmd: Command, on_done: OnDone | None = None) -> None:
        """Queue `cmd` on each device; `on_done(replies)` is called once all have replied,
        leader's reply first."""
        group = _Group(tuple(devices), on_done, type(cmd).__name__)
        for d in group.devices:
            self._queues[d].append((group, cmd))
            self._pump(d)

    def busy(self, device: int) -> bool:
        return self._inflight[device] is not None or bool(self._queues[device])

    def _pump(self, d: int) -> None:
        if self._inflight[d] is None and self._queues[d]:
            group, cmd = self._queues[d].popleft()
            self._inflight[d] = group
            self.handles[d].submit(cmd)

    def collect(self) -> int:
        """Take every reply due now; run completions. Returns the number of replies."""
        n = 0
        for d, handle in self.handles.items():
            for reply in handle.poll():
                n += 1
                reply.device = d
                group = self._inflight[d]
                self._inflight[d] = None
                if group is None:
                    raise RuntimeError(f"device {d} answered {reply.command} unasked")
                group.replies[d] = reply
                if len(group.replies) == len(group.devices) and group.on_done is not None:
                    group.on_done([group.replies[x] for x in group.devices])
                self._pump(d)
        return n

    def broadcast(self, cmd: Command) -> None:
        """Send `cmd` to every device now, past the queues (Shutdown on exit)."""
        for d, handle in self.handles.items():
            self._queues[d].clear()
            handle.submit(cmd)

    def ask_each(self, cmd: Command, clock, timeout_s: float) -> dict[int, Reply]:
        """Queue `cmd` on every device and collect until each has answered it, at most
        `timeout_s`; the replies by device (the devices missing did not answer)."""
        got: dict[int, Reply] = {}

        def record(replies: list[Reply]) -> None:
            got[replies[0].device] = replies[0]

        for d in sorted(self.handles):
            self.send((d,), cmd, record)
        deadline = clock.now() + timeout_s
        while len(got) < len(self.handles) and clock.now() < deadline:
            self.collect()
            self._nap(clock)
        return got

    def stop_all(self, cmd: Command, clock, timeout_s: float) -> list[int]:
        """Send `cmd` (Shutdown) to every device past the queues and drain replies until each
        has answered it (a worker blocked sending a large reply would otherwise never see
        it), at most `timeout_s`; returns the devices that did not answer."""
        self.broadcast(cmd)
        name, left = type(cmd).__name__, set(self.handles)
        deadline = clock.now() + timeout_s
        while left and clock.now() < deadline:
            for d in list(left):
                if any(r.command == name for r in self.handles[d].poll()):
                    left.discard(d)
            self._nap(clock)
        return sorted(left)

    def describe(self) -> dict[int, str]:
        """What each device is doing: the command in flight and how many wait behind it."""
        out = {}
        for d in self.handles:
            g, q = self._inflight[d], self._queues[d]
            out[d] = (f"{g.command} in flight" if g is not None else "free") + (
                f", then {', '.join(type(c).__name__ for _, c in q)}" if q else "")
        return out

    def _nap(self, clock) -> None:
        """Wait for the next reply (simulation) or a moment (live)."""
        nxt = self.next_reply_time()
        clock.wait_until(nxt if nxt is not None else clock.now() + 0.01)

    def next_reply_time(self) -> float | None:
        times = [t for h in self.handles.values() if (t := h.next_reply_time()) is not None]
        return min(times) if times else None
