"""Global Parameter Storage (paper §5.1, appendix B): every model's weights in POSIX shared
memory on every node, Read/Write(M, G, P) for device workers, converters for Megatron-Core.

Who runs what:
- `NodeAgent` (agent.py): one per node, MPI local rank 0; owns the segments (segment.py,
  store.py), loads v0 from HF safetensors folders, assembles and replicates Writes over NIXL
  (MPI fallback; transport.py) following the all-to-all plan (plan.py), removes everything on
  exit or SIGTERM. `pivotrl gps serve` runs one by hand; `gps.local.local_agent` in a child
  process.
- `GPSClient` (client.py): in each worker. `read(model, place)` maps the node-local segment of
  the current version (pinned by a shared flock, control.py) and returns the slices `place`
  needs (layout.py); `write(model, shard, place)` fills the next version and returns a
  `WriteHandle`.
- Converters (convert.py, shapes.py): HF Qwen2 <-> Megatron-Core GPTModel shards.
"""
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.shapes import ModelShape

__all__ = ["ParallelPlace", "ModelShape", "NodeAgent", "AgentConfig", "GPSClient", "WriteHandle",
           "Pin", "GPSMemoryError"]


def __getattr__(name: str):
    # torch-free import of the package: the heavy modules load on first use
    if name in ("NodeAgent", "AgentConfig"):
        from pivotrl_hpc.gps import agent
        return getattr(agent, name)
    if name in ("GPSClient", "WriteHandle", "Pin"):
        from pivotrl_hpc.gps import client
        return getattr(client, name)
    if name == "GPSMemoryError":
        from pivotrl_hpc.gps.segment import GPSMemoryError
        return GPSMemoryError
    raise AttributeError(name)
