"""The training part of `pivotrl bench gpu`: Megatron-Core shifts in the real device worker.

Two workers over one GPS model, one after the other in this process: the reference trains
three GRPO steps without shifting; the shifted one publishes its first step to GPS, shifts
down (params discarded: GPS holds them; fp32 main params, Adam state and grads offloaded to
pinned host memory) and up (GPS Read of that version + reload), then trains the same two
steps. Their losses and grad norms must be equal: a shift cycle changes nothing. Device bytes
are `torch.cuda.memory_allocated` on a GPU and the trainer's own storage bytes (both
reported there; only the latter on the CPU twin).
"""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path

# name -> (hidden, layers, intermediate, heads, kv heads, vocab, sequences, tokens each)
MODELS = {"1b": (2048, 20, 5632, 16, 4, 32768, 8, 256),
          "tiny": (64, 2, 128, 4, 2, 512, 4, 32)}


def random_model(folder: Path, name: str, device: str) -> dict:
    """A random Qwen2-shaped bf16 HF folder (config + safetensors); returns the config."""
    import torch
    from safetensors.torch import save_file

    from pivotrl_hpc.gps.shapes import ModelShape

    h, layers, inter, heads, kv, vocab, _, _ = MODELS[name]
    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": vocab,
           "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "rope_theta": 1e6,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "max_position_embeddings": 4096}
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for n, shape in ModelShape.from_hf_config(cfg).hf_param_shapes().items():
        if n.endswith("norm.weight"):
            tensors[n] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02
            tensors[n] = t.to(torch.bfloat16).cpu()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return cfg


def _allocated(device: str) -> int | None:
    import torch
    return torch.cuda.memory_allocated() if device == "cuda" else None


def _ok(reply):
    if not reply.ok:
        raise RuntimeError(f"{reply.command}: {reply.error}")
    return reply


def _spec(folder: Path):
    from pivotrl_hpc.engines.megatron.model import ModelBuildConfig
    from pivotrl_hpc.engines.megatron.trainer import OptimConfig, TrainerConfig
    from pivotrl_hpc.runtime.worker import WorkerSpec

    return WorkerSpec(model_dirs={"policy": str(folder)}, trainer_config=TrainerConfig(
        model=ModelBuildConfig(dtype="bfloat16", max_sequence_length=1024),
        optim=OptimConfig(lr=1e-4)))


def _steps(worker, batches, publish_first: bool) -> list[dict]:
    from pivotrl_hpc.protocol.messages import TrainStep

    return [_ok(worker.handle(TrainStep(b, publish=publish_first and i == 0))).result
            for i, b in enumerate(batches)]


def reference(folder: Path, batches) -> list[dict]:
    """Three steps, no shift."""
    from pivotrl_hpc.runtime.local import local_worker
    from pivotrl_hpc.protocol.messages import RoleKind, ShiftUp

    with local_worker(_spec(folder), job="benchgpuref") as worker:
        _ok(worker.handle(ShiftUp(RoleKind.TRAINING)))
        return _steps(worker, batches, publish_first=False)


def shifted(folder: Path, batches, device: str) -> dict:
    """Step 1 (published), shift down, shift up, steps 2 and 3; phases and device bytes."""
    from pivotrl_hpc.runtime.local import local_worker
    from pivotrl_hpc.protocol.messages import RoleKind, ShiftDown, ShiftUp, WaitWrite

    out: dict = {}
    with local_worker(_spec(folder), job="benchgpushift") as worker:
        base = _allocated(device)
        out["first_shift_up"] = _ok(worker.handle(ShiftUp(RoleKind.TRAINING))).phases
        metrics = _steps(worker, batches[:1], publish_first=True)
        _ok(worker.handle(WaitWrite()))
        held = worker.trainer.device_bytes()
        before = _allocated(device)
        down = _ok(worker.handle(ShiftDown()))
        after = _allocated(device)
        out["device_bytes"] = {"role_held": held, "after_down": worker.trainer.device_bytes()}
        if device == "cuda":
            out["memory_allocated"] = {"before_up": base, "before_down": before,
                                       "after_down": after}
        up = _ok(worker.handle(ShiftUp(RoleKind.TRAINING)))
        out["memory_allocated_after_up"] = _allocated(device)
        out["read_version"] = up.result["read"]
        metrics += _steps(worker, batches[1:], publish_first=False)
    out.update(down=down.phases, up=up.phases, metrics=metrics)
    if device == "cuda":   # what the role held on the device, and what the shift down freed
        out["freed_fraction"] = (before - after) / max(1, before - base)
    else:
        out["freed_fraction"] = 1 - out["device_bytes"]["after_down"] / max(1, held)
    return out


def train_check(name: str, device: str, work: Path) -> dict:
    import torch

    from pivotrl_hpc.engines.megatron.batch import random_batch
    from pivotrl_hpc.engines.megatron.parallel import single_process_world

    single_process_world()
    if device == "cuda":   # equal losses need the same kernels both times
        torch.use_deterministic_algorithms(True, warn_only=True)
    folder = work / f"policy-{name}"
    t0 = time.perf_counter()
    cfg = random_model(folder, name, device)
    *_, n, seq = MODELS[name]
    batches = [random_batch(cfg["vocab_size"], n, seq, seed=s) for s in range(3)]
    made = time.perf_counter() - t0
    ref = reference(folder, batches)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    run = shifted(folder, batches, device)
    keys = ("loss", "grad_norm")
    equal = all(ref[i][k] == run["metrics"][i][k] for i in (1, 2) for k in keys)
    from pivotrl_hpc.gps.shapes import ModelShape
    return {"model": name, "params": ModelShape.from_hf_config(cfg).num_params(),
            "dtype": "bfloat16 params, fp32 main params", "model_made_s": round(made, 2),
            "shift_up_s": round(run["up"]["total"], 3),
            "shift_down_s": round(run["down"]["total"], 3),
            "freed_fraction": round(run["freed_fraction"], 4),
            "loss_equal": equal,
            "losses": {"reference": [m["loss"] for m in ref],
                       "shifted": [m["loss"] for m in run["metrics"]]},
            "grad_norms": {"reference": [m["grad_norm"] for m in ref],
                           "shifted": [m["grad_norm"] for m in run["metrics"]]},
            **{k: run[k] for k in ("read_version", "device_bytes", "up", "down",
                                   "first_shift_up") if k in run},
            **({"memory_allocated": run["memory_allocated"],
                "memory_allocated_after_up": run["memory_allocated_after_up"]}
               if device == "cuda" else {})}
