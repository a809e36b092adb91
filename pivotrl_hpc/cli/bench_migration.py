"""`pivotrl bench migration --model DIR [--json]`: per-sequence seconds of a migration
(paper Table 3: Abort, Dispatch, re-prefill), on a real vLLM engine and the real scheduler.

One engine runs `--running` sequences of `--prompt-len` prompt tokens for `--generated`
decode steps; then, each round, `--migrate` of them are aborted (Abort: `engine.abort`),
sent through Dispatch (the scheduler's `dispatch` over `--replicas` replicas already
holding sequences, then the engine's `add`, which is what a destination does with an
AddSequences) and stepped once: that step's excess over a plain decode step is the
re-prefill of their prompt and generated tokens. Medians over `--rounds`; one JSON object:
{"abort_s", "dispatch_s": {"scheduler", "engine_add"}, "re_prefill_s", "total_s"} per
sequence, the decode step, and the paper's ranges beside them. Here Dispatch has no queue to
wait in; the paper's 0.22-1.03 s includes its queue waiting.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

PAPER = {"abort_s_below": 0.19, "re_prefill_s_below": 0.19, "dispatch_s": (0.22, 1.03),
         "total_s_below": 1.18}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=Path(".run/models/policy"))
    p.add_argument("--running", type=int, default=16, help="sequences on the engine")
    p.add_argument("--migrate", type=int, default=8, help="sequences moved a round")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--generated", type=int, default=32, help="decode steps before moving")
    p.add_argument("--replicas", type=int, default=16, help="replicas Dispatch chooses among")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")


def _scheduler(replicas: int, per_replica: int):
    from pivotrl_hpc.sched.model import ThroughputModel
    from pivotrl_hpc.sched.scheduler import Scheduler
    from pivotrl_hpc.sched.state import Replica, Sequence

    sched = Scheduler(ThroughputModel(A=1e-7, B=0.01, C=1e-4, D=0.002))
    for r in range(replicas):
        sched.add_replica(Replica(f"r{r}", 1 << 20, [Sequence(10_000 * r + i, 64, 32)
                                                    for i in range(per_replica)]))
    return sched


def budget(generated: int, rounds: int) -> int:
    """Tokens a sequence may generate: the steps before moving, two a round, and room."""
    return generated + 2 * rounds + 4


def measure(engine, running: int = 16, migrate: int = 8, prompt_len: int = 64,
            generated: int = 32, replicas: int = 16, rounds: int = 5, seed: int = 0) -> dict:
    from pivotrl_hpc.protocol.engine import Sampling
    from pivotrl_hpc.sched.state import Sequence

    rng = random.Random(seed)
    greedy = Sampling(temperature=0.0, ignore_eos=True)
    for i in range(running):
        engine.add(str(i), [rng.randrange(1, 400) for _ in range(prompt_len)], [],
                   budget(generated, rounds), greedy)
    for _ in range(generated):
        engine.step()
    abort, sched_s, add_s, prefill, decode = [], [], [], [], []
    resumed = True   # every moved sequence produced a token in the step after its re-add
    sched = _scheduler(replicas, running)
    try:
        for r in range(rounds):
            decode.append(engine.step().seconds)
            ids = [str(i) for i in rng.sample(range(running), migrate)]
            t0 = time.perf_counter()
            moved = engine.abort(ids)
            abort.append(time.perf_counter() - t0)
            for a in moved:
                sched.submit(Sequence(1_000_000 * (r + 1) + int(a.seq_id), len(a.prompt_ids),
                                      len(a.generated_ids)))
            t0 = time.perf_counter()
            sched.dispatch()
            sched_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for a in moved:
                engine.resume(a)
            add_s.append(time.perf_counter() - t0)
            out = engine.step()
            prefill.append(out.seconds)
            resumed &= set(ids) <= {p.seq_id for p in out.progress}
    finally:
        engine.abort(None)
    per = {k: statistics.median(v) / migrate for k, v in
           (("abort", abort), ("scheduler", sched_s), ("add", add_s))}
    per["re_prefill"] = max(0.0, statistics.median(prefill) - statistics.median(decode)) \
        / migrate
    return {"abort_s": per["abort"],
            "dispatch_s": {"scheduler": per["scheduler"], "engine_add": per["add"]},
            "re_prefill_s": per["re_prefill"],
            "total_s": per["abort"] + per["scheduler"] + per["add"] + per["re_prefill"],
            "decode_step_s": statistics.median(decode), "migrated": migrate,
            "running": running, "tokens_each": prompt_len + generated, "replicas": replicas,
            "rounds": rounds, "resumed": resumed, "paper": PAPER}


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.engines.vllm import VLLMEngine
    from pivotrl_hpc.protocol.engine import EngineOptions

    if not (args.model / "config.json").is_file():
        print(f"pivotrl bench migration: {args.model} is not a HF model folder "
              "(`pivotrl init-models .run/models` makes the tiny ones)", file=sys.stderr)
        return 2
    if not 0 < args.migrate <= args.running:
        print("pivotrl bench migration: --migrate must be within 1..--running",
              file=sys.stderr)
        return 2
    need = args.prompt_len + budget(args.generated, args.rounds)
    options = EngineOptions(max_model_len=max(512, need), kv_cache_memory_bytes=64 * 2**20)
    with VLLMEngine(args.model, options) as engine:
        result = measure(engine, args.running, args.migrate, args.prompt_len, args.generated,
                         args.replicas, args.rounds)
    print(json.dumps(result, indent=1))
    return 0
