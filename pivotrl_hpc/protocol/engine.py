"""Typed requests, progress and state exchanged between the vLLM adapter and its callers.

Sequences are identified by the caller's `seq_id`; the adapter never invents ids that leak
out. Token ids are plain ints and logprobs plain floats so that the scheduler, the RL data
flow and the trace can hold them without importing vLLM or torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """How to start one vLLM replica (policy or GenRM).

    `kv_cache_memory_bytes` fixes the KV cache size on both backends, so that free capacity
    in tokens is the same quantity the scheduler reasons about everywhere. `omp_threads` is
    the caller's CPU share on the CPU backend (one "device"); ignored on GPU.
    """

    dtype: str = "float32"
    max_model_len: int = 1024
    kv_cache_memory_bytes: int = 64 * 2**20
    tensor_parallel_size: int = 1
    seed: int = 0
    omp_threads: int = 1
    max_num_seqs: int = 256
    enforce_eager: bool = True
    # GPU only: fraction of device memory vLLM may profile against (KV bytes are fixed above).
    gpu_memory_utilization: float = 0.9
    # GPU only: the device memory the KV bytes were derived from (gps/memory.py); the
    # engine refuses a device that has less (0: not checked, an explicit KV size)
    device_memory_bytes: int = 0
    # None: vLLM's default. "external_launcher": this process is one TP rank of the engine
    # (torch world = the replica's ranks, RANK/LOCAL_RANK set; see runtime.engine_host).
    distributed_executor_backend: str | None = None
    # MoE models: experts spread whole over the replica's TP ranks (vLLM's EP = TP x DP of
    # the engine) instead of every expert split over them.
    enable_expert_parallel: bool = False

    @property
    def in_process_workers(self) -> bool:
        """Whether the model runner(s) this engine drives live in this process."""
        return (self.tensor_parallel_size == 1
                or self.distributed_executor_backend == "external_launcher")

    def __post_init__(self) -> None:
        if self.max_model_len <= 0 or self.kv_cache_memory_bytes <= 0:
            raise ValueError("max_model_len and kv_cache_memory_bytes must be positive")
        if self.tensor_parallel_size < 1 or self.omp_threads < 1 or self.max_num_seqs < 1:
            raise ValueError("tensor_parallel_size, omp_threads and max_num_seqs must be >= 1")


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one sequence; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    # Per-sequence RNG seed. A resumed sequence restarts it, so only greedy decoding
    # continues bit-identically after an abort; seeded sampling stays a valid sample.
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SeqProgress:
    """Tokens a running sequence produced since the previous `step()`."""

    seq_id: str
    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class FinishedSequence:
    """A sequence that ended: all its generated tokens (across resumes) and their logprobs."""

    seq_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "length" (budget used up) or "stop" (EOS / stop token)


@dataclass(frozen=True)
class StepOutput:
    """What one engine iteration produced.

    `progress` holds every sequence that emitted tokens this step, finished ones included,
    so that throughput accounting can sum `num_new_tokens` without double counting.
    `iterations` > 1 only from the simulator's modeled engine: that many iterations over
    the same sequences, none finishing before the last, `seconds` their sum.
    """

    progress: list[SeqProgress]
    finished: list[FinishedSequence]
    seconds: float
    iterations: int = 1

    @property
    def num_new_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.progress)


@dataclass(frozen=True)
class AbortedSequence:
    """A sequence stopped mid-flight (paper appendix C.1, Abort), with everything needed to
    resume it elsewhere: re-submitting `prompt_ids` + `generated_ids` with the remaining
    budget continues exactly where it stopped."""

    seq_id: str
    prompt_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    max_new_tokens_remaining: int
    sampling: Sampling

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated_ids)


@dataclass(frozen=True)
class RunningSequence:
    seq_id: str
    num_prompt_tokens: int
    num_generated_tokens: int
    max_new_tokens_remaining: int

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated_tokens


@dataclass(frozen=True)
class EngineState:
    """Per-replica workload as the shift-aware scheduler sees it (paper §6.1):
    N_seq, N_token and the KV capacity left, in tokens."""

    running: list[RunningSequence]
    free_kv_tokens: int
    total_kv_tokens: int
    block_size: int
    awake: bool = True

    @property
    def num_seqs(self) -> int:
        return len(self.running)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.running)
