#!/usr/bin/env bash
# Multi-node launch with torchrun's c10d rendezvous. Run the same command on every node:
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0.example:29400 ./launch/multinode.sh --dp 8 --pert 2
# Each node's ranks form one shard group for the sliced transfer (torchrun's GROUP_RANK
# and LOCAL_WORLD_SIZE tell them apart; nothing is guessed from host names).
# Knobs: NNODES, NPROC_PER_NODE (default: visible GPUs), RDZV_ENDPOINT (host:port of any
# one node, reachable from all), RDZV_ID (a job id, default distzo).
set -euo pipefail
: "${NNODES:?set NNODES}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of one node}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$(python -c "import torch; print(torch.cuda.device_count() or 1)")
fi
exec torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:-distzo}" \
  --max_restarts=0 \
  -m distzo.train "$@"
