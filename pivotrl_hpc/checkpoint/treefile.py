"""A state dict (nested dicts, lists, tuples, numbers, strings, tensors) as one safetensors
file, with no pickle anywhere (issue 46).

`torch.save` writes a pickle, and torch.load with weights_only off runs whatever a pickle
says: a checkpoint planted in a run folder another account could write ran code as the job's
user. Here the tensors are safetensors entries named `t<N>` and the structure is JSON in the
file's metadata, so reading one is parsing, never executing. Tags keep what JSON would lose:

    {"d": [[key, value], ...]}   a dict (keys of any type JSON holds, ints included)
    {"t": [...]}                 a tuple                 [...]  a list
    {"x": "t3"}                  a tensor                a JSON scalar: itself

Tensors sharing a storage are written once each (safetensors refuses shared memory); the
same tensor object twice is written once and read back as one.

Reading is total: whatever the file holds (a planted or damaged one, JSON nested thousands
deep, a tag of the wrong shape, an unhashable dict key), `load` returns the tree or raises
`TreeFileError` (a CheckpointError), never anything else; nesting is bounded (MAX_DEPTH).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pivotrl_hpc.checkpoint.layout import CheckpointError

TREE_KEY = "pivotrl_tree"
FORMAT_KEY = "pivotrl_format"
FORMAT = "pivotrl-tree/1"
MAX_DEPTH = 64


class TreeFileError(CheckpointError):
    """A tree file that is not one this module wrote (or was altered)."""


def save(obj: Any, path: str | Path) -> None:
    """Write `obj` to `path` (a new file; safetensors truncates an existing one)."""
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    seen: dict[int, str] = {}
    storages: set[tuple[int, int]] = set()
    tree = _encode(obj, tensors, seen, storages, 0)
    save_file(tensors, str(path), metadata={FORMAT_KEY: FORMAT,
                                            TREE_KEY: json.dumps(tree, allow_nan=True)})


def load(path: str | Path, device: Any = "cpu") -> Any:
    """The object `save` wrote to `path`; TreeFileError for anything else."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if meta.get(FORMAT_KEY) != FORMAT or TREE_KEY not in meta:
                raise TreeFileError(f"{path}: not a {FORMAT} file")
            names = set(f.keys())
            tree = json.loads(meta[TREE_KEY])
            tensors = {n: f.get_tensor(n) for n in names}
    except TreeFileError:
        raise
    except (SafetensorError, OSError, ValueError, TypeError, RecursionError) as e:
        raise TreeFileError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") \
            from None
    return _decode(tree, tensors, str(path), 0)


def _encode(obj: Any, tensors: dict, seen: dict, storages: set, depth: int) -> Any:
    import torch

    if depth > MAX_DEPTH:
        raise TypeError(f"nested deeper than {MAX_DEPTH}")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return {"x": seen[id(obj)]}
        t = obj.detach()
        key = (t.untyped_storage().data_ptr(), t.device.index or 0)
        if key in storages or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        elif t.numel():
            storages.add(key)
        name = seen[id(obj)] = f"t{len(tensors)}"
        tensors[name] = t.cpu() if t.device.type != "cpu" else t
        return {"x": name}
    if isinstance(obj, tuple):
        return {"t": [_encode(v, tensors, seen, storages, depth + 1) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, seen, storages, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return {"d": [[_encode(k, tensors, seen, storages, depth + 1),
                       _encode(v, tensors, seen, storages, depth + 1)] for k, v in obj.items()]}
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint without pickle")


def _decode(node: Any, tensors: dict, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TreeFileError(f"{where}: nested deeper than {MAX_DEPTH}")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, where, depth + 1) for v in node]
    if not isinstance(node, dict) or len(node) != 1:
        raise TreeFileError(f"{where}: malformed node {str(node)[:80]}")
    (tag, body), = node.items()
    if tag == "x" and isinstance(body, str) and body in tensors:
        return tensors[body]
    if tag == "f" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "t" and isinstance(body, list):
        return tuple(_decode(v, tensors, where, depth + 1) for v in body)
    if tag == "d" and isinstance(body, list) and all(
            isinstance(kv, list) and len(kv) == 2 for kv in body):
        out = {}
        for k, v in body:
            key = _decode(k, tensors, where, depth + 1)
            if not _hashable(key):
                raise TreeFileError(f"{where}: a dict key of type {type(key).__name__}")
            out[key] = _decode(v, tensors, where, depth + 1)
        return out
    raise TreeFileError(f"{where}: malformed node {str(node)[:80]}")


def _hashable(key: Any) -> bool:
    """A dict key a state dict can have: a JSON scalar or a tuple of them (nested)."""
    if isinstance(key, tuple):
        return all(_hashable(k) for k in key)
    return key is None or isinstance(key, (str, int, float, bool))
