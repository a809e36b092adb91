"""Segment headers are validated strictly (issue: GPS under faults, finding 7): a header that
lies about its length, its offsets, shapes or dtypes gives SegmentError naming the file and
the tensor, never another exception, a hang, or a tensor view outside its bytes."""
from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl_hpc.gps.segment import DTYPES, Header, SegmentError, itemsize

SPECS = [("a", "F32", (4, 3)), ("b", "BF16", (5,)), ("c", "I64", (2, 2, 2))]


def _file(body: dict, data: int = 1024, declared: int | None = None) -> bytes:
    raw = json.dumps(body).encode()
    n = len(raw) if declared is None else declared
    return struct.pack("<Q", n) + raw + b"\0" * data


def _valid_body() -> dict:
    h = Header.build(SPECS, {"model": "m"})
    return {"__metadata__": {"model": "m"}, **{
        t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.start, t.stop]}
        for t in h.tensors.values()}}


def test_a_valid_header_round_trips():
    h = Header.build(SPECS, {"model": "m"})
    buf = h.encode() + b"\0" * (h.total_bytes - h.data_start)
    assert Header.parse(buf) == h


@pytest.mark.parametrize("edit,message", [
    (lambda b: b["a"].update(data_offsets=[-8, 40]), "data_offsets [-8, 40]"),
    (lambda b: b["a"].update(data_offsets=[0, 44]), "44 bytes for shape [4, 3] of F32 (48"),
    (lambda b: b["b"].update(data_offsets=[40, 50]), "overlaps"),
    (lambda b: b["a"].update(shape=[4, -3]), "shape [4, -3]"),
    (lambda b: b["a"].update(dtype="F8"), "dtype 'F8'"),
    (lambda b: b["c"].update(data_offsets=[2**62 - 64, 2**62]), "data_offsets"),
    (lambda b: b.update(__metadata__={"x": 1}), "__metadata__"),
    (lambda b: b.update(d="nope"), "tensor 'd': entry is not an object"),
])
def test_each_lie_is_refused_naming_the_tensor(edit, message):
    body = _valid_body()
    edit(body)
    with pytest.raises(SegmentError, match="seg-x") as e:
        Header.parse(_file(body), where="seg-x")
    assert message in str(e.value)


def test_lengths_beyond_the_file_are_refused():
    with pytest.raises(SegmentError, match="header length 9223372036854775808 exceeds"):
        Header.parse(_file(_valid_body(), declared=2**63))
    body = _valid_body()
    with pytest.raises(SegmentError, match="tensors end at"):
        Header.parse(_file(body, data=10))           # data shorter than the offsets say
    with pytest.raises(SegmentError, match="shorter than the 8-byte"):
        Header.parse(b"\1\0")


def _check(h: Header, size: int) -> None:
    """What a parsed header promises: every tensor inside the file, its bytes its shape's."""
    end = 0
    for t in sorted(h.tensors.values(), key=lambda t: t.start):
        n = itemsize(t.dtype)
        for d in t.shape:
            n *= d
        assert t.stop - t.start == n and t.start >= end
        end = t.stop
    assert h.data_start + end <= size


values = st.one_of(st.integers(-2**64, 2**64), st.text(max_size=4), st.none(),
                   st.lists(st.integers(-2**63, 2**63), max_size=4),
                   st.sampled_from(sorted(DTYPES)))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_headers_give_only_the_documented_error(data):
    body = _valid_body()
    for _ in range(data.draw(st.integers(1, 4))):
        name = data.draw(st.sampled_from(["a", "b", "c", "z", "__metadata__"]))
        if name in ("z", "__metadata__") or data.draw(st.booleans()):
            body[name] = data.draw(st.one_of(values, st.dictionaries(st.text(max_size=3),
                                                                     values, max_size=3)))
        else:
            key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            if isinstance(body.get(name), dict):
                body[name][key] = data.draw(values)
    buf = bytearray(_file(body, data=data.draw(st.integers(0, 200))))
    for _ in range(data.draw(st.integers(0, 3))):          # and some raw byte damage
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    try:
        h = Header.parse(bytes(buf))
    except SegmentError:
        return
    _check(h, len(buf))


@pytest.mark.parametrize("depth", [9, 1000, 100_000])
def test_deep_nesting_is_a_segment_error_never_a_recursion_error(depth):
    """Issue 35: 159 of 3000 fuzzed headers raised RecursionError (json.loads recurses)."""
    body = _valid_body()
    raw = json.dumps(body)[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    with pytest.raises(SegmentError, match=r"seg-x: header nests deeper than 8 levels"):
        Header.parse(_file_raw(raw.encode()), where="seg-x")
    # brackets inside strings are text, not nesting: still a valid header
    body["__metadata__"]["note"] = "[" * depth
    assert Header.parse(_file(body)).metadata["note"] == "[" * depth


def _file_raw(raw: bytes, data: int = 1024) -> bytes:
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data


def test_gps_serve_on_a_deeply_nested_checkpoint_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text("{}")
    raw = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (tmp_path / "model.safetensors").write_bytes(_file_raw(raw))
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "gps", "serve", "--job",
                        "deephdr", "--node", "n0", "--model", f"policy={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "RecursionError" not in p.stderr, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("pivotrl gps serve:")]
    assert len(lines) == 1 and "nests deeper than 8 levels" in lines[0], p.stderr[-2000:]
