"""Single-node GPS: Read(M, G, P) equals slicing the HF tensors, errors. Nothing here writes:
every test reads v0 of an agent of its own module (Writes are in test_gps_write.py)."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.local import local_agent
from pivotrl_hpc.gps.segment import GPSMemoryError, check_memory
from pivotrl_hpc.gps.shapes import ModelShape
from pivotrl_hpc.gps.tensors import runs

MODELS = ("policy", "genrm")


@pytest.fixture(scope="module")
def agent(tiny_models):
    with local_agent({m: str(tiny_models / m) for m in MODELS}) as a:
        yield a


@pytest.fixture(scope="module")
def client(agent):
    c = agent.client()
    yield c
    c.close()


def _hf(tiny_models, model):
    return load_file(str(tiny_models / model / "model.safetensors"))


def _direct_slice(name: str, t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """Independent statement of vLLM's TP split of each Qwen2 parameter kind."""
    if name in ("model.embed_tokens.weight", "lm_head.weight") or any(
            p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        n = t.shape[0] // tp
        return t[r * n:(r + 1) * n]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        n = t.shape[1] // tp
        return t[:, r * n:(r + 1) * n]
    return t  # norms


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_read_equals_direct_slices(client, tiny_models, model, tp):
    hf = _hf(tiny_models, model)
    kinds = set()
    for r in range(tp):
        got = client.read(model, ParallelPlace(tp_size=tp, tp_rank=r))
        assert got.keys() == hf.keys()
        for name, t in hf.items():
            want = _direct_slice(name, t, tp, r)
            assert got[name].shape == want.shape, name
            assert got[name].numpy().tobytes() == want.contiguous().numpy().tobytes(), name
            kinds.add(name.split(".")[-2] if name.startswith("model.layers") else name)
    assert len(kinds) >= 12  # every parameter kind of Qwen2 was compared


def test_read_megatron_layout(client, tiny_models):
    hf = _hf(tiny_models, "policy")
    shape = ModelShape.from_hf_config(tiny_models / "policy")
    for tp in (1, 2, 4):
        for r in range(tp):
            got = client.read("policy", ParallelPlace(tp, r), layout="megatron")
            want = hf_to_megatron(hf, shape, r, tp)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
    got = client.read("policy", ParallelPlace(4, 1), layout="megatron", padded_vocab_size=1024)
    want = hf_to_megatron(hf, shape, 1, 4, padded_vocab_size=1024)
    assert torch.equal(got["output_layer.weight"], want["output_layer.weight"])


def test_segment_is_safetensors_mode_0600(client, agent, tiny_models):
    hf = _hf(tiny_models, "genrm")
    with client.pin("genrm") as pin:
        path = pin.segment.path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert path.name == f"pivotrl-{agent.job}-{agent.node}-genrm-v{pin.version}"
        with safe_open(str(path), "pt") as f:
            assert sorted(f.keys()) == sorted(hf)
            assert all(torch.equal(f.get_tensor(k), hf[k]) for k in hf)


def test_zero_copy_and_out(client, tiny_models):
    hf = _hf(tiny_models, "policy")
    name = "model.layers.1.mlp.up_proj.weight"
    with client.pin("policy") as pin:
        views = client.read("policy", ParallelPlace(2, 1), copy=False, pin=pin)
        half = hf[name].shape[0] // 2
        assert torch.equal(views[name], hf[name][half:])
        base = pin.segment.address
        assert base <= views[name].data_ptr() < base + len(pin.segment.mm)
    with pytest.raises(ValueError, match="pin"):
        client.read("policy", copy=False)
    out = {k: torch.empty_like(v) for k, v in hf.items()}
    got = client.read("policy", out=out)
    assert all(got[k] is out[k] and torch.equal(out[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp", [1, 2])
def test_read_into_buffers_is_one_memmove_per_run(client, tiny_models, tp):
    """`buffers` lays the destinations out like the segment: at TP=1 a whole-model Read into
    them is a single memmove (the bench's read_gbps); TP slices still land exactly."""
    hf = _hf(tiny_models, "genrm")
    place = ParallelPlace(tp, tp - 1)
    out = client.buffers("genrm", place)
    got = client.read("genrm", place, out=out)
    assert got.keys() == hf.keys() and all(got[k] is out[k] for k in hf)
    for name, t in hf.items():
        assert got[name].numpy().tobytes() == _direct_slice(name, t, tp, tp - 1).contiguous(
        ).numpy().tobytes(), name
    with client.pin("genrm") as pin:
        views = client.read("genrm", place, copy=False, pin=pin)
        joined, rest = runs([(out[k], views[k]) for k in views])
        if tp == 1:
            assert len(joined) == 1 and not rest
            assert joined[0][2] == sum(t.numel() * t.element_size() for t in hf.values())
        assert all(d % 4096 == s % 4096 for d, s, _ in joined)   # no 4K aliasing


def test_memory_error_names_bytes():
    with pytest.raises(GPSMemoryError, match=r"needs 1125899906842624000 bytes .* only \d+ bytes"):
        check_memory(1000 * 2**50, "a test")


def test_no_agent_is_a_clear_error():
    with pytest.raises(TimeoutError, match="no GPS node agent"):
        GPSClient("nosuchjob", "n9", wait_s=0.1)


def test_bad_requests_get_errors_and_the_agent_lives(client, agent):
    with pytest.raises(RuntimeError, match="KeyError"):
        client._request({"op": "begin_write", "model": "nosuchmodel"}, "begin_write")
    with pytest.raises(RuntimeError, match="v0 cannot be written on n0: the next version is v1"):
        client._request({"op": "written", "model": "policy", "version": 0, "ranges": []},
                        "written")
    assert client._request({"op": "ping"}, "ping")["node"] == agent.node


def test_read_tensors_can_be_freed_by_resizing_storage(client):
    """Device workers drop parameters on shift down with `untyped_storage().resize_(0)`."""
    got = client.read("policy")
    t = got["model.norm.weight"]
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().nbytes() == 0
