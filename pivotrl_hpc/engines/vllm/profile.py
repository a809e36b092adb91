"""Profile a real engine's inter-token latency and fit the throughput model (paper §6.1, app. A).

For every grid point (N_seq sequences with prompts of P tokens) the engine prefills the
batch, then times pure decode steps: each emits one token per sequence, so the step's wall
time is the inter-token latency L at N_token = the tokens the batch holds. The samples are
fitted to `L = A·N_token + max(B, C·N_seq) + D` by `pivotrl_hpc.sched.fit`.
"""
from __future__ import annotations

import logging
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc.engines.vllm.backend import model_config
from pivotrl_hpc.engines.vllm.engine import VLLMEngine
from pivotrl_hpc.protocol.engine import Sampling
from pivotrl_hpc.sched.fit import FitResult, ThroughputSample, fit_throughput_model

log = logging.getLogger(__name__)
GREEDY = Sampling(temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class ProfileGrid:
    seqs: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_lens: tuple[int, ...] = (16, 128, 512)
    decode_steps: int = 8      # timed steps per point; the median is kept
    warmup_steps: int = 1      # decode steps after prefill that are not timed
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.seqs or not self.prompt_lens or self.decode_steps < 1:
            raise ValueError("profile grid needs sequence counts, prompt lengths and >= 1 step")


def _fits(engine: VLLMEngine, n_seq: int, prompt_len: int, budget: int) -> bool:
    per_seq = prompt_len + budget
    state = engine.state()
    return (per_seq <= engine.options.max_model_len and n_seq <= engine.options.max_num_seqs
            and n_seq * (per_seq + state.block_size) <= state.free_kv_tokens)


def measure_point(engine: VLLMEngine, n_seq: int, prompt_len: int, grid: ProfileGrid,
                  rng: random.Random, vocab_size: int) -> ThroughputSample | None:
    """Median decode-step latency of `n_seq` sequences of `prompt_len` prompt tokens."""
    budget = grid.warmup_steps + grid.decode_steps + 2
    if not _fits(engine, n_seq, prompt_len, budget):
        log.warning("skip (%d seqs x %d tokens): exceeds the engine's capacity", n_seq, prompt_len)
        return None
    ids = [f"prof-{n_seq}-{prompt_len}-{i}" for i in range(n_seq)]
    for seq_id in ids:  # random prompts: no prefix-cache hits between sequences
        prompt = [rng.randrange(4, vocab_size) for _ in range(prompt_len)]  # past specials
        engine.add(seq_id, prompt, [], budget, GREEDY)
    try:
        started: set[str] = set()
        for _ in range(n_seq * prompt_len + 1):  # prefill, possibly in several chunks
            started.update(p.seq_id for p in engine.step().progress)
            if len(started) == n_seq:
                break
        else:
            raise RuntimeError(f"prefill of {n_seq} x {prompt_len} tokens never completed")
        for _ in range(grid.warmup_steps):
            engine.step()
        latencies, tokens = [], []
        for _ in range(grid.decode_steps):
            n_tok = engine.state().num_tokens
            out = engine.step()
            if out.num_new_tokens == n_seq and not out.finished:  # a pure decode step
                latencies.append(out.seconds)
                tokens.append(n_tok)
    finally:  # the budget outlasts the timed steps: every sequence is still running
        running = {r.seq_id for r in engine.state().running}
        engine.abort([s for s in ids if s in running])
    if not latencies:
        return None
    return ThroughputSample(n_seq, round(statistics.mean(tokens)), statistics.median(latencies))


def profile_engine(engine: VLLMEngine, grid: ProfileGrid) -> list[ThroughputSample]:
    rng = random.Random(grid.seed)
    vocab_size = model_config(engine.model_dir)["vocab_size"]
    samples = []
    for n_seq in grid.seqs:
        for prompt_len in grid.prompt_lens:
            sample = measure_point(engine, n_seq, prompt_len, grid, rng, vocab_size)
            if sample is not None:
                log.info("n_seq %3d  n_tok %6d  latency %.2f ms", sample.n_seq, sample.n_tok,
                         1e3 * sample.latency)
                samples.append(sample)
    return samples


def write_profile_yaml(path: Path, role: str, fit: FitResult,
                       samples: list[ThroughputSample], header: str) -> None:
    """Write `throughput: {role: {A, B, C, D}}` (a config fragment, see config.schema);
    the measurements and fit quality go in comments so the file stays a valid overlay."""
    import yaml

    lines = [f"# {header}",
             f"# fit over {fit.samples} samples: relative RMS error {fit.rel_rms_error:.3f}, "
             f"max {fit.rel_max_error:.3f}",
             "# samples: n_seq n_tok latency_s"]
    lines += [f"#   {s.n_seq} {s.n_tok} {s.latency:.6g}" for s in samples]
    body = yaml.safe_dump({"throughput": {role: fit.model.to_dict()}}, sort_keys=False)
    Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n" + body)


def profile_and_fit(engine: VLLMEngine, grid: ProfileGrid
                    ) -> tuple[FitResult, list[ThroughputSample]]:
    samples = profile_engine(engine, grid)
    return fit_throughput_model(samples), samples
