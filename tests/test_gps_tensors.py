"""The copy primitives of GPS Read and Write (gps/tensors.py): which glibc memmoves a copy
becomes, and that the bytes land exactly. Pure host memory, no agent."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pivotrl_hpc.gps.tensors import PAGE, PIECE, copy_runs, memmove, packed, pieces, runs


def _segment_like(sizes: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """float32 tensors back to back in one page-aligned buffer, as in a segment's mapping."""
    raw = np.empty(sum(sizes) * 4 + PAGE, dtype=np.uint8)
    buf = torch.from_numpy(raw[(-raw.ctypes.data) % PAGE:][:sum(sizes) * 4]).view(torch.float32)
    buf.copy_(torch.arange(buf.numel(), dtype=torch.float32))
    views, pos = {}, 0
    for i, n in enumerate(sizes):
        views[f"t{i}"] = buf[pos:pos + n].view(n // 4, 4) if n % 4 == 0 else buf[pos:pos + n]
        pos += n
    return buf, views


def _at(views: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in views.items()}


def test_aliased_large_copy_is_split_into_pieces_covering_every_byte():
    n = 2 * PIECE + 123
    assert pieces(1000 * PAGE + 64, 7 * PAGE, n) == [(0, PIECE), (PIECE, PIECE), (2 * PIECE, 123)]
    assert pieces(1000 * PAGE + 2048, 7 * PAGE, n) == [(0, n)]   # not aliased: one memmove
    assert pieces(1000 * PAGE, 7 * PAGE, n) == [(0, n)]          # same page offset
    assert pieces(1000 * PAGE + 64, 7 * PAGE, PIECE) == [(0, PIECE)]   # small: one memmove
    src = np.random.default_rng(0).integers(0, 255, n + PAGE, dtype=np.uint8)
    dst = np.zeros(n + 2 * PAGE, dtype=np.uint8)
    s = (-src.ctypes.data) % PAGE
    d = (64 - dst.ctypes.data) % PAGE   # dst - src = 64 mod 4096: the aliased case
    memmove(dst.ctypes.data + d, src.ctypes.data + s, n)
    assert np.array_equal(dst[d:d + n], src[s:s + n])
    assert not dst[:d].any() and not dst[d + n:].any()   # nothing written around it


def test_packed_destinations_make_a_whole_read_one_memmove():
    buf, views = _segment_like([4096, 1024, 3, 262144, 512])
    out = packed(views, _at(views))
    assert [(o.shape, o.dtype) for o in out.values()] == [(v.shape, v.dtype)
                                                          for v in views.values()]
    assert all(o.data_ptr() % PAGE == v.data_ptr() % PAGE for o, v in zip(out.values(),
                                                                         views.values()))
    pairs = [(out[k], v) for k, v in views.items()]
    joined, rest = runs(pairs)
    assert joined == [(out["t0"].data_ptr(), buf.data_ptr(), buf.numel() * 4)] and not rest
    copy_runs(pairs)
    assert all(torch.equal(out[k], v) for k, v in views.items())


def test_separate_destinations_and_gaps_are_not_joined():
    buf, views = _segment_like([1024, 1024, 1024])
    own = {k: torch.empty_like(v) for k, v in views.items()}
    joined, _ = runs([(own[k], v) for k, v in views.items()])
    assert len(joined) == 3
    out = packed(views, _at(views))
    skip = [(out["t0"], views["t0"]), (out["t2"], views["t2"])]   # t1 not read: a gap
    assert [n for _, _, n in runs(skip)[0]] == [4096, 4096]
    apart = packed({"t0": views["t0"], "t2": views["t2"]}, _at(views))
    assert apart["t2"].data_ptr() % PAGE == views["t2"].data_ptr() % PAGE
    # back to back in the destination (as if t2 followed t0 at the source), not at the source
    t0 = views["t0"].data_ptr()
    tight = packed({"t0": views["t0"], "t2": views["t2"]}, {"t0": t0, "t2": t0 + 4096})
    assert tight["t2"].data_ptr() == tight["t0"].data_ptr() + 4096
    pairs = [(tight["t0"], views["t0"]), (tight["t2"], views["t2"])]
    assert len(runs(pairs)[0]) == 2
    copy_runs(pairs)
    assert torch.equal(tight["t2"], views["t2"])
    strided = torch.empty(4, 256).t()
    joined, rest = runs([(strided, views["t0"].view(256, 4))])
    assert not joined and len(rest) == 1
    copy_runs([(out[k], v) for k, v in views.items()] + [(strided, views["t1"].view(256, 4))])
    assert torch.equal(strided, views["t1"].view(256, 4)) and torch.equal(out["t2"], views["t2"])


def test_a_wrong_shape_is_refused_before_any_byte_moves():
    _, views = _segment_like([1024, 1024])
    out = {k: torch.zeros_like(v) for k, v in views.items()}
    with pytest.raises(ValueError, match=r"tensor of shape \(1, 4\) for a slice \(256, 4\)"):
        copy_runs([(out["t0"], views["t0"]), (torch.zeros(1, 4), views["t1"])])
    assert not out["t0"].any()
