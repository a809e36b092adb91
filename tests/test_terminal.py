"""Text from datasets and models reaches a terminal escaped (pivotrl_hpc/terminal.py):
`pivotrl trace samples` on a real trace, the console and log lines of a real run.

The attack texts are what a dataset's author or a model's output can hold: a window title
(OSC 0), a clipboard write (OSC 52), a carriage return and cursor-up + erase-line that
overwrite the header above with a forged one, hidden text (SGR 8), the 8-bit CSI (C1 U+009B)
clearing the screen, and bidi overrides and isolates that reorder what is shown."""
from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from live_util import model_overrides
from pivotrl_hpc.terminal import SafeLogs, safe

ROOT = Path(__file__).resolve().parents[1]
ATTACK = ("\x1b]0;pwned title\x07" "\x1b]52;c;cm0gLXJmIH4=\x07"
          "\r\x1b[1A\x1b[2K== step 9 train, forged" "\x1b[8mhidden\x1b[0m" "\x9b2J"
          "\u202eevil\u202c\u2066x\u2069")
ESCAPED = ("\\x1b]0;pwned title\\x07", "\\x1b]52;c;cm0gLXJmIH4=\\x07",
           "\\x0d\\x1b[1A\\x1b[2K== step 9 train, forged", "\\x1b[8mhidden\\x1b[0m", "\\x9b2J",
           "\\u202eevil\\u202c\\u2066x\\u2069")
SOURCE = "src\x1b[31mred\u202e"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def test_every_control_character_and_bidi_override_is_shown_escaped():
    unsafe = [chr(c) for c in (*range(0x20), 0x7f, *range(0x80, 0xa0),
                               *range(0x202a, 0x202f), *range(0x2066, 0x206a))]
    assert len(unsafe) == 32 + 1 + 32 + 5 + 4
    for c in unsafe:
        kept = c in "\n\t"
        assert safe(c) == (c if kept else f"\\x{ord(c):02x}" if ord(c) < 0x100
                           else f"\\u{ord(c):04x}")
        assert safe(c, lines=False) == (f"\\x{ord(c):02x}" if ord(c) < 0x100
                                        else f"\\u{ord(c):04x}")
    text = "".join(unsafe) + ATTACK
    assert not RAW.search(safe(text)) and not RAW.search(safe(text, lines=False))
    assert "\n" not in safe(text, lines=False) and "\t" not in safe(text, lines=False)
    assert safe(safe(text)) == safe(text)   # idempotent
    plain = "Answer: 42 — é, 日本, \u200b, tab\tand\nlines"   # printable text stays as it is
    assert safe(plain) == plain
    assert "".join(ESCAPED) == safe(ATTACK)


def test_log_records_are_escaped_in_message_arguments_and_exception():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(SafeLogs())
    logger = logging.getLogger("pivotrl_hpc.test_terminal")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.warning("source %s: %d", SOURCE, 3)
        logger.info(f"f-string {ATTACK}")
        try:
            raise ValueError(f"bad row {ATTACK}")
        except ValueError:
            logger.exception("reading %s", "x\x9by")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert not RAW.search(text.replace("\n", "")), text
    assert "WARNING source src\\x1b[31mred\\u202e: 3" in text
    assert text.count("".join(ESCAPED)) == 2 and "reading x\\x9by" in text
    assert "Traceback" in text and "ValueError: bad row \\x1b]0;" in text


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def _check_samples(out: str, samples: int) -> None:
    assert not RAW.search(out.replace("\n", "")), [m.group() for m in RAW.finditer(out)][:8]
    assert sum(line.startswith("== ") for line in out.splitlines()) == samples
    for line in out.splitlines():   # every text line is indented: none can pose as a header
        assert line.startswith(("== ", "  prompt (", "  response (", "  judgement (",
                                "    | ")), line


def test_trace_samples_shows_model_output_escaped(tmp_path):
    """A trace written by the project's writer whose kept samples carry the attack in the
    prompt, the response, the judgement and the data source (a model's output and a
    dataset's), printed by the real `pivotrl trace samples`."""
    from pivotrl_hpc.trace import TraceWriter

    path = tmp_path / "run.h5"
    trace = TraceWriter(path, {})
    for i in range(3):
        trace.append("samples", t=float(i), step=0, kind="train", sample=i,
                     data_source=SOURCE, version=0, prompt=f"p{i} {ATTACK}",
                     response=f"r{i} {ATTACK}", judgement=f"j{i} {ATTACK}", parse="parsed",
                     verifiable=1.0, genrm=0.5, reward=1.5, correct=-1, prompt_tokens=5,
                     response_tokens=6, judge_tokens=7)
    trace.close({})
    p = _cli("trace", "samples", str(path))
    assert p.returncode == 0, p.stderr[-2000:]
    _check_samples(p.stdout, 3)
    assert p.stdout.count("".join(ESCAPED)) == 9
    assert p.stdout.count("[src\\x1b[31mred\\u202e]") == 3
    assert "3 of 3 kept samples" in p.stderr


def _poison(src: Path, dst: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(src).to_pylist()
    for i, r in enumerate(rows):
        r["prompt"][0]["content"] = ATTACK + r["prompt"][0]["content"]
        if i % 2:
            r["data_source"] = SOURCE
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(src)), dst)


@pytest.mark.timeout(600)
def test_a_poisoned_dataset_reaches_the_console_and_trace_samples_escaped(tiny_models,
                                                                           tmp_path):
    """A dataset whose prompts and data sources carry the attack, through a run of the real
    task (`pivotrl simulate`: the controller's log lines, validation accuracy per data
    source among them, on the console) and `pivotrl trace samples` on its trace."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.parquet", "aime-style.parquet"):
        _poison(tiny_models / "data" / name, data / name)
    over = [o for o in model_overrides(tiny_models) if not o.startswith("data.")]
    p = _cli("simulate", str(ROOT / "configs" / "tiny-cpu.yaml"), "--paradigms", "shiftable",
             "--no-search", "--out", str(tmp_path / "out"), *over,
             f"data.train={data / 'train.parquet'}",
             f"data.validation={data / 'aime-style.parquet'}", "rl.steps=2",
             "rl.eval_every=2", "rl.eval_prompts=4", "trace.samples=2",
             "models.policy.max_prompt_len=160", "models.genrm.max_prompt_len=320")
    assert p.returncode == 0, p.stderr[-3000:]
    console = p.stdout + p.stderr
    assert not RAW.search(console.replace("\n", "")), console[-2000:]
    assert "src\\x1b[31mred\\u202e 0." in console or "src\\x1b[31mred\\u202e 1." in console
    trace, = (tmp_path / "out").glob("*.h5")
    s = _cli("trace", "samples", str(trace))
    assert s.returncode == 0, s.stderr[-2000:]
    shown = int(s.stderr.split(" of ")[0])
    assert shown >= 4
    _check_samples(s.stdout, shown)
    assert s.stdout.count("".join(ESCAPED)) == shown   # each sample's prompt, escaped
    assert "[src\\x1b[31mred\\u202e]" in s.stdout
