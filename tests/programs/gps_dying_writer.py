"""A writer that dies in the middle of a Write: `gps_dying_writer.py JOB NODE MODEL_DIR MODEL N`.

Writes TP rank 1 (of 2) of version weights x101 through `GPSClient.write` and kills itself
with SIGKILL once N tensors are in the new segment, before it reports them to the agent. The
death is real; only its moment is chosen, by wrapping the client's copy function (a kill from
outside could not land inside the Write reliably).
"""
import os
import signal
import sys

from safetensors.torch import load_file

import pivotrl_hpc.gps.client as client_mod
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.shapes import ModelShape


def main() -> None:
    job, node, model_dir, model, n = sys.argv[1:6]
    c = GPSClient(job, node)
    hf = load_file(os.path.join(model_dir, "model.safetensors"))
    shard = hf_to_megatron({k: t * 101 for k, t in hf.items()},
                           ModelShape.from_hf_config(model_dir), 1, 2)
    copied = []
    copy = client_mod._copy

    def dying_copy(dst, src):
        if len(copied) == int(n):
            os.kill(os.getpid(), signal.SIGKILL)
        copied.append(1)
        return copy(dst, src)

    client_mod._copy = dying_copy
    c.write(model, shard, ParallelPlace(2, 1))
    sys.exit("the Write finished: the writer did not die")


if __name__ == "__main__":
    main()
