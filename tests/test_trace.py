"""pivotrl_hpc.trace: HDF5 run trace, written live (SWMR) and read offline."""
from __future__ import annotations

import json
import math
import selectors
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pivotrl_hpc.trace import TABLES, TRUNCATION_MARKER, TraceWriter, open_trace
from pivotrl_hpc.trace.schema import str_width


def _value(table: str, column: str, ctype: str, i: int):
    """A distinct, type-appropriate value for row i (strings include non-ASCII)."""
    if column == "t":
        return 0.25 * i
    if ctype == "float":
        return i + 0.5
    if ctype == "int":
        return 7 * i + 1
    if ctype == "json":
        return {"table": table, "i": i, "nested": [1, 2.5, None, "é"], "ok": True}
    return f"{column}-{i}-é"


def _rows(table: str, n: int) -> list[dict]:
    return [{c: _value(table, c, t, i) for c, t in TABLES[table].items()} for i in range(n)]


def test_round_trip_every_table_and_column_type(tmp_path):
    path = tmp_path / "deep" / "dir" / "run.h5"   # parent dirs are created
    meta = {"paradigm": "pivot", "config": {"gpus": 8, "lr": 1e-6}, "host": "n1"}
    with TraceWriter(path, meta) as w:
        for table in TABLES:
            for row in _rows(table, 3):
                w.append(table, **row)
            w.append(table, t=9.0)            # every other column missing -> defaults
        w.close({"steps": 3, "tokens": 12345})
    with open_trace(path) as t:
        assert t.meta == meta
        assert t.summary == {"steps": 3, "tokens": 12345}
        assert t.tables == list(TABLES)
        for table, columns in TABLES.items():
            assert t.rows(table) == 4
            got = t.table(table)
            assert list(got) == list(columns)
            for column, ctype in columns.items():
                col = got[column]
                want = [_value(table, column, ctype, i) for i in range(3)]
                assert col[:3].tolist() == want, (table, column)
                _check_default(table, column, ctype, col)


def _check_default(table: str, column: str, ctype: str, col: np.ndarray) -> None:
    last = col[3]
    if column == "t":
        assert last == 9.0 and col.dtype == np.float64
    elif ctype == "float":
        assert col.dtype == np.float64 and math.isnan(last), (table, column)
    elif ctype == "int":
        assert col.dtype == np.int64 and last == -1, (table, column)
    elif ctype == "json":
        assert col.dtype == object and last is None, (table, column)
    else:
        assert col.dtype == object and last == "" and isinstance(col[0], str), (table, column)


def test_t_defaults_to_seconds_since_writer_start(tmp_path):
    with TraceWriter(tmp_path / "t.h5", {}) as w:
        w.append("events", kind="info", message="hello")
    with open_trace(tmp_path / "t.h5") as t:
        stamp = t.table("events")["t"][0]
        assert 0.0 <= stamp < 60.0


def test_unknown_table_column_and_bad_value_raise(tmp_path):
    with TraceWriter(tmp_path / "e.h5", {}) as w:
        with pytest.raises(ValueError, match=r"'nope'.*allowed: timeseries, shifts"):
            w.append("nope", t=1.0)
        with pytest.raises(ValueError, match=r"'bogus'.*'steps'.*allowed: t, step, version"):
            w.append("steps", t=1.0, bogus=3)
        with pytest.raises(ValueError, match=r"steps\.step"):
            w.append("steps", step="three")
        with pytest.raises(ValueError, match=r"shifts\.phases"):
            w.append("shifts", phases={"x": object()})
    with open_trace(tmp_path / "e.h5") as t:
        assert t.rows("steps") == 0 and t.rows("shifts") == 0
        with pytest.raises(ValueError, match="'nope'"):
            t.table("nope")


def test_numpy_values_are_accepted(tmp_path):
    with TraceWriter(tmp_path / "n.h5", {"gpus": np.int64(8)}) as w:
        w.append("steps", step=np.int64(2), loss=np.float32(0.5))
        w.append("shifts", phases={"load": np.float32(0.25), "ranks": np.arange(3)},
                 seconds=np.float64(1.5))
    with open_trace(tmp_path / "n.h5") as t:
        assert t.meta == {"gpus": 8}
        assert t.table("steps")["step"].tolist() == [2]
        assert t.table("steps")["loss"].tolist() == [0.5]
        assert t.table("shifts")["phases"].tolist() == [{"load": 0.25, "ranks": [0, 1, 2]}]


def test_large_json_blob_round_trips_untruncated(tmp_path):
    big = {"candidates": [{"shift_down": [i], "shift_up": [i + 1], "penalty": i * 0.5,
                           "est_throughput": 1e4 + i, "benefit": -i} for i in range(9000)],
           "text": "x" * 400_000}
    assert len(json.dumps(big)) > 1_000_000
    with TraceWriter(tmp_path / "big.h5", {}) as w:
        w.append("planner", plan_id=1, snapshot={"small": 1}, candidates=big["candidates"])
        w.flush()                                    # later rows land after earlier bytes
        w.append("planner", plan_id=2, snapshot=big, candidates=[])
        w.flush()
        w.append("planner", plan_id=3, snapshot=[1, 2], candidates=[{"benefit": 1.0}])
    with open_trace(tmp_path / "big.h5") as t:
        got = t.table("planner")
    assert got["snapshot"].tolist() == [{"small": 1}, big, [1, 2]]
    assert got["candidates"].tolist() == [big["candidates"], [], [{"benefit": 1.0}]]


