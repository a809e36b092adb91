"""TensorBoard event files of the per-step metrics (trace/tensorboard.py), decoded by Google's
protobuf runtime from the TensorFlow field numbers (event.proto, summary.proto), with the
TFRecord framing and both CRCs checked."""
from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
from live_util import assert_trace_ok, model_overrides

from pivotrl_hpc.config import load_config
from pivotrl_hpc.trace import TraceWriter, open_trace
from pivotrl_hpc.trace.tensorboard import crc32c, masked_crc

ROOT = Path(__file__).resolve().parents[1]


def event_class():
    """tensorflow.Event with the fields written here, built as a protobuf descriptor."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="tb_test_event.proto", package="tbtest")
    T = descriptor_pb2.FieldDescriptorProto

    def message(name, fields):
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, tname in fields:
            m.field.add(name=fname, number=number, type=ftype, label=label, type_name=tname)

    message("Value", [("tag", 1, T.TYPE_STRING, T.LABEL_OPTIONAL, None),
                      ("simple_value", 2, T.TYPE_FLOAT, T.LABEL_OPTIONAL, None)])
    message("Summary", [("value", 1, T.TYPE_MESSAGE, T.LABEL_REPEATED, ".tbtest.Value")])
    message("Event", [("wall_time", 1, T.TYPE_DOUBLE, T.LABEL_OPTIONAL, None),
                      ("step", 2, T.TYPE_INT64, T.LABEL_OPTIONAL, None),
                      ("file_version", 3, T.TYPE_STRING, T.LABEL_OPTIONAL, None),
                      ("summary", 5, T.TYPE_MESSAGE, T.LABEL_OPTIONAL, ".tbtest.Summary")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))


def read_events(folder: Path) -> list:
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    return read_event_file(files[0])


def read_event_file(path: Path) -> list:
    data, pos, Event, out = path.read_bytes(), 0, event_class(), []
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc(header)
        payload = data[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == \
            masked_crc(payload)
        out.append(Event.FromString(payload))
        pos += 16 + length
    return out


def scalars(events) -> dict[int, dict[str, float]]:
    return {e.step: {v.tag: v.simple_value for v in e.summary.value}
            for e in events if e.summary.value}


def test_crc32c_is_castagnolis():
    assert crc32c(b"123456789") == 0xE3069283   # the check value of CRC-32C (RFC 3720)
    assert crc32c(b"") == 0


def test_steps_rows_become_scalars_and_nan_is_left_out(tmp_path):
    tb = tmp_path / "run.tensorboard"
    with TraceWriter(tmp_path / "run.h5", tensorboard=tb) as w:
        w.append("steps", step=1, reward_mean=0.25, loss=-1.5, tokens=120)
        w.append("steps", step=2, reward_mean=0.5, tokens=130)           # loss not measured
        w.append("timeseries", role="rollout", devices=2)                 # not a step row
    events = read_events(tb)
    assert events[0].file_version == "brain.Event:2"
    got = scalars(events)
    assert got.keys() == {1, 2}
    assert got[1]["steps/reward_mean"] == 0.25 and got[1]["steps/loss"] == -1.5
    assert got[1]["steps/tokens"] == 120 and "steps/loss" not in got[2]
    assert not any(k in ("steps/t", "steps/step") for k in got[1])


def test_a_simulated_run_writes_the_tensorboard_of_its_steps(tiny_models, tmp_path):
    from pivotrl_hpc.sim.run import SimConstants, simulate
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      [*model_overrides(tiny_models), "rl.steps=3", "trace.tensorboard=true"])
    path = tmp_path / "sim.h5"
    simulate(cfg, SimConstants.from_config(cfg), path)
    got = scalars(read_events(path.with_suffix(".tensorboard")))
    with open_trace(str(path)) as t:
        steps = t.table("steps")
    assert sorted(got) == [int(s) for s in steps["step"]] == [0, 1, 2]
    assert_trace_ok(path)
    for i, step in enumerate(steps["step"]):
        want = float(steps["reward_mean"][i])
        assert math.isclose(got[int(step)]["steps/reward_mean"], want, rel_tol=1e-6)


def test_no_tensorboard_folder_unless_asked(tmp_path):
    with TraceWriter(tmp_path / "run.h5") as w:
        w.append("steps", step=1, reward_mean=0.25)
    assert not list(tmp_path.glob("*.tensorboard"))
    pytest.importorskip("google.protobuf")
