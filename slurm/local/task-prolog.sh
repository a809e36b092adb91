#!/bin/bash
# TaskProlog of the local test cluster only: each "export K=V" line printed here lands in the
# environment of every task. Values already set by the user win.
# - Open MPI's shared-memory BTL crashes when two fake nodes share one host: use self,tcp.
# - NIXL's bundled UCX segfaults at process exit unless the ib/rdmacm modules are skipped.
[ -n "${OMPI_MCA_btl:-}" ] || echo "export OMPI_MCA_btl=self,tcp"
[ -n "${UCX_MODULES:-}" ] || echo "export UCX_MODULES=^ib,rdmacm"
# n1/n2 do not resolve on this host; torch.distributed rendezvous must use loopback.
[ -n "${MASTER_ADDR:-}" ] || echo "export MASTER_ADDR=127.0.0.1"
exit 0
