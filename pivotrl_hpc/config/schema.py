"""The typed configuration tree (torchtitan-style nested dataclasses).

Field comments say what a value means; `load.py` turns YAML plus dotted overrides into
these, and `validate.py` checks the combinations before anything starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

DeviceKind = Literal["cpu", "gpu"]
Paradigm = Literal["colocated", "disaggregated", "rr_colocated", "rr_colocated_pooled",
                   "shiftable", "static", "rule_based", "vanilla", "vanilla_tm"]
Transport = Literal["nixl", "mpi"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class ClusterConfig:
    nodes: int = 2
    devices_per_node: int = 4
    device_kind: DeviceKind = "cpu"
    # CPU cores per emulated device (cgroup quota), so an idle "device" really wastes
    # capacity as an idle GPU does. Ignored on GPUs.
    cpu_share: float = 0.5
    # The shares of all devices must stay below 80 % of the machine's cores, else an idle
    # "device" lends its CPU to a busy one and paradigm comparisons mean nothing. True turns
    # the refusal into a warning (for a quick look, never for a measurement).
    allow_oversubscribe: bool = False
    # Memory of one device, GiB; 0: the kind's figure (gps/memory.py DEVICE_MEMORY_GIB:
    # gpu 96, the paper's H20; cpu 0.25, the emulation's). Each engine's KV cache is what
    # roles.gpu_memory_utilization of it leaves after the weights and the workspace.
    device_memory_gib: float = 0.0


@dataclass
class ModelConfig:
    path: str = ""
    # HF architecture (config.json "architectures"), e.g. Glm4ForCausalLM; "" takes the
    # folder's. Named, it is checked against the folder, and it describes a model whose
    # folder is not here yet (the simulator needs no weights).
    architecture: str = ""
    dtype: DType = "float32"
    tensor_parallel: int = 1
    expert_parallel: int = 1
    max_prompt_len: int = 64
    max_response_len: int = 64


@dataclass
class ModelsConfig:
    policy: ModelConfig = field(default_factory=ModelConfig)
    genrm: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class RolesConfig:
    # Devices per replica. A rollout replica is one policy engine (size = policy TP); a
    # reward replica one GenRM engine (size = GenRM TP); training is one unit.
    rollout_replica_size: int = 1
    reward_replica_size: int = 1
    train_devices: int = 4
    train_tensor_parallel: int = 1
    # KV cache of one inference replica, MiB, split over its TP ranks: an explicit override.
    # 0 (default): derived from the device as vLLM does (gps/memory.py): device memory x
    # gpu_memory_utilization - weight shard - activation workspace, summed over the replica.
    kv_cache_mb: int = 0
    gpu_memory_utilization: float = 0.9   # vLLM's: the fraction of a device an engine uses
    max_num_seqs: int = 256   # vLLM's: sequences an inference engine decodes at once
    # Decode iterations per Step command: how often the controller hears from an inference
    # replica (and can Dispatch into the slots its finished sequences left)
    step_iterations: int = 4
    # Build every engine on every device at job start, asleep, so that a shift up only wakes
    # one (paper §5.2's preserved context). auto: "all" where devices change role (every
    # paradigm but disaggregated), else "none".
    prebuild_engines: Literal["auto", "all", "none"] = "auto"


@dataclass
class RLConfig:
    group_size: int = 4          # GRPO responses per prompt
    batch_size: int = 8          # prompts per training step
    staleness: int = 1           # max policy versions a sample may lag (async paradigms)
    learning_rate: float = 1e-5
    clip_low: float = 0.2
    clip_high: float = 0.28      # DAPO clip-higher
    # The PPO ratio's "old" policy: recompute (the trained policy's logprobs at the step's
    # start, as veRL; stale samples still teach) or behaviour (the rollout's logprobs)
    old_logprobs: Literal["recompute", "behaviour"] = "recompute"
    steps: int = 3
    seed: int = 0
    temperature: float = 1.0     # rollout sampling temperature
    eval_every: int = 0          # validation accuracy every N steps and after the last (0: never)
    eval_before_train: bool = False   # also of the initial policy (veRL's val_before_train)
    eval_prompts: int = 16       # validation prompts per evaluation
    # pass@1 over this many samples of each validation prompt, drawn at eval_temperature
    # (0: greedy; DAPO's AIME evaluation draws 32 at temperature 1.0)
    eval_samples: int = 1
    eval_temperature: float = 0.0
    # A checkpoint (policy, optimizer, data cursor, samples in flight) every N steps and after
    # the last one, in <trace>.checkpoints/ (0: none); only the newest `keep_checkpoints` stay.
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    # Seconds a stop signal leaves before SIGKILL (Slurm preemption: the partition's
    # GraceTime). > 0: on SIGTERM the controller checkpoints after the running step if that
    # fits in this time, then stops; else (and with 0) it stops at once and the next start
    # resumes from the last periodic checkpoint.
    preempt_grace_s: float = 0.0


@dataclass
class WorkloadConfig:
    """How long responses and judgements get. `eos`: the models stop at EOS (or the cap).
    `budget`: each sample draws a length budget from a log-normal (median, sigma), capped at
    the model's max_response_len, and EOS is ignored, so the long tail of the paper's
    Figure 2 shows up on random-weight CPU models too."""
    length_mode: Literal["eos", "budget"] = "budget"
    rollout_median: int = 12
    rollout_sigma: float = 0.8
    genrm_median: int = 6
    genrm_sigma: float = 0.6
    # Simulator only: judge prompt tokens per response token, on top of the judge template
    # and the problem (0: as the GenRM's tokenizer re-encodes the modeled response, which
    # depends on the stand-in tokenizer; docs/design.md has the measured ratio).
    judge_prompt_ratio: float = 0.0


@dataclass
class ParadigmConfig:
    name: Paradigm = "shiftable"
    horizon_s: float = 60.0      # H in the benefit B = H * (T_cand - T_cur) - phi
    # Estimated seconds to shift one replica of a role (tau_shift), before measurements.
    shift_seconds_rollout: float = 5.0
    shift_seconds_reward: float = 5.0
    shift_seconds_training: float = 8.0
    planner_interval_s: float = 5.0
    # Shift-up migration loop (sched/migration.py): "paper" (Algorithm 4 as stated: the
    # max-throughput replica as source, stop at its first non-improving move) or
    # "least_loss" (source: the replica whose shortest sequence costs it the least
    # throughput; stops only when no replica has an improving move). docs/design.md compares them.
    migration: Literal["paper", "least_loss"] = "paper"
    rule_high_kv: float = 0.8    # rule-based ablation: shift up above this KV utilisation
    rule_low_kv: float = 0.1     # ... and shift down below this one
    # Initial (and, for fixed paradigms, permanent) devices per role.
    initial_rollout_devices: int = 0
    initial_reward_devices: int = 0
    # `pivotrl profile throughput` output (YAML with policy/genrm A-D); empty: fit online.
    throughput_profile: str = ""
    # The planner's tau_shift follows the shifts' measured seconds (False: the configured
    # shift_seconds_* for the whole job, as the paper's planner treats it: a constant)
    measured_tau: bool = True
    # Beyond the paper (sched/tail.py): the last this many judgements of a batch to reach
    # reward (its longest responses') each decode on a replica emptied for it. 0: off,
    # Dispatch as the paper.
    tail_isolation: int = 0
    # Beyond the paper (sched/partial.py): a step trains the complete GRPO groups due first,
    # each by its deadline (admission version + rl.staleness), not the batch fixed at
    # admission; unfinished ones run on into a later step. False: the paper's batches.
    partial_rollout: bool = False


@dataclass
class ThroughputConstants:
    """T = N_seq / (A * N_tok + max(B, C * N_seq) + D), seconds per decoding step."""
    A: float = 1e-7
    B: float = 0.01
    C: float = 1e-4
    D: float = 0.002


@dataclass
class ThroughputConfig:
    policy: ThroughputConstants = field(default_factory=ThroughputConstants)
    genrm: ThroughputConstants = field(default_factory=ThroughputConstants)
    # Seconds a replica spends prefilling one token: a prompt at admission, a migrated
    # sequence's prompt + generated tokens where it lands. The planner charges it to a
    # candidate's migrations (plan/evaluate.py); 0: not charged. `pivotrl simulate` sets
    # it from the hardware profile (sim/profile.py) for the run.
    prefill_s_per_token_policy: float = 0.0
    prefill_s_per_token_genrm: float = 0.0


@dataclass
class CalibrationConfig:
    """Simulator only: the fit of `pivotrl reproduce calibrate` to the paper's baselines
    (configs/calibration/, docs/calibration.md), applied over the hardware profile's
    datasheet derivation (sim/profile.py). 1.0 and 0.0 keep the datasheet's."""
    policy_scale: float = 1.0     # the policy's A-D and prefill seconds over the datasheet's
    genrm_scale: float = 1.0      # the GenRM's
    train_scale: float = 1.0      # training seconds a token over the datasheet's
    # seconds of one shift per role (the paper's Figure 12); 0: the datasheet's derivation
    shift_up_s_rollout: float = 0.0
    shift_up_s_reward: float = 0.0
    shift_up_s_training: float = 0.0
    shift_down_s_rollout: float = 0.0
    shift_down_s_reward: float = 0.0
    shift_down_s_training: float = 0.0


