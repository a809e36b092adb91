"""GPS reader for the concurrency tests: `python gps_reader.py JOB NODE MODEL_DIR (--until V |
--hold)`.

Loop mode (`--until V`): Read the policy again and again until it has read version V; check
each Read against the weights of the version it pinned (version v = HF weights * (1 + v) +
0.25 v, the writer's rule); print `{"seen": v}` on each new version (the first one is the
ready signal), then one JSON line: reads, versions seen in order, mismatches.
Hold mode: pin the current version, print its number, and sleep (to be killed with -9).
"""
import hashlib
import json
import os
import sys
import time

from safetensors.torch import load_file

from pivotrl_hpc.gps.client import GPSClient


def version_weights(hf: dict, v: int) -> dict:
    return {k: t * (1.0 + v) + 0.25 * v for k, t in hf.items()}


def digest(sd: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(sd[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    job, node, model_dir, mode = sys.argv[1:5]
    c = GPSClient(job, node)
    if mode == "--hold":
        pin = c.pin("policy")
        say({"pinned": pin.version})
        time.sleep(3600)
        return
    until = int(sys.argv[5])
    hf = load_file(os.path.join(model_dir, "model.safetensors"))
    want: dict[int, str] = {}
    seen, bad, reads = [], 0, 0
    while not seen or seen[-1] < until:
        with c.pin("policy") as pin:
            got = c.read("policy", pin=pin)
            v = pin.version
        if v not in want:
            want[v] = digest(version_weights(hf, v))
        bad += digest(got) != want[v]
        if not seen or seen[-1] != v:
            seen.append(v)
            say({"seen": v})
        reads += 1
    say({"reads": reads, "versions": seen, "mismatches": bad})


if __name__ == "__main__":
    main()
