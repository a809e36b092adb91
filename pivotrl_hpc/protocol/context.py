"""Role context by kind (paper §5.2, Figure 6): what a shift does with each piece.

- temporary (KV cache, activations): discarded on shift down, rebuilt lazily;
- parameters: discarded on shift down, Read from GPS on shift up;
- offloadable (optimizer state, gradients, main params): offloaded to host DRAM and reloaded;
- preserved (process groups, device context, imported engines): kept across shifts.

The worker names every shift phase after the context it handles, so the trace shows where
the seconds of a shift go.
"""
from __future__ import annotations

from enum import Enum

from pivotrl_hpc.protocol.messages import RoleKind


class ContextKind(str, Enum):
    TEMPORARY = "temporary"
    PARAMETERS = "parameters"
    OFFLOADABLE = "offloadable"
    PRESERVED = "preserved"


ROLE_CONTEXT: dict[RoleKind, dict[ContextKind, tuple[str, ...]]] = {
    RoleKind.ROLLOUT: {
        ContextKind.TEMPORARY: ("kv_cache", "running sequences (aborted, re-queued)"),
        ContextKind.PARAMETERS: ("policy weights",),
        ContextKind.PRESERVED: ("vllm import", "tokenizer config"),
    },
    RoleKind.REWARD: {
        ContextKind.TEMPORARY: ("kv_cache", "running sequences (aborted, re-queued)"),
        ContextKind.PARAMETERS: ("genrm weights",),
        ContextKind.PRESERVED: ("vllm import", "tokenizer config"),
    },
    RoleKind.TRAINING: {
        ContextKind.TEMPORARY: ("activations",),
        ContextKind.PARAMETERS: ("policy weights",),
        ContextKind.OFFLOADABLE: ("optimizer state", "gradients", "main params"),
        ContextKind.PRESERVED: ("process groups", "model definition", "device context"),
    },
}


def phase(kind: ContextKind, what: str) -> str:
    """Phase key for the shift report, e.g. 'parameters.read'."""
    return f"{kind.value}.{what}"


# A shift that built its vLLM engine or Megatron trainer reports one of these: once per
# (device, model) for the job's life; later shifts wake what was built.
BUILD_PHASES = frozenset({phase(ContextKind.PRESERVED, "engine_start"),
                          phase(ContextKind.PRESERVED, "build")})