@dataclass
class GPSLinksConfig:
    """What the agents' replication plans weigh transfers by (`pivotrl profile links`
    measures them): bytes/s of a node-local copy and of a node-to-node pull, and the fixed
    seconds of one transfer."""
    local_bps: float = 10e9
    remote_bps: float = 2e9
    overhead_s: float = 20e-6


@dataclass
class GPSConfig:
    memory_budget_gb: float = 0.0   # per node; 0 = everything that /dev/shm allows
    transport: Transport = "nixl"
    links: GPSLinksConfig = field(default_factory=GPSLinksConfig)


@dataclass
class DataConfig:
    """RL prompts (pivotrl_hpc.task.data): veRL/DAPO-schema parquet (DAPO-Math-17k, AIME24),
    JSONL with the same keys, or the project's synthetic set (no file)."""
    train: str = ""
    validation: str = ""          # evaluated every rl.eval_every steps ("" : none)
    # auto: by the file's suffix (.parquet, .jsonl); synthetic: generated, no file
    format: Literal["auto", "parquet", "jsonl", "synthetic"] = "auto"
    prompt_key: str = "prompt"    # a column of chat messages (or a plain string)
    answer_key: str = "reward_model.ground_truth"   # dotted path into the row
    # model: each folder's own chat template (an error if it has none); none: the raw text
    chat_template: Literal["model", "none"] = "model"
    # a prompt longer than models.policy.max_prompt_len: filter (dropped, counted in the log
    # and the summary, as veRL's filter_overlong_prompts) or reject (stop before the job)
    overlong: Literal["filter", "reject"] = "filter"
    synthetic_train: int = 512    # rows of the synthetic set (format: synthetic)
    synthetic_validation: int = 64
    # A malformed row: "error" stops before the job starts (file, row and key named),
    # "skip" leaves it out and logs how many were skipped.
    on_bad_line: Literal["error", "skip"] = "error"


