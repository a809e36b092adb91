"""The handles a GPSClient gives out: a pinned version (`Pin`), a Write in flight
(`WriteHandle`) and a DP rank's view of the Write its DP rank 0 makes (`FollowWrite`).
They hold the client's channel to its agent, or the client as `Versions`, never the client's
insides (gps.client imports this module)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pivotrl_hpc.gps import control
from pivotrl_hpc.gps.segment import Segment

if TYPE_CHECKING:
    from pivotrl_hpc.gps.channel import AgentChannel


class GPSWriteError(RuntimeError):
    """A Write the agents could not replicate to every node (fetch.TransferError there)."""


class Pin:
    """A pinned version: its segment stays mapped and unrecycled until `release()`."""

    def __init__(self, model: str, version: int, seg: Segment, fd: int):
        self.model, self.version, self.segment, self._fd = model, version, seg, fd

    def release(self) -> None:
        if self._fd is not None:
            control.unlock(self._fd)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        # a Pin lost unreleased (an error path) must not hold its version forever
        try:
            self.release()
        except OSError:
            pass

    def __enter__(self) -> "Pin":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class WriteHandle:
    """Completes when every node has published `version`; the caller overlaps with it.
    `channel`: the writing client's channel, whose notices say so (None: nothing to wait
    for, a DP rank > 0's write)."""
    channel: "AgentChannel | None"
    model: str
    version: int
    _done: bool = False

    def done(self) -> bool:
        if not self._done and self.channel is not None:
            self._done = self.channel.take_replicated(self.model, self.version, timeout=0.0)
            self._check()
        return self._done or self.channel is None

    def wait(self, timeout: float = 300.0) -> int:
        if not self.done():
            if not self.channel.take_replicated(self.model, self.version, timeout=timeout):
                raise TimeoutError(f"Write of {self.model} v{self.version} not replicated "
                                   f"after {timeout} s")
            self._check()
            self._done = True
        return self.version

    def _check(self) -> None:
        notice = self.channel.notices.get((self.model, self.version), {}) if self.channel \
            else {}
        if "error" in notice:
            raise GPSWriteError(f"Write of {self.model} v{self.version} failed: "
                                f"{notice['error']}")

    def replication(self) -> dict:
        """After `wait`: the data bytes of the version and, per node index, the seconds from
        the Write's start to its publication there (the writer's agent's clock)."""
        if self.channel is None:
            return {}
        notice = self.channel.notices.get((self.model, self.version), {})
        return {"bytes": notice.get("bytes", 0), "published_s": notice.get("published_s", {})}


class Versions(Protocol):
    """What FollowWrite asks of its GPSClient: the node's versions of a model."""

    def state(self, model: str) -> control.ModelState: ...

    def wait_version(self, model: str, version: int, timeout: float = 60.0) -> int: ...


@dataclass
class FollowWrite:
    """A DP rank > 0's view of the Write its DP rank 0 makes (only rank 0 writes): done once
    this node has published `version`, the version the rank's params now equal."""
    client: Versions
    model: str
    version: int

    def done(self) -> bool:
        cur = self.client.state(self.model).current
        return cur is not None and cur >= self.version

    def wait(self, timeout: float = 300.0) -> int:
        self.client.wait_version(self.model, self.version, timeout)
        return self.version
