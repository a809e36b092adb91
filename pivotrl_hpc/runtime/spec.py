"""What one device worker of a job is: its environment and its `WorkerSpec`, from the config.

The launcher calls `worker_env` (before the worker imports torch) and `worker_spec` per
worker rank. Conventions (one place, so that every rank derives the same ones):

- Training devices are the first `roles.train_devices` global devices. Their torch world
  (RANK = device, WORLD_SIZE = train_devices) is the trainer's, built once by it; it meets
  through the FileStore the launcher names in PIVOTRL_TRAIN_STORE (a 0700 folder of the
  user's in the run's logs folder, which every node sees), nothing listens on a port for it
  (engines.megatron.parallel). Megatron orders TP fastest (tp_rank = rank % TP,
  dp_rank = rank // TP).
- Inference engines run in engine hosts (`runtime.engine_host`). A replica of size s > 1 is
  an aligned slot of s consecutive devices on one node: slot j = device // s, TP rank =
  device % s, the world named by port_base + 100 + j for the GenRM (reward) and
  port_base + 100 + total_devices + j for the policy (rollout); it meets through a FileStore
  in the job's GPS folder on its node (the slot's devices share a node; runtime.tp_world),
  nothing listens on that port. The hosts of a slot start together (the controller shifts
  them up together).
- CPU share: `omp_threads = max(1, round(cluster.cpu_share))` per engine and trainer; GPUs:
  each worker sees its own device only (CUDA_VISIBLE_DEVICES), so LOCAL_RANK is 0.
"""
from __future__ import annotations

from typing import Any

from pivotrl_hpc import envs
from pivotrl_hpc.config.schema import resumed_from

MiB = 2**20
REWARD_PORT_OFFSET = 100


def omp_threads(cfg: Any) -> int:
    return max(1, round(cfg.cluster.cpu_share))


def training_devices(cfg: Any) -> range:
    r = cfg.roles
    if not 1 <= r.train_devices <= cfg.total_devices or r.train_devices % r.train_tensor_parallel:
        raise ValueError(f"roles.train_devices={r.train_devices} must be in 1.."
                         f"{cfg.total_devices} and divisible by roles.train_tensor_parallel="
                         f"{r.train_tensor_parallel}")
    return range(r.train_devices)


