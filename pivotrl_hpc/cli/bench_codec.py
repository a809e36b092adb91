"""`pivotrl bench codec`: what the typed wire (`protocol.messages.WORKER_WIRE`) costs against
pickle on the controller/worker hot path: the Reply to a Step (the StepOutputs of one
replica's iterations) and an AddSequences, encoded + decoded, microseconds and bytes.

One JSON object on stdout. Both sides in the same process, one after the other, best of
`--repeat` rounds of `--number` calls (a shared machine's noise only adds).
"""
from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from typing import Any, Callable

from pivotrl_hpc.protocol.engine import FinishedSequence, Sampling, SeqProgress, StepOutput
from pivotrl_hpc.protocol.messages import (WORKER_WIRE, AddSequences, Reply, RoleKind,
                                           SeqRequest)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, default=128, help="sequences running on the replica")
    p.add_argument("--finished", type=int, default=4, help="sequences finishing in the Step")
    p.add_argument("--response", type=int, default=1024, help="tokens of a finished response")
    p.add_argument("--prompt", type=int, default=256, help="tokens of a prompt")
    p.add_argument("--iterations", type=int, default=1, help="engine iterations per Step")
    p.add_argument("--number", type=int, default=200)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)


def step_reply(args, rng: random.Random) -> Reply:
    def ids(n: int) -> list[int]:
        return [rng.randrange(151_000) for _ in range(n)]

    def lps(n: int) -> list[float]:
        return [-rng.expovariate(2.0) for _ in range(n)]

    outputs = []
    for _ in range(args.iterations):
        progress = [SeqProgress(f"rollout-{i}", ids(1), lps(1)) for i in range(args.seqs)]
        finished = [FinishedSequence(f"rollout-{i}", ids(args.prompt), ids(args.response),
                                     lps(args.response), "stop") for i in range(args.finished)]
        outputs.append(StepOutput(progress, finished, rng.uniform(0.02, 0.05)))
    return Reply("Step", True, RoleKind.ROLLOUT, 0, result=outputs)


def add_command(args, rng: random.Random) -> AddSequences:
    sampling = Sampling(temperature=1.0, seed=rng.randrange(2**31))
    return AddSequences(tuple(SeqRequest(f"rollout-{i}", tuple(rng.randrange(151_000)
                                                                for _ in range(args.prompt)),
                                         max_new_tokens=args.response, sampling=sampling)
                              for i in range(args.seqs)))


def best_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def measure(message: Any, number: int, repeat: int) -> dict[str, float]:
    ours, theirs = WORKER_WIRE.encode(message), pickle.dumps(message, protocol=5)
    assert WORKER_WIRE.decode(ours) == message
    # this process's own bytes of a line above: the baseline the codec replaced
    loads_us = best_us(lambda: pickle.loads(theirs), number, repeat)  # noqa: S301
    out = {
        "codec_bytes": len(ours), "pickle_bytes": len(theirs),
        "codec_encode_us": best_us(lambda: WORKER_WIRE.encode(message), number, repeat),
        "codec_decode_us": best_us(lambda: WORKER_WIRE.decode(ours), number, repeat),
        "pickle_dumps_us": best_us(lambda: pickle.dumps(message, protocol=5), number, repeat),
        "pickle_loads_us": loads_us,
    }
    out["codec_round_trip_us"] = out["codec_encode_us"] + out["codec_decode_us"]
    out["pickle_round_trip_us"] = out["pickle_dumps_us"] + out["pickle_loads_us"]
    out["ratio"] = out["codec_round_trip_us"] / out["pickle_round_trip_us"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    report = {"bench": "codec", "seqs": args.seqs, "finished": args.finished,
              "response": args.response, "prompt": args.prompt, "iterations": args.iterations,
              "step_reply": measure(step_reply(args, rng), args.number, args.repeat),
              "add_sequences": measure(add_command(args, rng), args.number, args.repeat)}
    print(json.dumps(report))
    return 0
