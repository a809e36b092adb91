"""The typed format of the job's sockets (`protocol/wire.py`): what the forker and the host
pipes carry instead of pickle (issue 35, N1)."""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from pivotrl_hpc.protocol.engine import (AbortedSequence, EngineOptions, EngineState,
                                         FinishedSequence, RunningSequence, Sampling, SeqProgress,
                                         StepOutput)
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.runtime.engine_host import HOST_WIRE, GPSRead, TPWorld
from pivotrl_hpc.runtime.host_forker import FORKER_WIRE, ForkRequest
from pivotrl_hpc.protocol.wire import WireError


class Run:
    def __reduce__(self):
        return os.system, ("true",)


def test_every_host_message_comes_back_equal_and_typed():
    sampling = Sampling(temperature=0.0, seed=3, stop_token_ids=(7, 9))
    messages = [
        ["start", [Path("/m/policy"), EngineOptions(omp_threads=2),
                   GPSRead("j", "n0", "policy", ParallelPlace(2, 1), 4), TPWorld(1, 2)]],
        ["add", ["s1", [1, 2], [3], 5, sampling, [-0.5]]],
        ["ok", StepOutput([SeqProgress("s1", [4], [-0.25])],
                          [FinishedSequence("s2", [1], [2, 3], [-1.0, -2.0], "stop")], 0.01),
         True, 1, 3],
        ["ok", [AbortedSequence("s1", [1], [2], [-0.5], 6, sampling)], False, 0, None],
        ["ok", EngineState([RunningSequence("s1", 3, 2, 8)], 100, 128, 16), True, 1, 2],
        ["ok", {"engine_start": 2.5, "params_read": 0.1}, True, 0, 0],
        ["error", ["ValueError", "bad", "tb"], False, 0, None],
    ]
    for message in messages:
        back = HOST_WIRE.decode(HOST_WIRE.encode(message))
        assert back == message
    back = HOST_WIRE.decode(HOST_WIRE.encode(sampling))
    assert isinstance(back.stop_token_ids, tuple) and hash(back) == hash(sampling)


@pytest.mark.parametrize("data, why", [
    (pickle.dumps(Run()), "not a message"),
    (pickle.dumps(["ok", 1, True, 0, None], protocol=0), "not a message"),
    (b'{"__t": "system", "cmd": "id"}', "'system' is not a type"),
    (b'{"__t": "ForkRequest", "worker_pid": 1, "name": "x", "env": {}}',
     "'ForkRequest' is not a type"),
    (b'{"__t": "EngineOptions", "max_model_len": 0}', "bad EngineOptions"),
    (b'{"__t": "Sampling", "evil": 1}', "bad Sampling"),
    (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
])
def test_anything_else_is_refused_and_runs_nothing(data, why):
    with pytest.raises(WireError, match=why):
        HOST_WIRE.decode(data)


def test_a_fork_request_is_typed_and_checked():
    request = ForkRequest(12, "policy on device 0", {"A": "1"})
    assert FORKER_WIRE.decode(FORKER_WIRE.encode(request)) == request
    with pytest.raises(WireError, match="bad ForkRequest"):
        FORKER_WIRE.decode(b'{"__t": "ForkRequest", "worker_pid": 1, "name": "x", '
                           b'"env": {"A": 1}}')
    with pytest.raises(WireError, match="'EngineOptions' is not a type"):
        FORKER_WIRE.decode(HOST_WIRE.encode(EngineOptions()))


def test_only_the_channels_own_types_are_encoded():
    @dataclass
    class Other:
        x: int = 1

    with pytest.raises(WireError, match="Other is not a type"):
        HOST_WIRE.encode(["ok", Other()])
    with pytest.raises(WireError, match="set is not a type"):
        HOST_WIRE.encode({1, 2})
