"""Tensor helpers of Read and Write: fast copies, huge-page-friendly buffers, and the
HF-slices -> Megatron-shard step of a Megatron-layout Read.

Why a Read copies the way it does (issue 40, measured with glibc 2.36 on the 2-core VM): glibc's
memmove streams with non-temporal stores only above its threshold (192 MiB there), about 1.7x
the bandwidth of its cached loop, which every smaller copy takes. So a Read of separate
tensors, each below that size, reaches ~0.6 of one whole-model memcpy; a Read into `packed`
destinations is one memmove (`copy_runs`) and reaches memcpy speed. Above the threshold the
streaming loop stalls on 4K aliasing when the destination trails the source by under 1 KiB
modulo 4 KiB (torch allocates at 64 mod 4096, segment tensors start page-aligned): 1.7 GB/s
against 7.6; `memmove` then copies in pieces that take the cached loop (4.4 GB/s)."""
from __future__ import annotations

import ctypes
import dataclasses

import torch
from torch import Tensor

from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.shapes import ModelShape


def _np_bytes(n: int):
    """Uninitialised bytes from numpy: numpy asks for transparent huge pages on large blocks
    (torch does not), so copies into them take fewer TLB misses."""
    import numpy as np
    return np.empty(n, dtype=np.uint8)


PAGE = 4096
ALIAS_WINDOW = 1024     # dst - src (mod PAGE) below this: the streaming loop's loads stall
PIECE = 16 << 20        # below any glibc non-temporal threshold (L3-sized or larger)


def pieces(dst: int, src: int, n: int) -> list[tuple[int, int]]:
    """(offset, length) of the glibc memmoves that copy n bytes from src to dst: one, or
    PIECE-sized pieces where the whole copy would stall on 4K aliasing (module docstring)."""
    if n > PIECE and 0 < (dst - src) % PAGE < ALIAS_WINDOW:
        return [(off, min(PIECE, n - off)) for off in range(0, n, PIECE)]
    return [(0, n)]


def memmove(dst: int, src: int, n: int) -> None:
    for off, length in pieces(dst, src, n):
        ctypes.memmove(dst + off, src + off, length)


def _flat(dst: Tensor, src: Tensor) -> bool:
    """A pair glibc can copy as bytes: same dtype, both contiguous, both in host memory."""
    return (dst.dtype == src.dtype and src.device.type == dst.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous())


def runs(pairs: list[tuple[Tensor, Tensor]]) -> tuple[list[tuple[int, int, int]], list]:
    """The byte runs (dst, src, nbytes) that copy the flat (dst, src) pairs, pairs back to
    back in both source and destination (the next starts where this one ends, on both sides)
    joined into one; and the other pairs, for copy_into."""
    joined: list[list[int]] = []
    rest = []
    for dst, src in pairs:
        n = src.numel() * src.element_size()
        if not _flat(dst, src) or n == 0:
            rest.append((dst, src))
            continue
        d, s = dst.data_ptr(), src.data_ptr()
        last = joined[-1] if joined else None
        if last is not None and last[0] + last[2] == d and last[1] + last[2] == s:
            last[2] += n
        else:
            joined.append([d, s, n])
    return [(d, s, n) for d, s, n in joined], rest


def copy_runs(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """copy_into for every (dst, src) pair, back-to-back pairs in one memmove (`runs`): a
    Read of a whole model into `packed` tensors is one copy. Every pair's shape is checked
    before any byte moves."""
    for dst, src in pairs:
        _check_shape(dst, src)
    joined, rest = runs(pairs)
    for d, s, n in joined:
        memmove(d, s, n)
    for dst, src in rest:
        copy_into(dst, src)


def packed(like: dict[str, Tensor], at: dict[str, int]) -> dict[str, Tensor]:
    """Empty tensors shaped like `like` (the slices a Read copies; meta tensors will do), views
    of one numpy buffer in the given order, each at its source's address `at[name]` modulo
    4 KiB (no 4K aliasing) and, where sources lie back to back, back to back too: a Read of
    them is then one memmove. One shared storage: not for parameters freed by resizing it."""
    sizes = {n: t.numel() * t.element_size() for n, t in like.items()}
    raw = _np_bytes(sum(sizes.values()) + PAGE * (len(like) + 1))
    base, pos, end = raw.ctypes.data, 0, None
    out = {}
    for name, t in like.items():
        if at[name] != end:   # not right after the previous source: pad to its page offset
            pos += (at[name] - base - pos) % PAGE
        out[name] = torch.from_numpy(raw[pos:pos + sizes[name]]).view(t.dtype).view(t.shape)
        pos, end = pos + sizes[name], at[name] + sizes[name]
    return out


def _check_shape(dst: Tensor, src: Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"tensor of shape {tuple(dst.shape)} for a slice {tuple(src.shape)}")


def copy_into(dst: Tensor, src: Tensor) -> Tensor:
    """Copy `src` into `dst`. Contiguous same-dtype CPU blocks go through glibc memmove
    (`memmove`; above glibc's threshold its non-temporal stores move about a third less
    memory than torch's copy kernel). Not via `.numpy()`: that marks both
    storages non-resizable, and workers free parameters with `storage().resize_(0)`."""
    _check_shape(dst, src)
    src = src.detach()
    if _flat(dst, src):
        memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
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
