"""Keeping the training process groups alive while vLLM engines come and go (CPU twin).

On CPU a shift down drops the vLLM engine, and vLLM's engine shutdown ends with
`torch.distributed.destroy_process_group()`, which would also destroy the default group the
Megatron trainer's groups hang off: process groups are *preserved* context (paper §5.2).
vLLM's own groups (created with `new_group`) are still destroyed; only the call that would
take down the default group is skipped while this context is open. On GPUs the engine
sleeps instead of shutting down, so this path is not taken there.
"""
from __future__ import annotations

import contextlib
import logging

log = logging.getLogger(__name__)


@contextlib.contextmanager
def keep_default_process_group():
    import torch.distributed as dist

    original = dist.destroy_process_group

    def destroy(group=None):
        if group is None and dist.is_initialized():
            log.debug("kept the default process group across a vLLM engine shutdown")
            return
        original(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = original