@dataclass
class RewardWeights:
    """R = verifiable x R_verifiable + genrm x R_GenRM; the paper's R is the plain sum."""
    verifiable: float = 1.0
    genrm: float = 1.0


@dataclass
class RewardConfig:
    """R = R_verifiable + R_GenRM (paper §8.1; pivotrl_hpc.task.rewards, task.judge)."""
    # dapo (DAPO's "Answer:" rule, +1/-1), math_verify, or the user's veRL compute_score as
    # module:function or path/to/file.py:function
    verifiable: str = "dapo"
    # the judge prompt: a GenRM family (glm-z1, qwen3, qwen3.5, tiny) or a template file with
    # {problem}, {response}, {ground_truth}
    genrm_template: str = "tiny"
    # how the score is read after the thinking: auto (the family's rule; boxed for a file),
    # boxed (\boxed{x} x genrm_scale), yesno, or regex (genrm_regex's first group x scale)
    genrm_parse: Literal["auto", "boxed", "yesno", "regex"] = "auto"
    genrm_scale: float = 0.0      # 0: the family's (0.1 for a 0-10 boxed score)
    genrm_regex: str = ""
    genrm_default: float = 0.0    # the score of an unparseable or truncated judgement
    genrm_thinking: bool = True   # enable_thinking, where the GenRM's chat template takes it
    # a verifiable reward function that raises on a response: "raise" ends the job naming
    # the function, the sample and its data source; "default" scores that response
    # `verifiable_default` (not correct), logs it and counts it (summary: reward_fn_errors)
    on_error: Literal["raise", "default"] = "raise"
    verifiable_default: float = 0.0
    weights: RewardWeights = field(default_factory=RewardWeights)


