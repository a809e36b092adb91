"""The CPU shim: the few patches that let Megatron-Core train on a host without CUDA.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the math. This
module is the only place in the project that patches them, and it is only ever applied when
`torch.cuda.is_available()` is False (see `parallel.ensure_device_support`). On a GPU host
none of it runs, so the GPU path is stock Megatron-Core.

Two kinds of patch:
- process-global ones (`apply_cpu_shim`): they replace functions that cannot work on a
  CUDA-less torch at all (the CUDA RNG tracker, `torch.cuda.current_device`, the apex-style
  grad clip, the stream API of megatron-core >= 0.17), so replacing them breaks nothing else;
- scoped ones (`cpu_device_scope`): rewriting `device='cuda'` in torch calls and letting CPU
  tensors claim `torch.cuda.*` in `Tensor.type()`. These would change the behaviour of other
  libraries in the same process (transformers, vLLM), so they are active only inside the scope
  that the trainer opens around its Megatron calls.

Verified against megatron-core 0.16.1 on torch 2.13 CPU (shared/reference/megatron-cpu).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_APPLIED = False
_LOCK = threading.Lock()
_SCOPE = threading.local()  # .depth: how many cpu_device_scope()s this thread is inside


def is_applied() -> bool:
    return _APPLIED


def _megatron_version() -> tuple[int, int]:
    import megatron.core

    major, minor = megatron.core.__version__.split(".")[:2]
    return int(major), int(minor)


def _patch_rng_tracker() -> None:
    # tensor_parallel/random.py CudaRNGStatesTracker.add calls torch.cuda.get_rng_state
    # (from model_parallel_cuda_manual_seed), and attention's get_cuda_rng_tracker().fork()
    # (transformer/dot_product_attention.py) runs on every forward even with dropout 0.
    # The replacement keeps named CPU generator states with the same semantics.
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    # initialize_rng_tracker() returns early once this is set, so our tracker is kept.
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _patch_current_device() -> None:
    # About 40 call sites use torch.cuda.current_device() as a device, e.g.
    # models/common/embeddings/rotary_pos_embedding.py `inv_freq.to(torch.cuda.current_device())`
    # and the DDP grad buffers in distributed/param_and_grad_buffer.py.
    torch.cuda.current_device = lambda: torch.device("cpu")


def _patch_grad_clip() -> None:
    # optimizer/clip_grads.py clip_grad_by_total_norm_fp32 asserts
    # `param.grad.type() == 'torch.cuda.FloatTensor'` and scales through the apex-style
    # multi_tensor_applier; optimizer.py imports it by name, so both references are replaced.
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as mopt
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters
                 if getattr(p, attr, None) is not None]
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0 and grads:
            torch._foreach_mul_(grads, coeff)

    mclip.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
    mopt.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu


def _patch_streams() -> None:
    # megatron-core >= 0.17: distributed/param_and_grad_buffer.py finish_grad_sync calls
    # torch.cuda.current_stream(); on CPU every op is synchronous, so waits are no-ops.
    class _HostStream:
        def wait_event(self, *args, **kwargs) -> None:
            return None

        def wait_stream(self, *args, **kwargs) -> None:
            return None

        def synchronize(self) -> None:
            return None

        def record_event(self, *args, **kwargs) -> None:
            return None

    torch.cuda.current_stream = lambda *args, **kwargs: _HostStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()


def _patch_tensor_type() -> None:
    # optimizer/distrib_optimizer.py:420 (and ~15 other places) check
    # `param.type() == 'torch.cuda.FloatTensor'`. Inside cpu_device_scope a CPU tensor answers
    # with the CUDA name of the same dtype; outside it, Tensor.type() is unchanged.
    original = torch.Tensor.type

    def scoped_type(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if (not args and not kwargs and getattr(_SCOPE, "depth", 0) > 0
                and isinstance(result, str) and result.startswith("torch.")
                and not result.startswith("torch.cuda.")):
            return "torch.cuda." + result[len("torch."):]
        return result

    torch.Tensor.type = scoped_type


def _patch_tensor_cuda() -> None:
    # Tensor.cuda() appears in optimizer/optimizer.py, optimizer/distrib_optimizer.py and
    # dist_checkpointing/exchange_utils.py; on a CUDA-less host the tensor is already where
    # it can live.
    original = torch.Tensor.cuda

    def scoped_cuda(self, *args, **kwargs):
        if getattr(_SCOPE, "depth", 0) > 0:
            return self
        return original(self, *args, **kwargs)

    torch.Tensor.cuda = scoped_cuda


def apply_cpu_shim() -> None:
    """Install the process-global patches once. Refuses to run where CUDA is available."""
    global _APPLIED
    with _LOCK:
        if _APPLIED:
            return
        if torch.cuda.is_available():
            raise RuntimeError("the Megatron CPU shim must not be applied on a CUDA host")
        _patch_rng_tracker()
        _patch_current_device()
        _patch_grad_clip()
        _patch_tensor_type()
        _patch_tensor_cuda()
        if _megatron_version() >= (0, 17):
            _patch_streams()
        _APPLIED = True
        log.info("Megatron-Core CPU shim applied")


def _to_host_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a bare int means a CUDA ordinal to torch
    return device


class _CudaToHostMode(TorchFunctionMode):
    """Rewrites device='cuda'/ordinal keyword arguments of torch calls to the CPU.

    Needed for literal factory calls such as optimizer/optimizer.py FP32Optimizer
    `torch.tensor([1.0], device='cuda')` and optimizer/clip_grads.py get_grad_norm_fp32
    `torch.zeros(1, dtype=torch.int, device='cuda')`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_host_device(kwargs["device"]))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Scope in which Megatron's CUDA device literals and type checks resolve to the CPU."""
    if not _APPLIED:
        raise RuntimeError("cpu_device_scope() needs apply_cpu_shim() first")
    _SCOPE.depth = getattr(_SCOPE, "depth", 0) + 1
    try:
        with _CudaToHostMode():
            yield
    finally:
        _SCOPE.depth -= 1
