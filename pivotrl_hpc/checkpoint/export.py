"""`pivotrl export`: a checkpoint's policy as a HuggingFace model folder.

The checkpoint's `policy/` already is one (config, tokenizer, model.safetensors written from
GPS), so exporting copies it and checks it before anyone loads it: the checkpoint against its
manifest (checkpoint.manifest: no file changed since it was written), the weights against the
config (every tensor the architecture needs, shapes as the config says, finite values). The
export is a model to be read: its files 0644 in a 0755 folder, whatever the umask (writable
by the user alone).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from pivotrl_hpc.checkpoint.layout import POLICY, CheckpointError, find, read_state
from pivotrl_hpc.checkpoint.manifest import verify


def export(where: str | Path, out: str | Path, force: bool = False) -> dict[str, Any]:
    ckpt = find(where)
    verify(ckpt)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise CheckpointError(f"{out} exists and is not empty (--force replaces it)")
        shutil.rmtree(out)
    state = read_state(ckpt)
    info = check_weights(ckpt / POLICY)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt / POLICY, tmp)
    info.update(step=int(state["step"]), version=int(state["version"]), checkpoint=str(ckpt))
    (tmp / "pivotrl_export.json").write_text(json.dumps(info, indent=1) + "\n")
    for f in tmp.iterdir():   # the checkpoint's are the user's alone
        f.chmod(0o644)
    tmp.chmod(0o755)
    out.parent.mkdir(mode=0o755, parents=True, exist_ok=True)   # an export is published
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return {**info, "out": str(out)}


def check_weights(folder: Path) -> dict[str, Any]:
    """Tensors of `folder` against its config (gps.shapes): names, shapes, finiteness."""
    from safetensors import safe_open

    from pivotrl_hpc.gps.shapes import ModelShape

    shape = ModelShape.from_hf_config(folder)
    want = shape.hf_param_shapes()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no safetensors weights")
    got: dict[str, tuple[int, ...]] = {}
    nbytes = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                got[name] = tuple(t.shape)
                nbytes += t.numel() * t.element_size()
                if not bool(t.float().isfinite().all()):
                    raise CheckpointError(f"{f}: {name} holds non-finite values")
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(f"{folder}: tensors missing {missing[:5]}, unexpected {extra[:5]}")
    bad = [n for n in want if tuple(want[n]) != got[n]]
    if bad:
        raise CheckpointError(f"{folder}: {bad[0]} is {got[bad[0]]}, the config says "
                              f"{tuple(want[bad[0]])}")
    return {"tensors": len(got), "bytes": nbytes,
            "parameters": sum(math.prod(s) for s in got.values())}
