"""Tensor helpers of Read and Write: fast copies, huge-page-friendly buffers, and the
HF-slices -> Megatron-shard step of a Megatron-layout Read."""
from __future__ import annotations

import ctypes
import dataclasses

import torch
from torch import Tensor

from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.shapes import ModelShape


def empty(shape, dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor in numpy-allocated memory: numpy asks for transparent huge pages
    on large blocks (torch does not), so copies into it take fewer TLB misses. Its storage
    cannot be resized: not for parameters a consumer frees with `storage().resize_(0)`."""
    import numpy as np
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.from_numpy(np.empty(n * size, dtype=np.uint8))
    return raw.view(dtype).view(tuple(shape))


def copy_into(dst: Tensor, src: Tensor) -> Tensor:
    """Copy `src` into `dst`. Contiguous same-dtype CPU blocks go through glibc memmove
    (non-temporal stores for large blocks: about a third less memory traffic than torch's copy
    kernel), so Read and Write run at memcpy speed. Not via `.numpy()`: that marks both
    storages non-resizable, and workers free parameters with `storage().resize_(0)`."""
    if dst.shape != src.shape:
        raise ValueError(f"tensor of shape {tuple(dst.shape)} for a slice {tuple(src.shape)}")
    src = src.detach()
    if (dst.dtype == src.dtype and src.device.type == dst.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        return dst
    if dst.device.type == "cuda" or src.device.type == "cuda":
        # a DMA from or to a registered mapping; the Read or Write synchronises once at its end
        return dst.copy_(src, non_blocking=True)
    return dst.copy_(src)  # strided slices, dtype conversions (bf16 trainer -> f32)


def to_megatron(hf: dict[str, Tensor], shape: ModelShape, place: ParallelPlace,
                 padded_vocab_size: int | None) -> dict[str, Tensor]:
    """HF slices of one TP rank -> that rank's Megatron shard (a TP=1 conversion of a
    shape shrunk to the rank's heads, rows and vocabulary part)."""
    tp = place.tp_size
    vocab_rows = hf["model.embed_tokens.weight"].shape[0]
    local = dataclasses.replace(
        shape, num_heads=shape.num_heads // tp, num_kv_heads=shape.num_kv_heads // tp,
        intermediate_size=shape.intermediate_size // tp, vocab_size=vocab_rows)
    padded = (padded_vocab_size or -(-shape.vocab_size // tp) * tp) // tp
    return hf_to_megatron(hf, local, 0, 1, padded_vocab_size=padded)
