"""Workload snapshot: JSON round trip and validation with clear errors."""
from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pivotrl_hpc.plan import SnapshotError, WorkloadSnapshot, synthetic_snapshot
from pivotrl_hpc.plan.snapshot import ReplicaState, SeqState

FIG8 = Path(__file__).resolve().parents[1] / "examples" / "figure8_snapshot.json"


@pytest.fixture()
def raw() -> dict:
    return json.loads(FIG8.read_text())


def test_round_trip_dict_and_json(raw):
    snap = WorkloadSnapshot.from_dict(raw)
    assert WorkloadSnapshot.from_dict(snap.to_dict()) == snap
    assert WorkloadSnapshot.from_dict(json.loads(snap.to_json())) == snap
    syn = synthetic_snapshot(32, seed=4)
    assert WorkloadSnapshot.from_dict(json.loads(syn.to_json())) == syn


def test_synthetic_snapshot_is_deterministic_and_proportioned():
    a, b = synthetic_snapshot(64, seed=1), synthetic_snapshot(64, seed=1)
    assert a == b and a != synthetic_snapshot(64, seed=2)
    assert len(a.role_replicas("rollout")) == 16 and len(a.role_replicas("reward")) == 4
    assert len(a.training.devices) == 32
    per = [len(r.sequences) for r in a.role_replicas("reward")]
    assert min(per) >= 10          # tens of sequences per GenRM replica
    with pytest.raises(ValueError, match="multiple of 16"):
        synthetic_snapshot(24)


def _bad(raw: dict, edit) -> str:
    data = copy.deepcopy(raw)
    edit(data)
    with pytest.raises(SnapshotError) as err:
        WorkloadSnapshot.from_dict(data)
    return str(err.value)


def test_sequence_on_two_replicas_names_both(raw):
    def edit(d):
        d["replicas"][5]["sequences"].append(list(d["replicas"][4]["sequences"][0]))
    msg = _bad(raw, edit)
    sid = raw["replicas"][4]["sequences"][0][0]
    assert f"sequence {sid}" in msg and "replica ro16" in msg and "replica ro17" in msg


def test_sequence_queued_and_running(raw):
    def edit(d):
        d["roles"]["reward"]["queue"].append(list(d["replicas"][0]["sequences"][3]))
    assert "replica rw0" in _bad(raw, edit) and "reward queue" in _bad(raw, edit)


def test_negative_capacity_names_the_replica(raw):
    def edit(d):
        d["replicas"][2]["kv_capacity"] = -5
    assert "replica rw2: negative KV capacity -5" in _bad(raw, edit)


def test_overfilled_replica(raw):
    def edit(d):
        d["replicas"][1]["kv_capacity"] = 1000
    assert "replica rw1: sequences hold" in _bad(raw, edit)


def test_unknown_role(raw):
    def edit(d):
        d["replicas"][6]["role"] = "critic"
    assert "replica ro18: unknown role 'critic'" in _bad(raw, edit)

    def edit_roles(d):
        d["roles"]["critic"] = d["roles"]["rollout"]
    assert "unknown role 'critic'" in _bad(raw, edit_roles)


def test_device_conflicts(raw):
    def overlap(d):
        d["replicas"][4]["devices"] = [5]
    assert "device 5 is also held by rw1" in _bad(raw, overlap)

    def misaligned(d):
        d["replicas"][0]["devices"] = [1, 2, 3, 4]
    assert "replica rw0: devices [1, 2, 3, 4] are not one aligned 4-GPU" in _bad(raw, misaligned)

    def on_training(d):
        d["replicas"][4]["devices"] = [24]
        d["replicas"][4]["id"] = "ro24"
    assert "device 24 is also held by training" in _bad(raw, on_training)


def test_malformed_input(raw):
    def missing(d):
        del d["training"]
    assert "malformed snapshot" in _bad(raw, missing)

    def bad_seq(d):
        d["replicas"][0]["sequences"][0] = [1]
    assert "replica rw0: sequence [1] is not [id, prompt, generated]" in _bad(raw, bad_seq)

    def active_down(d):
        d["training"].update(up=False, active=True)
    assert "training is active but not shifted up" in _bad(raw, active_down)


_seqs = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=40)


@given(_seqs, _seqs)
def test_cached_n_tok_is_the_plain_sum_and_never_stale(a, b):
    """ReplicaState.n_tok is cached (issue 39): it must equal the plain sum of sequence
    lengths, a replaced replica must recompute it, and reading it must not change equality,
    hashing or pickling."""
    seqs = tuple(SeqState(i, p, g) for i, (p, g) in enumerate(a))
    r = ReplicaState("r0", "rollout", (0,), 10**9, seqs)
    fresh = ReplicaState("r0", "rollout", (0,), 10**9, seqs)
    assert r.n_tok == sum(s.prompt_tokens + s.generated_tokens for s in seqs)
    assert r == fresh and hash(r) == hash(fresh)
    other = tuple(SeqState(i, p, g) for i, (p, g) in enumerate(b))
    assert dataclasses.replace(r, sequences=other).n_tok == sum(p + g for p, g in b)
    assert pickle.loads(pickle.dumps(r)).n_tok == r.n_tok  # noqa: S301 - its own bytes
