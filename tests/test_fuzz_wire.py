"""Hostile bytes for the typed decoders: the job's messages (`protocol/wire.py`) and the
checkpoint tree reader (`checkpoint/treefile.py`).

- a message's fields are checked against their type hints when it is decoded: a wrong type
  (a string of digits for an int, a bool for an int, NaN for a float, a dict where a command
  is due, a message of another type nested) is a WireError naming the message and the field;
  arbitrary JSON in every field of every message type (hypothesis) decodes to well-typed
  fields or raises WireError, nothing else;
- a decoded SaveCheckpoint still writes only into a staging folder of the run's checkpoints
  folder the worker was told at start (`/root/.ssh` is refused);
- any tree header (arbitrary JSON, nested thousands deep, tags of the wrong shape,
  unhashable keys) and any damaged tree file load or raise TreeFileError (a CheckpointError),
  never RecursionError, TypeError or KeyError;
- the same bytes crafted by the real `nobody` (system Python, standard library only).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import tempfile
import typing
from pathlib import Path, PurePath
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl_hpc.checkpoint import treefile
from pivotrl_hpc.checkpoint.layout import CheckpointError
from pivotrl_hpc.protocol import messages as m
from pivotrl_hpc.protocol.messages import WORKER_WIRE, Command, Reply
from pivotrl_hpc.protocol.wire import WireError
from pivotrl_hpc.runtime.host_forker import FORKER_WIRE
from pivotrl_hpc.runtime.host_wire import HOST_WIRE

EXAMPLES = settings(max_examples=500, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
NOBODY = 65534

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=10)
WIRE_TYPES = [(codec, cls) for codec in (WORKER_WIRE, HOST_WIRE, FORKER_WIRE)
              for cls in codec.types]


@pytest.mark.parametrize("data, why", [
    (b'{"__t": "Step", "iterations": "' + b"9" * 4000 + b'"}',
     r"bad Step: field 'iterations' is a str \('9999"),
    (b'{"__t": "Step", "iterations": true}', r"bad Step: field 'iterations' is a bool"),
    (b'{"__t": "Step", "iterations": 2.0}', r"bad Step: field 'iterations' is a float"),
    (b'{"__t": "WaitWrite", "timeout_s": NaN}', r"field 'timeout_s' is a float \('nan'\), not "
                                                 r"finite float"),
    (b'{"__t": "WaitWrite", "timeout_s": -Infinity}', r"'timeout_s' is a float \('-inf'\)"),
    (b'{"__t": "WaitWrite", "timeout_s": ' + str(2**60).encode() + b"}", r"'timeout_s' is an "
                                                                         r"int"),
    (b'{"__t": "SaveCheckpoint", "folder": ["/root/.ssh"], "version": 1}',
     r"bad SaveCheckpoint: field 'folder' is a list"),
    (b'{"__t": "SaveCheckpoint", "folder": "/x", "version": "1"}', r"field 'version' is a str"),
    (b'{"__t": "ShiftUp", "role": "rollout", "version": 1.5}', r"field 'version' is a float"),
    (b'{"__t": "Abort", "seq_ids": [1]}', r"bad Abort: field 'seq_ids' \[0\] is an int"),
    (b'{"__t": "AddSequences", "seqs": [{"__t": "Step"}]}', r"\[0\] is a Step .*not SeqRequest"),
    (b'{"__t": "AddSequences", "seqs": [{"__t": "SeqRequest", "seq_id": "a", "prompt_ids": '
     b'[1, "2"]}]}', r"bad SeqRequest: field 'prompt_ids' \[1\] is a str"),
    (b'{"__t": "TrainStep", "batch": null, "publish": 1}', r"field 'publish' is an int"),
    (b'{"__t": "Reply", "command": "Step", "ok": true, "role": "idle", "replica": 0, '
     b'"phases": {"load": Infinity}}', r"bad Reply: field 'phases' \['load'\] is a float"),
    (b'{"__t": "Sampling", "temperature": "hot"}', r"bad Sampling: field 'temperature'"),
    (b'{"__t": "TrainBatch", "prompts": [[1]], "responses": [[2]], "logprobs": [[NaN]], '
     b'"rewards": [1.0], "group_ids": [0]}', r"field 'logprobs' \[0\] \[0\] is a float"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_message_and_field(data, why):
    with pytest.raises(WireError, match=why):
        WORKER_WIRE.decode(data)


def test_a_message_of_the_wrong_kind_is_refused_where_one_is_expected():
    with pytest.raises(WireError, match=r"a dict where ShiftUp \| ShiftDown \| Prepare"):
        WORKER_WIRE.decode(b'{"iterations": 9}', expect=Command)
    reply = WORKER_WIRE.encode(Reply("Step", True, m.RoleKind.IDLE, 0))
    with pytest.raises(WireError, match="a Reply where ShiftUp"):
        WORKER_WIRE.decode(reply, expect=Command)
    with pytest.raises(WireError, match="a list where Reply was expected"):
        WORKER_WIRE.decode(b"[]", expect=Reply)
    assert WORKER_WIRE.decode(WORKER_WIRE.encode(m.Step(3)), expect=Command) == m.Step(3)


def _conforms(value, hint) -> bool:
    """An independent reading of `hint` (not the codec's): does `value` match it?"""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    if hint in (int, str, bool, bytes):
        return type(value) is hint
    if hint is type(None):
        return value is None
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_conforms(value, a) for a in args)
    if origin in (list, tuple) and (len(args) == 1 or args[1:] == (Ellipsis,)):
        return type(value) is origin and all(_conforms(v, args[0]) for v in value)
    if origin is tuple:
        return type(value) is tuple and len(value) == len(args) and all(
            _conforms(v, a) for v, a in zip(value, args))
    if origin is dict:
        return type(value) is dict and all(_conforms(k, args[0]) and _conforms(v, args[1])
                                           for k, v in value.items())
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return isinstance(value, PurePath)
    return isinstance(value, hint)


