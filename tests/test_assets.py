"""Tiny models, tokenizer and dataset are made locally and deterministically."""
from __future__ import annotations

import json
import subprocess
import sys

from pivotrl_hpc.assets.dataset import extract_answer, make_split, prompt_text, read_jsonl
from pivotrl_hpc.assets.tokenizer import UNK_ID, vocabulary


def test_models_differ_and_load(tiny_models):
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    pol = Qwen2ForCausalLM.from_pretrained(tiny_models / "policy")
    rm = Qwen2ForCausalLM.from_pretrained(tiny_models / "genrm")
    n_pol = sum(p.numel() for p in pol.parameters())
    n_rm = sum(p.numel() for p in rm.parameters())
    assert n_pol == 1_444_096 and n_rm > 4 * n_pol
    assert pol.config.num_key_value_heads == 4 and pol.config.num_attention_heads == 8
    assert abs(pol.model.layers[0].self_attn.q_proj.bias).sum() > 0  # random biases
    tok = AutoTokenizer.from_pretrained(tiny_models / "policy")
    ids = tok(prompt_text("what is 12 + 7 ?"))["input_ids"]
    assert UNK_ID not in ids
    with torch.no_grad():
        logits = pol(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits).all()


def test_model_creation_is_deterministic(tiny_models, tmp_path):
    from safetensors.torch import load_file

    from pivotrl_hpc.assets.models import SPECS, create_model

    create_model(tmp_path / "p", SPECS["policy"])
    a = load_file(tiny_models / "policy" / "model.safetensors")
    b = load_file(tmp_path / "p" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_dataset_deterministic_and_verifiable(tiny_models):
    train = read_jsonl(tiny_models / "data" / "train.jsonl")
    assert len(train) == 64 and train == make_split(0, 64)
    assert train != make_split(1, 64)
    for rec in train:
        a, op, b = rec["problem"].split()[2:5]
        assert str(eval(f"{a}{op}{b}")) == rec["answer"]  # noqa: S307 - our own digits


def test_tokenizer_round_trip_and_answer_extraction(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models / "policy")
    text = "so the answer is -123"
    decoded = tok.decode(tok(text)["input_ids"])
    assert extract_answer(decoded) == "-123"
    assert extract_answer("no digits") is None
    assert len(vocabulary(512)) == 512


def test_init_models_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "init-models",
                          str(tmp_path), "--train", "8", "--validation", "2"],
                         capture_output=True, text=True, check=True)
    summary = json.loads(out.stdout)
    assert summary["policy"]["parameters"] == 1_444_096
    assert (tmp_path / "genrm" / "tokenizer.json").is_file()
    assert len(read_jsonl(tmp_path / "data" / "validation.jsonl")) == 2
