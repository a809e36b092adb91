"""`pivotrl trace check TRACE...`: the invariants of docs/trace.md on a trace, one line each;
exit 0 when every one holds, 1 on any violation, 2 when a trace cannot be read.
`pivotrl trace samples RUN [--step S] [--unparsed]`: the kept samples' texts for a person."""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from pivotrl_hpc.terminal import safe


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    c = sub.add_parser("check", help="check a trace's invariants (docs/trace.md)",
                       description="check a trace's invariants (docs/trace.md)")
    c.add_argument("traces", nargs="+", metavar="TRACE", help="HDF5 trace(s), live or simulated")
    s = sub.add_parser("samples", help="print the samples a run kept (trace.samples)",
                       description="print the prompts, responses, judgements and rewards "
                                   "of the samples a run kept (trace.samples), every "
                                   "segment of a resumed run")
    s.add_argument("run", metavar="RUN", help="the run's trace (x.h5; its x.segN.h5 too)")
    s.add_argument("--step", type=int, help="only this step (evaluations: the steps "
                                            "trained before it)")
    s.add_argument("--unparsed", action="store_true",
                   help="only samples whose GenRM judgement gave no score")
    s.add_argument("--kind", choices=("train", "eval"), help="only trained or evaluated ones")


def main(args: argparse.Namespace) -> int:
    if args.trace_command == "samples":
        return samples(args)
    from pivotrl_hpc.trace.check import check

    worst = 0
    for path in map(Path, args.traces):
        results = _read("check", path, check)
        if results is None:
            return 2
        print(f"{path}:")
        for r in results:
            print(f"  {r.line()}")
        worst = max(worst, 0 if all(r.ok for r in results) else 1)
    return worst


def _read(command: str, path: Path, reader):
    """reader(path), or None after one line on stderr naming what is wrong with `path`."""
    if not path.is_file():
        print(f"pivotrl trace {command}: no trace at {path}", file=sys.stderr)
        return None
    try:
        return reader(path)
    except (OSError, KeyError, ValueError) as e:
        print(f"pivotrl trace {command}: {path} is not a readable trace: {e}", file=sys.stderr)
        return None


def read_samples(run: Path) -> list[dict]:
    """The `samples` rows of every segment of the run, in order."""
    from pivotrl_hpc.checkpoint.layout import segments
    from pivotrl_hpc.trace import open_trace

    rows = []
    for path in segments(run) or [run]:
        with open_trace(path) as t:
            if "samples" not in t.tables:
                raise ValueError(f"{path} was written before traces kept samples")
            cols = t.table("samples")
            rows += [{c: cols[c][i] for c in cols} for i in range(t.rows("samples"))]
    return rows


def samples(args: argparse.Namespace) -> int:
    run = Path(args.run)
    if not run.is_file() and run.with_suffix(".h5").is_file():
        run = run.with_suffix(".h5")
    rows = _read("samples", run, read_samples)
    if rows is None:
        return 2
    shown = [r for r in rows if (args.step is None or r["step"] == args.step)
             and (not args.unparsed or r["parse"] in ("unparsed", "truncated"))
             and (args.kind is None or r["kind"] == args.kind)]
    for r in shown:
        print(describe(r))
    print(f"{len(shown)} of {len(rows)} kept samples", file=sys.stderr)
    return 0


def describe(r: dict) -> str:
    """One sample for a person: a header line, then each text indented. The texts and the
    data source are a dataset's and a model's: their control characters and bidi overrides
    are shown escaped (terminal.safe), so no text drives the terminal or forges a header."""
    if r["kind"] == "train":
        head = (f"step {r['step']} train, sample {r['sample']}, policy v{r['version']}: "
                f"reward {r['reward']:.3f} = verifiable {r['verifiable']:.3f} + GenRM "
                f"{r['genrm']:.3f} ({r['parse'] or 'no judgement'})")
    else:
        head = (f"evaluation after {r['step']} steps, sample {r['sample']}: "
                f"{'correct' if r['correct'] == 1 else 'wrong'}")
    source = safe(r["data_source"], lines=False)
    lines = [f"== {head}" + (f" [{source}]" if source else "")]
    for name, tokens in (("prompt", r["prompt_tokens"]), ("response", r["response_tokens"]),
                         ("judgement", r["judge_tokens"])):
        if name == "judgement" and r["kind"] != "train":
            continue
        text = safe(r[name]) if isinstance(r[name], str) else ""
        lines.append(f"  {name} ({tokens} tokens):")
        lines.append(textwrap.indent(text.rstrip() or "(empty)", "    | "))
    return "\n".join(lines)