@EXAMPLES
@given(which=st.integers(0, len(WIRE_TYPES) - 1), field_value=json_values,
       extra=st.booleans())
def test_any_json_in_any_field_decodes_well_typed_or_raises_wire_error(which, field_value,
                                                                      extra):
    codec, cls = WIRE_TYPES[which]
    fields = dataclasses.fields(cls)
    message = {"__t": cls.__name__}
    if fields:
        message[fields[len(str(field_value)) % len(fields)].name] = field_value
    if extra:
        message["evil"] = 1
    try:
        got = codec.decode(json.dumps(message).encode())
    except WireError:
        return
    hints = typing.get_type_hints(cls)
    assert isinstance(got, cls) and all(_conforms(getattr(got, f.name), hints[f.name])
                                        for f in fields), got


@EXAMPLES
@given(cmd=st.sampled_from([m.Step(4), m.WaitWrite(2.5), m.SaveCheckpoint("/c/.step-1.tmp", 1),
                            m.Abort(("a", "b")), m.ShiftUp(m.RoleKind.ROLLOUT, 1, 3)]),
       cut=st.integers(0, 200), byte=st.integers(0, 255))
def test_damaged_commands_decode_well_typed_or_raise_wire_error(cmd, cut, byte):
    data = bytearray(WORKER_WIRE.encode(cmd))
    data[cut % len(data)] = byte
    try:
        got = WORKER_WIRE.decode(bytes(data), expect=Command)
    except WireError:
        return
    hints = typing.get_type_hints(type(got))
    assert all(_conforms(getattr(got, f.name), hints[f.name]) for f in dataclasses.fields(got))


def test_save_checkpoint_writes_only_into_the_runs_staging_folders(tmp_path):
    """A well-typed SaveCheckpoint names a folder; the worker takes only a `.step-N.tmp` of
    the checkpoints folder it was told at start, before touching anything."""
    from pivotrl_hpc.runtime.checkpoint import save

    root = tmp_path / "run.checkpoints"
    worker = SimpleNamespace(trainer=None, spec=SimpleNamespace(
        checkpoints=str(root), group_shared=False, training_place=None))
    for folder in ("/root/.ssh", f"{root}/.step-000001.tmp/../../../root/.ssh",
                   str(root / "step-000001"), str(tmp_path / ".step-000001.tmp")):
        cmd = WORKER_WIRE.decode(WORKER_WIRE.encode(m.SaveCheckpoint(folder, 1)))
        with pytest.raises(CheckpointError, match="refused: not a staging folder"):
            save(worker, cmd.folder, cmd.version)
    with pytest.raises(RuntimeError, match="before the trainer was built"):
        save(worker, str(root / ".step-000001.tmp"), 1)   # the folder passes


# ---- the tree reader -------------------------------------------------------------------------
def _tree_file(path: Path, tree_json: str, tensors: dict | None = None) -> Path:
    from safetensors.torch import save_file

    save_file(tensors or {}, str(path), metadata={treefile.FORMAT_KEY: treefile.FORMAT,
                                                  treefile.TREE_KEY: tree_json})
    return path


tags = st.sampled_from(["d", "t", "x", "f", "y"])
tree_nodes = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(tags, inner, min_size=1, max_size=2),
                            st.builds(lambda k, v: {"d": [[k, v]]}, inner, inner),
                            st.builds(lambda v: {"x": v}, st.sampled_from(["t0", "t9", 0]))),
    max_leaves=12)


