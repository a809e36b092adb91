"""Megatron -> GPS -> vLLM: `python gps_vllm_roundtrip.py JOB NODE POLICY_DIR`.

A training rank pair (TP=2) Writes new policy weights as Megatron shards; an in-process vLLM
engine started on the old weights Reads the new version (TP=1, HF layout), reloads it, and its
prompt logprobs are compared with transformers' on the same new weights. Prints one JSON line.
"""
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from safetensors.torch import load_file

from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.shapes import ModelShape

PROMPT = [5 + (i * 37) % 500 for i in range(24)]


def hf_logprobs(folder: str, sd: dict) -> list[float]:
    from transformers import Qwen2ForCausalLM
    m = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    m.load_state_dict(sd, strict=True)
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([PROMPT])).logits[0].float(), -1)
    return [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]


def vllm_logprobs(llm) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                       SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0),
                       use_tqdm=False)[0]
    return [out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))]


def main() -> None:
    job, node, folder = sys.argv[1:4]
    from vllm import LLM
    llm = LLM(model=folder, enforce_eager=True, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=64 * 2**20, seed=0)
    before = vllm_logprobs(llm)
    c = GPSClient(job, node)
    shape = ModelShape.from_hf_config(folder)
    hf = load_file(os.path.join(folder, "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.items()}
    t = time.perf_counter()
    handles = [c.write("policy", hf_to_megatron(new, shape, r, 2), ParallelPlace(2, r))
               for r in range(2)]
    version = {h.wait(60) for h in handles}
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    sd = c.read("policy", ParallelPlace(1, 0))
    read_s = time.perf_counter() - t
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items())})
    llm.reset_prefix_cache()
    after = vllm_logprobs(llm)
    ref = hf_logprobs(folder, new)
    old_ref = hf_logprobs(folder, hf)
    diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))  # noqa: E731
    print(json.dumps({"version": sorted(version), "write_s": write_s, "read_s": read_s,
                      "exact_read": all(torch.equal(sd[k], new[k]) for k in new),
                      "before_vs_old_hf": diff(before, old_ref),
                      "after_vs_new_hf": diff(after, ref),
                      "new_vs_old_hf": diff(ref, old_ref)}), flush=True)
    c.close()


if __name__ == "__main__":
    main()