def test_string_longer_than_its_width_is_truncated_with_marker(tmp_path):
    width = str_width(TABLES["events"]["message"])
    long_message = "a" + "é" * width                 # 2 bytes each: the cut splits an é
    seq_width = str_width(TABLES["sequences"]["seq_id"])
    exact = "s" * seq_width
    with TraceWriter(tmp_path / "s.h5", {}) as w:
        w.append("events", kind="warning", message=long_message)
        w.append("sequences", seq_id=exact)
    with open_trace(tmp_path / "s.h5") as t:
        message = t.table("events")["message"][0]
        seq_id = t.table("sequences")["seq_id"][0]
    assert message.endswith(TRUNCATION_MARKER)
    assert len(message.encode()) <= width
    head = message[: -len(TRUNCATION_MARKER)]
    assert head == "a" + "é" * (len(head) - 1)
    assert len(head) >= width // 2 - len(TRUNCATION_MARKER)
    assert seq_id == exact                             # exactly the width: kept whole


def test_close_is_idempotent_and_appends_after_close_fail(tmp_path):
    w = TraceWriter(tmp_path / "c.h5", {"a": 1})
    w.append("events", kind="info", message="m")
    w.close({"done": True})
    w.close()
    w.close({"ignored": True})
    with pytest.raises(ValueError, match="closed"):
        w.append("events", kind="info", message="late")
    with open_trace(tmp_path / "c.h5") as t:
        assert t.summary == {"done": True} and t.rows("events") == 1


def test_context_manager_records_error_summary_and_overwrites(tmp_path):
    path = tmp_path / "x.h5"
    with TraceWriter(path, {"run": 1}) as w:
        w.append("events", kind="info", message="first run")
    with pytest.raises(RuntimeError):
        with TraceWriter(path, {"run": 2}) as w:
            w.append("steps", step=1)
            raise RuntimeError("boom")
    with open_trace(path) as t:
        assert t.meta == {"run": 2}
        assert t.rows("events") == 0 and t.rows("steps") == 1
        assert "boom" in t.summary["error"]


def test_many_rows_across_automatic_writes(tmp_path):
    with TraceWriter(tmp_path / "m.h5", {}, write_every=1000) as w:
        for i in range(10_500):
            w.append("sequences", t=i * 1e-3, seq_id=f"s{i}", event="dispatch", tokens=i,
                     version=i // 100)
            if i % 3000 == 0:
                w.flush()
    with open_trace(tmp_path / "m.h5") as t:
        seqs = t.table("sequences")
    assert seqs["tokens"].tolist() == list(range(10_500))
    assert seqs["seq_id"][-1] == "s10499" and seqs["version"][-1] == 104


# --- a second process reads while this one writes ---------------------------------------
READER = textwrap.dedent("""
    import json, sys
    from pivotrl_hpc.trace import open_trace
    t = open_trace(sys.argv[1])
    for line in sys.stdin:
        t.refresh()
        steps = t.table("steps")
        shifts = t.table("shifts")
        print(json.dumps({"steps": t.rows("steps"), "summary": t.summary,
                          "last_step": int(steps["step"][-1]) if len(steps["step"]) else None,
                          "phases": shifts["phases"].tolist()}), flush=True)
    t.close()
""")


class _Reader:
    """The reader subprocess: ``ask()`` sends a line and waits (bounded) for its answer."""

    def __init__(self, path):
        self.proc = subprocess.Popen([sys.executable, "-c", READER, str(path)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def ask(self) -> dict:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        if not self.sel.select(timeout=120):
            raise AssertionError("reader process did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"reader process died: {self.proc.stderr.read()}")
        return json.loads(line)

    def finish(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0, self.proc.stderr.read()


def test_second_process_sees_rows_after_each_flush(tmp_path):
    path = tmp_path / "live.h5"
    w = TraceWriter(path, {"paradigm": "pivot"}, write_every=3)
    reader = _Reader(path)
    try:
        assert reader.ask() == {"steps": 0, "summary": None, "last_step": None, "phases": []}
        for step in range(5):                      # some written (write_every=3), none flushed
            w.append("steps", t=float(step), step=step, tokens=100)
        assert reader.ask()["steps"] == 0
        w.flush()
        assert reader.ask()["steps"] == 5
        phases = {"release": 1.5, "load": {"bytes": 10**6}}
        for step in range(5, 1005):
            w.append("steps", t=float(step), step=step, tokens=100)
        w.append("shifts", plan_id=1, direction="up", phases=phases)
        w.flush()
        seen = reader.ask()
        assert seen == {"steps": 1005, "summary": None, "last_step": 1004, "phases": [phases]}
        w.close({"steps": 1005})
        assert reader.ask()["summary"] == {"steps": 1005}
        reader.finish()
    finally:
        w.close()
        if reader.proc.poll() is None:
            reader.proc.kill()
            reader.proc.wait()


def test_importing_trace_loads_no_heavy_module():
    code = ("import json, sys, pivotrl_hpc.trace\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'vllm', 'mpi4py', 'megatron', 'nixl', 'yaml', 'h5py'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["h5py"]      # the probe sees what is imported
