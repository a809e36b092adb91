"""Tiny models, tokenizer and dataset are made locally and deterministically."""
from __future__ import annotations

import json
import subprocess
import sys

from pivotrl_hpc.task.synthetic import TINY_SUFFIX, make_split
from pivotrl_hpc.assets.tokenizer import EOS_ID, PAD_ID, THINK_ID, build_tokenizer
from pivotrl_hpc.task.data import DataKeys, read_records


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
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                  tokenize=False, add_generation_prompt=True)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    assert pol.config.eos_token_id == tok.eos_token_id == EOS_ID
    assert pol.config.pad_token_id == tok.pad_token_id == PAD_ID
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
    train = read_records(tiny_models / "data" / "train.parquet", "auto", DataKeys())
    assert len(train) == 64 and [r.answer for r in train] == [
        r["answer"] for r in make_split(0, 64)]
    for rec in train:
        a, op, b = rec.extra_info["raw_problem"].removesuffix("?").split()[2:5]
        assert str(eval(f"{a}{op}{b}")) == rec.answer  # noqa: S307 - our own digits
        assert rec.problem.endswith(TINY_SUFFIX)


def test_tokenizer_is_byte_level_bpe_with_a_chat_template_and_deterministic(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models / "policy")
    assert tok.get_vocab() == build_tokenizer().get_vocab() and len(tok) <= 512
    text = "So the answer is -123.\nAnswer: -123 ünïcode ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text                       # bytes: nothing becomes <unk>
    assert sum(tok.decode([i]).isdigit() for i in ids) == 6   # one token per digit
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    think = tok("<think>x</think>", add_special_tokens=False)["input_ids"]
    assert think[0] == THINK_ID and tok.decode(think, skip_special_tokens=True) == \
        "<think>x</think>"


def test_init_models_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "init-models",
                          str(tmp_path), "--train", "8", "--validation", "2", "--random"],
                         capture_output=True, text=True, check=True)
    summary = json.loads(out.stdout)
    assert summary["policy"]["parameters"] == 1_444_096
    assert (tmp_path / "genrm" / "tokenizer.json").is_file()
    val = read_records(tmp_path / "data" / "aime-style.parquet", "auto", DataKeys())
    assert len(val) == 2 and summary["data"]["train"].endswith("train.parquet")
