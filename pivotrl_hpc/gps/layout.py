"""Which part of each canonical (HF-named) tensor a parallel rank needs, and where it lives.

`target_index(name, dims, shape, place)` is the slice rule of Read(M, G, P) for the inference
engine's layout: what vLLM's loaders keep per TP and EP rank, for every architecture that
`gps/arch.py` describes (column-parallel tensors split on dim 0 by heads, rows or each fused
part; row-parallel on dim 1; the vocabulary padded to 64 and split in equal blocks; KV heads
replicated when TP exceeds their count; norms and routers replicated; experts owned whole by
their EP rank, or split like a dense MLP without EP). A fused tensor's index holds several row
ranges on dim 0 (`Rows`); `take` and `put` apply any index.

The canonical segment layout is the safetensors one: tensors back to back in one flat byte
space. Planning works on byte ranges of that space, so `byte_ranges` turns a tensor index into
contiguous ranges (one per row when the split is on dim 1).

`hybrid_owner` assigns whole tensors to the nodes of a replication group (appendix B.1) by
greedy bin packing on bytes, so every node of a group holds about 1/k of the model.
"""
from __future__ import annotations

from dataclasses import dataclass

from pivotrl_hpc.gps.arch import REPLICATED, ROW, VOCAB, VOCAB_PADDING, split_of
from pivotrl_hpc.gps.shapes import ModelShape

Rows = tuple[slice, ...]   # several row ranges of dim 0: a fused tensor's parts, concatenated
Index = tuple[slice | Rows, ...]


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


def _heads(heads: int, rows_per_head: int, size: int, rank: int) -> slice:
    """Rows of `heads` heads for this rank; replicate heads when ranks outnumber them."""
    if heads >= size:
        h = _chunk(heads, size, rank)
        return slice(h.start * rows_per_head, h.stop * rows_per_head)
    if size % heads:
        raise ValueError(f"TP={size} neither divides nor is a multiple of {heads} KV heads")
    h = rank // (size // heads)
    return slice(h * rows_per_head, (h + 1) * rows_per_head)


def _parts(parts: tuple[int, ...], size: int, rank: int) -> Rows:
    """This rank's rows of each fused part, in part order (vLLM's MergedColumnParallel)."""
    rows, start = [], 0
    for n in parts:
        c = _chunk(n, size, rank)
        rows.append(slice(start + c.start, start + c.stop))
        start += n
    return tuple(rows)


def expert_range(num_experts: int, place: ParallelPlace) -> range:
    """Experts this EP rank owns: vLLM's linear placement (the remainder on the last rank)."""
    if not num_experts:
        raise ValueError("expert tensors in a model whose config names no experts")
    if place.ep_size > num_experts:
        raise ValueError(f"EP={place.ep_size} exceeds the model's {num_experts} experts")
    base = num_experts // place.ep_size
    start = place.ep_rank * base
    return range(start, num_experts if place.ep_rank == place.ep_size - 1 else start + base)


def vocab_rows(vocab: int, place: ParallelPlace) -> slice:
    """vLLM's vocabulary split: padded to a multiple of 64, equal blocks, the tail clipped."""
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    if padded % place.tp_size:
        raise ValueError(f"TP={place.tp_size} does not divide the padded vocabulary {padded}")
    per, r = padded // place.tp_size, place.tp_rank
    return slice(min(r * per, vocab), min((r + 1) * per, vocab))


def target_index(name: str, dims: tuple[int, ...], shape: ModelShape,
                 place: ParallelPlace) -> Index | None:
    """Index of `name` (full shape `dims`) that this place needs; None if it needs none."""
    tp, r = place.tp_size, place.tp_rank
    full = (slice(None),) * len(dims)
    split = split_of(name, dims, shape)
    if split.expert >= 0:
        if split.expert not in expert_range(shape.num_experts, place):
            return None
        if place.ep_size > 1:  # with expert parallelism each expert stays whole (no TP inside)
            return full
    if split.kind == VOCAB:
        return (vocab_rows(dims[0], place), *full[1:])
    if tp == 1 or split.kind == REPLICATED:
        return full
    if split.kind == ROW:
        return (slice(None), _chunk(dims[1], tp, r), *full[2:])
    if split.heads:
        return (_heads(split.heads, dims[0] // split.heads, tp, r), *full[1:])
    if split.parts:
        return (_parts(split.parts, tp, r), *full[1:])
    return (_chunk(dims[0], tp, r), *full[1:])


def pieces(index: Index) -> list[tuple[slice, ...]]:
    """An index as plain slice indices: one per fused part of dim 0 (usually one)."""
    if isinstance(index[0], tuple):
        return [(rows, *index[1:]) for rows in index[0]]
    return [index]  # type: ignore[list-item]


def take(t, index: Index):
    """`t[index]`; a fused tensor's parts come back concatenated on dim 0 (then a copy)."""
    parts = pieces(index)
    if len(parts) == 1:
        return t[parts[0]]
    import torch
    return torch.cat([t[p] for p in parts])


def put(t, index: Index, values, copy) -> None:
    """Write `values` (shaped as `take(t, index)`) into `t` at `index` with `copy(dst, src)`."""
    start = 0
    for p in pieces(index):
        dst = t[p]
        copy(dst, values[start:start + dst.shape[0]])
        start += dst.shape[0]


def normalized(index: Index, dims: tuple[int, ...], rows_before: int = 0) -> Index:
    """Explicit start/stop on dim 0, counted from row `rows_before` of the tensor (a block of
    it that starts there)."""
    def norm(s: slice) -> slice:
        a, b, _ = s.indices(dims[0])
        return slice(a - rows_before, b - rows_before)
    first = index[0]
    return ((tuple(norm(s) for s in first) if isinstance(first, tuple) else norm(first)),
            *index[1:])


def first_row(index: Index, dims: tuple[int, ...]) -> int:
    first = index[0]
    return (first[0] if isinstance(first, tuple) else first).indices(dims[0])[0]


def byte_ranges(info: TensorInfo, index: Index, itemsize: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) byte ranges, relative to the data start, covering `index`."""
    return [r for piece in pieces(index) for r in _piece_ranges(info, piece, itemsize)]


def _piece_ranges(info: TensorInfo, index: tuple[slice, ...],
                  itemsize: int) -> list[tuple[int, int]]:
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


def hybrid_owner(infos: list[TensorInfo], group_size: int) -> dict[str, int]:
    """Tensor name -> index (0..group_size-1) of the node of its replication group that
    holds it."""
    load = [0] * group_size
    owner: dict[str, int] = {}
    for info in sorted(infos, key=lambda t: (-t.nbytes, t.name)):
        j = min(range(group_size), key=lambda i: (load[i], i))
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