LOGGERS = ("console", "tensorboard", "wandb")   # trace.loggers' choices (trace/loggers.py)
# reward.genrm_template's family names (or a file): task/judge.py's FAMILIES
GENRM_FAMILIES = ("glm-z1", "qwen3", "qwen3.5", "tiny")


@dataclass
class TraceConfig:
    path: str = "out/trace.h5"
    log_interval_s: float = 5.0   # one progress line per interval
    # also write each RL step's metrics as TensorBoard scalars, in <trace>.tensorboard/
    tensorboard: bool = False
    # Where step metrics go besides the trace (veRL's trainer.logger): console (the log),
    # tensorboard (as `tensorboard: true`), wandb (the optional extra; WANDB_MODE=offline
    # keeps it off the network). docs/trace.md maps the names to veRL's.
    loggers: list[str] = field(default_factory=lambda: ["console"])   # of LOGGERS
    # The texts of trained and evaluated samples kept in the trace's `samples` table
    # (`pivotrl trace samples RUN`): "all", "none", or N per step (and per evaluation)
    samples: int | str = 4
    # the run folder (the trace's, its .logs and .checkpoints) may be group-writable: an
    # explicit opt-in for a folder a group shares on purpose (docs/security.md, issue 46);
    # the run's files are then 0640 and its folders 0750 (else 0600 and 0700), any umask
    group_shared: bool = False


# resume values that name no checkpoint (launch.resume.ASIDE is "fresh_aside")
RESUME_KEYWORDS = ("auto", "false", "", "fresh_aside")


def names_a_path(resume: bool | str) -> bool:
    """Whether `resume` names a checkpoint (a path), rather than auto / false / afresh."""
    return isinstance(resume, str) and resume not in RESUME_KEYWORDS


def resumed_from(cfg: Any) -> str:
    """The checkpoint folder this job resumes from, once the launch resolved `resume` to
    one (launch.entry); "" for a fresh start or an unresolved setting."""
    r = getattr(cfg, "resume", "")
    return r if names_a_path(r) else ""


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    paradigm: ParadigmConfig = field(default_factory=ParadigmConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    gps: GPSConfig = field(default_factory=GPSConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    # Where the job starts: "auto" (or true) continues from the run's newest whole checkpoint
    # if it has one (a run already at rl.steps: nothing to do, exit 0); false starts afresh,
    # refused where an earlier run of this trace left its trace or checkpoints;
    # "fresh_aside" moves such a run intact to old-<time>/ beside it and starts afresh; a
    # path names a checkpoint (or a run to take the newest of). The launch resolves it: the
    # ranks see the checkpoint folder or "".
    resume: bool | str = "auto"

    @property
    def total_devices(self) -> int:
        return self.cluster.nodes * self.cluster.devices_per_node