def worker_env(cfg: Any, device: int) -> dict[str, str]:
    """Environment of the worker of global device `device`, to set before torch loads."""
    _check_device(cfg, device)
    local = device % cfg.cluster.devices_per_node
    env = {"OMP_NUM_THREADS": str(omp_threads(cfg))}
    if cfg.cluster.device_kind == "gpu":
        visible = envs.CUDA_VISIBLE_DEVICES.raw() or ""
        ids = [v for v in visible.split(",") if v] or [str(i) for i in range(local + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ids[local]
        local = 0
    if device in training_devices(cfg):
        env.update(RANK=str(device), WORLD_SIZE=str(cfg.roles.train_devices),
                   LOCAL_RANK=str(local))
    return env


def worker_spec(cfg: Any, device: int, job: str, node: str, port_base: int):
    """The `WorkerSpec` of global device `device` (engine hosts, GPS of `job` on `node`)."""
    from pivotrl_hpc.checkpoint.layout import root_for
    from pivotrl_hpc.gps.layout import ParallelPlace
    from pivotrl_hpc.runtime.worker import WorkerSpec

    _check_device(cfg, device)
    training = device in training_devices(cfg)
    return WorkerSpec(
        model_dirs={"policy": cfg.models.policy.path, "genrm": cfg.models.genrm.path},
        engine_options={"policy": engine_options(cfg, "policy"),
                        "genrm": engine_options(cfg, "genrm")},
        trainer_config=trainer_config(cfg) if training else None,
        # vLLM's loaders slice full HF tensors per TP rank: hosts Read the whole model.
        inference_place=ParallelPlace(),
        training_place=training_place(cfg, device) if training else ParallelPlace(),
        engine_process=True,
        engine_worlds={m: w for m in ("policy", "genrm")
                       if (w := engine_world(cfg, m, device, port_base, job, node))
                       is not None},
        gps_job=job, gps_node=node, device=device,
        resume=resumed_from(cfg) if training else "",
        checkpoints=str(root_for(cfg.trace.path)) if training else "",
        group_shared=bool(cfg.trace.group_shared))


def replica_size(cfg: Any, model: str) -> int:
    r = cfg.roles
    size = r.rollout_replica_size if model == "policy" else r.reward_replica_size
    tp = getattr(cfg.models, model).tensor_parallel
    if size != tp:
        raise ValueError(f"{model}: replica size {size} != models.{model}.tensor_parallel {tp}")
    if cfg.cluster.devices_per_node % size:
        raise ValueError(f"{model} replicas of {size} devices do not tile "
                         f"{cfg.cluster.devices_per_node} devices per node")
    return size


def engine_options(cfg: Any, model: str):
    """One replica's engine; each TP rank's KV cache is what its device leaves after the
    weight shard and the workspace (gps/memory.py), or `roles.kv_cache_mb` split over
    the ranks where the config sets it."""
    from pivotrl_hpc.gps.memory import KVBudget
    from pivotrl_hpc.protocol.engine import EngineOptions

    m, size = getattr(cfg.models, model), replica_size(cfg, model)
    kv = KVBudget(cfg, model)
    return EngineOptions(dtype=m.dtype, max_model_len=m.max_prompt_len + m.max_response_len,
                         kv_cache_memory_bytes=kv.device_bytes,
                         gpu_memory_utilization=cfg.roles.gpu_memory_utilization,
                         max_num_seqs=cfg.roles.max_num_seqs,
                         device_memory_bytes=0 if kv.override else kv.memory,
                         tensor_parallel_size=size, seed=cfg.rl.seed,
                         omp_threads=omp_threads(cfg),
                         enable_expert_parallel=m.expert_parallel > 1)


def engine_world(cfg: Any, model: str, device: int, port_base: int, job: str = "",
                 node: str = ""):
    """This device's place in the torch world of its `model` replica slot (None: TP = 1).
    The slot's port names the world; its rendezvous is a FileStore in the job's GPS folder
    on `node` (runtime.tp_world), not a listener on that port."""
    from pivotrl_hpc.runtime.engine_host import TPWorld

    size = replica_size(cfg, model)
    if size == 1:
        return None
    slot = device // size
    port = port_base + REWARD_PORT_OFFSET + slot
    if model == "policy":
        port += cfg.total_devices
    return TPWorld(rank=device % size, size=size, master_addr="127.0.0.1", master_port=port,
                   local_rank=0 if cfg.cluster.device_kind == "gpu"
                   else device % cfg.cluster.devices_per_node, job=job, node=node)


def training_place(cfg: Any, device: int):
    from pivotrl_hpc.gps.layout import ParallelPlace

    tp = cfg.roles.train_tensor_parallel
    return ParallelPlace(tp_size=tp, tp_rank=device % tp,
                         dp_size=cfg.roles.train_devices // tp, dp_rank=device // tp)


def trainer_config(cfg: Any):
    from pivotrl_hpc.engines.megatron.grpo import GRPOConfig
    from pivotrl_hpc.engines.megatron.model import ModelBuildConfig
    from pivotrl_hpc.engines.megatron.trainer import OptimConfig, TrainerConfig

    p, rl = cfg.models.policy, cfg.rl
    return TrainerConfig(
        model=ModelBuildConfig(tp_size=cfg.roles.train_tensor_parallel, dtype=p.dtype,
                               max_sequence_length=p.max_prompt_len + p.max_response_len),
        optim=OptimConfig(lr=rl.learning_rate),
        grpo=GRPOConfig(clip_low=rl.clip_low, clip_high=rl.clip_high,
                        # greedy rollout (temperature 0) scores the untempered policy
                        temperature=getattr(rl, "temperature", 1.0) or 1.0,
                        old_logprobs=getattr(rl, "old_logprobs", "behaviour")),
        seed=rl.seed)


def _check_device(cfg: Any, device: int) -> None:
    if not 0 <= device < cfg.total_devices:
        raise ValueError(f"device {device} outside 0..{cfg.total_devices - 1}")