@EXAMPLES
@given(tree=tree_nodes)
def test_any_tree_header_loads_or_raises_tree_file_error(tmp_path_factory, tree):
    import torch

    path = tmp_path_factory.mktemp("tree") / "t.safetensors"
    _tree_file(path, json.dumps(tree), {"t0": torch.zeros(2)})
    try:
        treefile.load(path)
    except treefile.TreeFileError as e:
        assert isinstance(e, CheckpointError)


@pytest.mark.parametrize("header, why", [
    ("[" * 50_000 + "]" * 50_000, "unreadable .RecursionError"),
    ('{"t": [' * 100 + "1" + "]}" * 100, "nested deeper than 64"),
    ('{"d": [[[1], 2]]}', "a dict key of type list"),
    ('{"d": [[{"t": [[1]]}, 2]]}', "a dict key of type tuple"),
    ('{"d": [[1, 2, 3]]}', "malformed node"),
    ('{"x": ["t0"]}', "malformed node"),
    ('{"f": {"a": 1}}', "malformed node"),
    ('{"x": "t0", "y": 1}', "malformed node"),
    ("not json", "unreadable .JSONDecodeError"),
])
def test_malformed_tree_headers_raise_tree_file_error(tmp_path, header, why):
    with pytest.raises(treefile.TreeFileError, match=why):
        treefile.load(_tree_file(tmp_path / "t.safetensors", header))


@EXAMPLES
@given(at=st.integers(0, 10**6), byte=st.integers(0, 255), cut=st.booleans())
def test_damaged_tree_files_load_or_raise_tree_file_error(tmp_path_factory, at, byte, cut):
    import torch

    folder = tmp_path_factory.mktemp("tree")
    path = folder / "t.safetensors"
    treefile.save({"optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [
        {"lr": 0.1, "params": (0, 1)}]}, "rng": torch.arange(4)}, path)
    raw = bytearray(path.read_bytes())
    raw[at % len(raw)] = byte
    path.write_bytes(bytes(raw[:at % len(raw)]) if cut else bytes(raw))
    try:
        treefile.load(path)
    except treefile.TreeFileError:
        pass


# ---- crafted by nobody -----------------------------------------------------------------------
CRAFT = r"""
import json, os, struct, sys
out = sys.argv[1]
messages = {
    "step": b'{"__t": "Step", "iterations": "' + b"9" * 4000 + b'"}',
    "bare": b'{"iterations": 999999999}',
    "save": b'{"__t": "SaveCheckpoint", "folder": "/root/.ssh", "version": 1}',
    "wait": b'{"__t": "WaitWrite", "timeout_s": NaN}',
}
for name, data in messages.items():
    with open(os.path.join(out, name + ".msg"), "wb") as f:
        f.write(data)
trees = {"deep": "[" * 100000 + "]" * 100000, "key": '{"d": [[[1], 2]]}',
         "tag": '{"x": ["t0"]}'}
for name, tree in trees.items():
    header = json.dumps({"__metadata__": {"pivotrl_format": "pivotrl-tree/1",
                                          "pivotrl_tree": tree}}).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(out, name + ".safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
"""


def test_bytes_nobody_crafted_are_refused_by_the_decoders():
    from pivotrl_hpc.runtime.checkpoint import save

    if os.getuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("running code as a second account needs root and the system Python")
    out = Path(tempfile.mkdtemp(prefix="pivotrl-crafted-", dir="/tmp"))
    try:
        os.chmod(out, 0o1777)
        p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", "/usr/bin/python3", "-I", "-c", CRAFT, str(out)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        for name in ("step", "bare", "wait"):
            with pytest.raises(WireError):
                WORKER_WIRE.decode((out / f"{name}.msg").read_bytes(), expect=Command)
        save_cmd = WORKER_WIRE.decode((out / "save.msg").read_bytes(), expect=Command)
        worker = SimpleNamespace(trainer=None, spec=SimpleNamespace(
            checkpoints=str(out / "run.checkpoints"), group_shared=False, training_place=None))
        with pytest.raises(CheckpointError, match="'/root/.ssh' refused"):
            save(worker, save_cmd.folder, save_cmd.version)
        for name, why in (("deep", "RecursionError"), ("key", "dict key of type list"),
                          ("tag", "malformed node")):
            assert (out / f"{name}.safetensors").stat().st_uid == NOBODY
            with pytest.raises(treefile.TreeFileError, match=why):
                treefile.load(out / f"{name}.safetensors")
    finally:
        shutil.rmtree(out, ignore_errors=True)

