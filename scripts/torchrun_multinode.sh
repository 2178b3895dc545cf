#!/usr/bin/env bash
# Start one node of a multi-node `xtl fit` with torchrun. Run it on every node, with the same NNODES, MASTER_ADDR,
# MASTER_PORT and NPROC_PER_NODE everywhere; the arguments go to `xtl fit` (put the configs there):
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 NPROC_PER_NODE=8 scripts/torchrun_multinode.sh --config my_run.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node01 NPROC_PER_NODE=8 scripts/torchrun_multinode.sh --config my_run.yaml
#
# Environment (defaults in brackets):
#   NNODES          nodes of the job [1]; passed to xtl as --trainer.num_nodes
#   NPROC_PER_NODE  processes (GPUs) per node [1]; passed to xtl as --trainer.devices
#   MASTER_ADDR     host of the rendezvous: a name or address every node reaches (the first node) [127.0.0.1]
#   MASTER_PORT     a free TCP port on MASTER_ADDR [29500]
#   NODE_RANK       this node's index, 0..NNODES-1 [0]; used by the static rendezvous only (c10d numbers the nodes
#                   in the order they join)
#   RDZV            c10d (a restarted or replaced node joins again; the node at MASTER_ADDR must stay up, it hosts
#                   the rendezvous) or static (fixed node ranks, no replacement) [c10d]
#   RUN_ID          the rendezvous id, the same on every node and unique per job [xtl-$MASTER_PORT]
#   MAX_RESTARTS    times torchrun restarts this node's processes after a failure [3]
#   CKPT_PATH       --ckpt_path of the fit, unless the arguments give one: auto resumes from the newest intact
#                   checkpoint of the run folder or starts fresh; none never resumes [auto]
#   PYTHON          the interpreter with xtl installed [python]
#   DRY_RUN         1: print the command instead of running it [0]
set -euo pipefail

NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-0}
RDZV=${RDZV:-c10d}
RUN_ID=${RUN_ID:-xtl-$MASTER_PORT}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CKPT_PATH=${CKPT_PATH-auto}
PYTHON=${PYTHON:-python}

case "$RDZV" in
  c10d)
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RUN_ID")
    # each rendezvous round gets a store of its own: with the store torchrun shares by default, the second round
    # after a node is replaced fails (torch 2.13)
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    ;;
  static)
    rdzv=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
    ;;
  *)
    echo "torchrun_multinode.sh: RDZV must be c10d or static, not '$RDZV'" >&2
    exit 2
    ;;
esac

fit=("$@")
# (no `grep -q` in a pipe: it exits at the first match, and pipefail turns printf's SIGPIPE into a failure)
if [[ -n "$CKPT_PATH" ]] && ! printf '%s\n' "$@" | grep -- '^--ckpt_path' >/dev/null; then
  fit+=(--ckpt_path "$CKPT_PATH")
fi

command=(
  "$PYTHON" -m torch.distributed.run
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" "${rdzv[@]}"
  -m xtl fit "${fit[@]}" --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC_PER_NODE"
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%q ' "${command[@]}"
  echo
  exit 0
fi
exec "${command[@]}"
