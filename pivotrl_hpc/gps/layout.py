"""Which part of each canonical (HF-named) tensor a parallel rank needs, and where it lives.

`target_index(name, shape, place)` is the slice rule of Read(M, G, P) for the inference-engine
layout (what vLLM's Qwen2 loaders keep per TP rank): column-parallel q/k/v/gate/up split on
dim 0 by heads or rows, row-parallel o_proj/down_proj on dim 1, vocabulary-parallel embedding
and lm_head on dim 0 (ceil(V / TP) rows per rank, the last rank clipped), KV heads replicated
when TP exceeds their count, norms replicated, MoE experts owned by `expert // (E / EP)`.

The canonical segment layout is the safetensors one: tensors back to back in one flat byte
space. Planning works on byte ranges of that space, so `byte_ranges` turns a tensor index into
contiguous ranges (one per row when the split is on dim 1).

`hybrid_owner` assigns whole tensors to the nodes of a replication group (appendix B.1) by
greedy bin packing on bytes, so every node of a group holds about 1/k of the model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pivotrl_hpc.gps.shapes import ModelShape

Index = tuple[slice, ...]
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_COLUMN = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.")
_ROW = ("o_proj.weight", "down_proj.weight")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ParallelPlace:
    """A worker's place in the parallel layout P of a device set G."""
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank, what in ((self.tp_size, self.tp_rank, "tp"),
                                 (self.dp_size, self.dp_rank, "dp"),
                                 (self.ep_size, self.ep_rank, "ep")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"bad {what} place: rank {rank} of {size}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a segment: safetensors dtype string, shape, byte offsets in the data."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def _chunk(n: int, size: int, rank: int) -> slice:
    if n % size:
        raise ValueError(f"{n} does not split evenly over {size} ranks")
    step = n // size
    return slice(rank * step, (rank + 1) * step)


def _heads(heads: int, head_dim: int, size: int, rank: int) -> slice:
    """Rows of `heads` heads for this rank; replicate heads when ranks outnumber them."""
    if heads >= size:
        h = _chunk(heads, size, rank)
        return slice(h.start * head_dim, h.stop * head_dim)
    if size % heads:
        raise ValueError(f"TP={size} neither divides nor is a multiple of {heads} KV heads")
    h = rank // (size // heads)
    return slice(h * head_dim, (h + 1) * head_dim)


def target_index(name: str, dims: tuple[int, ...], shape: ModelShape,
                 place: ParallelPlace) -> Index | None:
    """Index of `name` (full shape `dims`) that this place needs; None if it needs none."""
    tp, r = place.tp_size, place.tp_rank
    full = (slice(None),) * len(dims)
    m = _EXPERT.search(name)
    if m is not None:
        n_experts = _num_experts_hint(shape, place)
        if int(m.group(1)) // (n_experts // place.ep_size) != place.ep_rank:
            return None
        if place.ep_size > 1:  # with expert parallelism each expert stays whole (no TP inside)
            return full
    if name in VOCAB_PARALLEL:
        rows = -(-dims[0] // tp)
        return (slice(min(r * rows, dims[0]), min((r + 1) * rows, dims[0])), *full[1:])
    if tp == 1:
        return full
    if name.endswith(_ROW):
        return (slice(None), _chunk(dims[1], tp, r))
    if any(p in name for p in _COLUMN):
        if ".self_attn." in name:
            heads = shape.num_heads if "q_proj" in name else shape.num_kv_heads
            return (_heads(heads, shape.head_dim, tp, r), *full[1:])
        return (_chunk(dims[0], tp, r), *full[1:])
    return full


def _num_experts_hint(shape: ModelShape, place: ParallelPlace) -> int:
    # Dense Qwen2 shapes carry no expert count; MoE callers use ModelShape subclasses that do.
    n = getattr(shape, "num_experts", 0)
    if not n:
        raise ValueError("expert tensors need a shape with num_experts")
    if n % place.ep_size:
        raise ValueError(f"EP={place.ep_size} does not divide {n} experts")
    return n


def byte_ranges(info: TensorInfo, index: Index, itemsize: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) byte ranges, relative to the data start, covering `index`."""
    dims = info.shape
    norm = [index[i].indices(dims[i]) if i < len(index) else (0, dims[i], 1)
            for i in range(len(dims))]
    if not dims:
        return [(info.start, info.stop)]
    row_bytes = itemsize
    for d in dims[1:]:
        row_bytes *= d
    (r0, r1, _), rest = norm[0], norm[1:]
    if all(a == 0 and b == d for (a, b, _), d in zip(rest, dims[1:])):
        return [(info.start + r0 * row_bytes, info.start + r1 * row_bytes)] if r1 > r0 else []
    if len(dims) != 2:
        raise ValueError(f"only dim-0 or 2-D dim-1 splits are planned, got {index} of {dims}")
    c0, c1, _ = rest[0]
    return [(info.start + r * row_bytes + c0 * itemsize, info.start + r * row_bytes + c1 * itemsize)
            for r in range(r0, r1)]


def covering_range(info: TensorInfo, index: Index, itemsize: int) -> tuple[int, int]:
    """The one contiguous byte range (whole rows) that covers `index`: fewer, larger transfers."""
    ranges = byte_ranges(info, index, itemsize)
    if not ranges:
        return (info.start, info.start)
    rows = info.nbytes // max(info.shape[0], 1) if info.shape else info.nbytes
    lo = info.start + (ranges[0][0] - info.start) // rows * rows
    hi = info.start + -(-(ranges[-1][1] - info.start) // rows) * rows
    return (lo, hi)


def hybrid_owner(infos: list[TensorInfo], k: int) -> dict[str, int]:
    """Tensor name -> index (0..k-1) of the node of its replication group that holds it."""
    load = [0] * k
    owner: dict[str, int] = {}
    for info in sorted(infos, key=lambda t: (-t.nbytes, t.name)):
        j = min(range(k), key=lambda i: (load[i], i))
        owner[info.name] = j
        load[j] += info.nbytes
    return owner


def choose_group_size(model_bytes: list[list[int]], n_nodes: int, budget: int) -> int:
    """Smallest k dividing n_nodes whose packed per-node footprint of all models fits `budget`.

    `model_bytes` holds, per model, its tensors' byte sizes. Raises if even k = n_nodes fails.
    """
    for k in range(1, n_nodes + 1):
        if n_nodes % k:
            continue
        worst = 0
        for sizes in model_bytes:
            load = [0] * k
            for s in sorted(sizes, reverse=True):
                load[load.index(min(load))] += s
            worst += max(load)
        if worst <= budget:
            return k
    total = sum(sum(s) for s in model_bytes)
    raise MemoryError(f"GPS models need {total} bytes; even sharded over {n_nodes} nodes they "
                      f"exceed the per-node budget of {budget} bytes")
