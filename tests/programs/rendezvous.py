"""torch.distributed rendezvous without picking a port, closing it and hoping it stays free.

The process that owns the rendezvous binds its TCPStore on port 0 (the OS picks a free port
and the store keeps it bound) and hands the store over: in-process for a world of one, or to
child ranks as the store's address with TORCHELASTIC_USE_AGENT_STORE=True (the ranks then
all connect as clients, as under torchrun's agent).
"""
from __future__ import annotations

import datetime
import os

TIMEOUT = datetime.timedelta(seconds=300)


def bound_store(world_size: int):
    """A TCPStore server on an OS-chosen port, bound for as long as the object lives."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=TIMEOUT)


def agent_store_env(store) -> dict[str, str]:
    """Env for child ranks that join `store` (env:// rendezvous, every rank a client)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def init_world_of_one():
    """This process's default process group (gloo, world 1) over its own bound store; vLLM
    and the Megatron trainer both reuse an existing default group. Returns the store."""
    import torch.distributed as dist

    store = bound_store(1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=TIMEOUT)
    return store
