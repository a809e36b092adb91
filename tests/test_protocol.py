"""The controller/worker protocol on its wire (issue 51): every message type comes back from
`WORKER_WIRE` bytes equal, field by field and type by type (tuples stay tuples, the role an
enum), and `protocol.mpi` carries them between two MPI ranks as bytes, never pickle."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import typing

import numpy as np
import pytest

from pivotrl_hpc.protocol import messages as m
from pivotrl_hpc.protocol.engine import (AbortedSequence, EngineState, FinishedSequence,
                                         RunningSequence, Sampling, SeqProgress, StepOutput)
from pivotrl_hpc.protocol.messages import WORKER_WIRE, Reply, RoleKind
from pivotrl_hpc.protocol.wire import PLAIN, Codec, WireError
from slurm_util import PROGRAMS, PYTHON, json_lines

GREEDY = Sampling(temperature=0.0, top_k=5, seed=11, ignore_eos=True, stop_token_ids=(2, 7))
ABORTED = AbortedSequence("p3", [1, 5, 9], [4, 4], [-0.5, -1.25], 6, GREEDY)
# 16 values or more travel packed (wire.py): token ids and logprobs of a whole response,
# floats that no 4-byte float holds, an id past 32 bits (which stays JSON)
LONG = FinishedSequence("p9", list(range(100, 140)), [151_000 + i for i in range(40)],
                        [-(i + 1) / 7 for i in range(40)], "length")
STEP = StepOutput([SeqProgress("p1", [17, 3], [-0.125, -2.5]), SeqProgress("p2", [], [])],
                  [FinishedSequence("p1", [1, 2], [9, 17, 3], [-1.0, -0.125, -2.5], "stop"),
                   LONG], 0.0375, iterations=2)
STATE = EngineState([RunningSequence("p2", 12, 3, 61)], 4096, 8192, 16, awake=True)

COMMANDS = [
    m.ShiftUp(RoleKind.REWARD, replica=2, version=5), m.ShiftUp(RoleKind.TRAINING),
    m.ShiftDown(), m.Prepare(("policy",)),
    m.AddSequences((m.SeqRequest("p1", (1, 2, 3), (9,), (-0.75,), 61, GREEDY),
                    m.SeqRequest.resume(ABORTED),
                    m.SeqRequest("p9", tuple(LONG.prompt_ids) + (2**40,), tuple(LONG.token_ids),
                                 tuple(LONG.logprobs), 3, GREEDY))),
    m.Step(iterations=4), m.Abort(("p1", "p2")), m.Abort(None),
    m.TrainStep(m.TrainBatch(((1, 2), (1, 3, 4)), ((5, 6, 7), (8,)), ((-0.5, -0.25, -1.0),
                             (-2.0,)), (1.0, 0.0), (0, 0)), publish=False),
    m.WaitWrite(12.5), m.Reload(7), m.Reload(None), m.SaveCheckpoint("/ckpt/step-00004", 4),
    m.QueryState(), m.Shutdown(),
]
REPLIES = [
    Reply("Step", True, RoleKind.ROLLOUT, 1, result=[STEP, STEP], phases={}),
    Reply("ShiftDown", True, RoleKind.IDLE, -1, result=[ABORTED],
          phases={"temporary.abort": 0.5, "total": 1.25}),
    Reply("QueryState", True, RoleKind.REWARD, 0,
          result={"role": "reward", "replica": 0, "version": 3, "engine": STATE,
                  "peak_rss_mb": {"worker": 812.5}}),
    Reply("TrainStep", True, RoleKind.TRAINING, 0,
          result={"loss": 0.25, "kl": 1e-3, "gps_version": 4}, phases={"train_step": 2.0}),
    Reply("AddSequences", False, RoleKind.ROLLOUT, 3, error="RoleError: no\ntraceback",
          seq_ids=("p1", "p2"), device=5),
]


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (a list is not a tuple here)."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("message", COMMANDS + REPLIES, ids=lambda x: type(x).__name__)
def test_every_message_comes_back_exactly(message):
    back = WORKER_WIRE.decode(WORKER_WIRE.encode(message))
    assert back == message and _same(back, message), (message, back)


def test_the_cases_cover_every_type_of_the_wire():
    """A message type added to the wire without a case here fails this test."""
    seen: set[type] = set()

    def walk(x):
        if dataclasses.is_dataclass(x):
            seen.add(type(x))
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(COMMANDS + REPLIES)
    assert set(WORKER_WIRE.types) <= seen, set(WORKER_WIRE.types) - seen
    commands = {t for t in typing.get_args(m.Command)}
    assert commands <= {type(c) for c in COMMANDS}


def test_numpy_values_travel_as_numbers_and_bytes_as_bytes():
    reply = Reply("TrainStep", True, RoleKind.TRAINING, 0,
                  result={"loss": np.float32(0.5), "tokens": np.int64(12), "meta": b"\x00\xff"})
    back = WORKER_WIRE.decode(WORKER_WIRE.encode(reply))
    assert back.result == {"loss": 0.5, "tokens": 12, "meta": b"\x00\xff"}
    assert type(back.result["tokens"]) is int and type(back.result["meta"]) is bytes
    with pytest.raises(WireError, match="ndarray is not a type"):
        WORKER_WIRE.encode(Reply("Step", True, RoleKind.ROLLOUT, 0, result=np.zeros(3)))


@pytest.mark.parametrize("data, why", [
    (pickle.dumps(m.Shutdown()), "not a message"),
    (b'{"__t": "ShiftUp", "role": "root", "replica": 0}', "bad ShiftUp"),
    (b'{"__t": "ForkRequest", "worker_pid": 1}', "'ForkRequest' is not a type"),
    (b'{"__t": "RolloutBatch", "tokens": []}', "'RolloutBatch' is not a type"),
    (b'{"__t": "Sampling", "stop_token_ids": [1, 2], "evil": 1}', "bad Sampling"),
    (b'{"__t": "bytes", "b": "%%%"}', "bad bytes"),
])
def test_anything_else_is_refused(data, why):
    with pytest.raises(WireError, match=why):
        WORKER_WIRE.decode(data)


def test_a_fixed_length_tuple_of_another_length_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Pair:
        ab: tuple[int, int]

    wire = Codec(Pair)
    assert wire.decode(wire.encode(Pair((1, 2)))) == Pair((1, 2))
    with pytest.raises(WireError, match="3 values for a tuple of 2"):
        wire.decode(b'{"__t": "Pair", "ab": [1, 2, 3]}')


def test_plain_values_round_trip():
    """What the launch's collectives and the GPS agents' control messages carry."""
    value = {"op": "holds", "ranges": [[0, 4096]], "meta": b"\x01\x02", "n": None}
    assert PLAIN.decode(PLAIN.encode(value)) == value
    with pytest.raises(WireError, match="Shutdown is not a type"):
        PLAIN.encode(m.Shutdown())


def test_two_ranks_carry_every_message_over_mpi(tmp_path):
    """tests/programs/protocol_mpi.py: rank 0 sends every command with Isend and reads the
    echoes through Improbe (the controller's inbox), rank 1 serves them with Mprobe/Recv and
    Send (the worker's loop); then bcast and allgather of plain values."""
    env = {k: v for k, v in os.environ.items() if k != "OMPI_MCA_btl"}
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2",
                        str(PYTHON), str(PROGRAMS / "protocol_mpi.py")],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    [report] = json_lines(p.stdout)
    assert report["echoed"] == len(COMMANDS) + len(REPLIES)
    assert report["mismatch"] == []
    assert report["bcast"] == {"ports": 41000, "token": "ab12"}
    assert report["allgather"] == [["node0", 0, b"\x00".hex()], ["node1", 1, b"\x01".hex()]]
    json.dumps(report)


def test_the_protocol_imports_nothing_above_it():
    """Every layer imports it: it must not drag in the project, torch, vLLM or MPI."""
    code = ("import sys; import pivotrl_hpc.protocol.messages, pivotrl_hpc.protocol.mpi, "
            "pivotrl_hpc.protocol.context; print(' '.join(sorted(sys.modules)))")
    loaded = subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    ours = {m for m in loaded if m.startswith("pivotrl_hpc")}
    assert ours == {"pivotrl_hpc", "pivotrl_hpc.protocol"} | {
        f"pivotrl_hpc.protocol.{n}" for n in ("context", "engine", "messages", "mpi", "wire")}
    assert not {"mpi4py", "torch", "vllm", "numpy"} & set(loaded)
