#!/usr/bin/env bash
# Single-node launch: one rank per GPU (or NGPU CPU ranks), bound to localhost.
#   NGPU=4 ./launch/run_train.sh --max-steps 1000 --dp 2 --pert 2
# Knobs (environment): NGPU (ranks, default: visible GPUs, else 2), MASTER_PORT (29500),
# LOG_RANK (whose output to show, default 0; "all" for every rank). Arguments pass through
# to `python -m distzo.train`.
set -euo pipefail
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
LOG_RANK=${LOG_RANK:-0}
filter=()
if [[ "$LOG_RANK" != "all" ]]; then
  filter=(--local-ranks-filter "$LOG_RANK")
fi
exec torchrun --nnodes=1 --nproc_per_node="$NGPU" \
  --master_addr=127.0.0.1 --master_port="${MASTER_PORT:-29500}" \
  --tee 3 "${filter[@]}" \
  -m distzo.train "$@"
