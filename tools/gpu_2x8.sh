#!/usr/bin/env bash
# The two-node part of the GPU-readiness review's 8-GPU plan (issue 18): 2 nodes x 8 GPUs
# joined by torch's c10d rendezvous through titan-train's own launcher flags, one job over
# all 16 ranks, then the same run resumed on one node (16 -> 8 ranks). Run it on BOTH nodes,
# with the same OUT folder on shared storage and the same endpoint (node 0's address):
#
#   On node 0:  NODE_RANK=0 RDZV_ENDPOINT=node0:29500 bash tools/gpu_2x8.sh /shared/gpu-2x8
#   On node 1:  NODE_RANK=1 RDZV_ENDPOINT=node0:29500 bash tools/gpu_2x8.sh /shared/gpu-2x8
#
# Items (node 0 writes the summary table, OUT/summary.txt):
#   seed      node 0, one process: the seed checkpoint of FLAVOR, built on the host [F10]
#   fsdp16    both nodes: FSDP over 16 ranks, 20 steps of 16 x SEQ_LEN tokens, a checkpoint
#             at step 10 from every rank into the shared folder (one writer per file: the
#             summary counts the step's .distcp files); the local rank -> GPU binding of the
#             second node's ranks [F26] is exercised by their running at all
#   resume8   node 0 alone: fsdp16's folder from step 10, on 8 ranks (FSDP8), to step 20;
#             its step-20 loss must be fsdp16's within 2% (bf16, another reduction order)
#
# Knobs (environment): NODE_RANK (0 or 1), RDZV_ENDPOINT (HOST:PORT of node 0), NPROC
# (default 8), FLAVOR (default 8B), SEQ_LEN (default 2048), RDZV_ID (default titan-2x8),
# TIMEOUT seconds per item (default 1800). The plumbing runs on one CPU machine too, two
# copies of the script as the two "nodes" (gloo, 2 processes each):
#   for r in 0 1; do NODE_RANK=$r RDZV_ENDPOINT=localhost:29522 NPROC=2 FLAVOR=debugmodel \
#     SEQ_LEN=64 bash tools/gpu_2x8.sh /tmp/two-nodes & done; wait
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="$(realpath -m "${1:?usage: NODE_RANK=R RDZV_ENDPOINT=HOST:PORT tools/gpu_2x8.sh OUT}")"
NODE_RANK="${NODE_RANK:?set NODE_RANK to 0 or 1}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:?set RDZV_ENDPOINT to HOST:PORT of node 0}"
NPROC="${NPROC:-8}"
FLAVOR="${FLAVOR:-8B}"
TIMEOUT="${TIMEOUT:-1800}"
unset TITAN_DEVICE  # let detection pick the GPUs
mkdir -p "$OUT"
LOG="$OUT/node$NODE_RANK.log"

TRAIN=(python -m titan_train.cli train --metrics.log_freq 1 --metrics.no_enable_tensorboard
  --model.flavor "$FLAVOR" --training.seq_len "${SEQ_LEN:-2048}" --training.global_batch_size 16
  --training.steps 20 --lr_scheduler.warmup_steps 5 --lr_scheduler.decay_ratio 0
  --checkpoint.enable --checkpoint.interval 10)
SEED="$OUT/seed/checkpoint"

say() { echo "[node $NODE_RANK $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

wait_for() {  # wait_for FILE SECONDS: until FILE exists (written by the other node)
  local deadline=$((SECONDS + $2))
  until [[ -e "$1" ]]; do
    ((SECONDS > deadline)) && { say "gave up waiting for $1"; return 1; }
    sleep 2
  done
}

if [[ "$NODE_RANK" == 0 ]]; then
  say "seed: $FLAVOR, one process"
  timeout "$TIMEOUT" "${TRAIN[@]}" --job.dump_folder "$OUT/seed" \
    --parallelism.data_parallel_shard_degree 1 --checkpoint.create_seed_checkpoint \
    > "$OUT/seed.log" 2>&1 || { say "seed FAILED (see seed.log)"; exit 1; }
  touch "$OUT/seed.done"
else
  wait_for "$OUT/seed.done" "$TIMEOUT" || exit 1
fi

say "fsdp16: $((2 * NPROC)) ranks over 2 nodes, rendezvous at $RDZV_ENDPOINT"
timeout "$TIMEOUT" "${TRAIN[@]}" --nnodes 2 --node-rank "$NODE_RANK" \
  --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-titan-2x8}" --nproc-per-node "$NPROC" \
  --parallelism.data_parallel_shard_degree $((2 * NPROC)) \
  --training.local_batch_size $((16 / (2 * NPROC))) \
  --job.dump_folder "$OUT/fsdp16" --checkpoint.initial_load_path "$SEED" \
  > "$OUT/fsdp16.node$NODE_RANK.log" 2>&1
status=$?
say "fsdp16 exit $status"
touch "$OUT/fsdp16.node$NODE_RANK.done"
[[ "$NODE_RANK" == 0 ]] || exit "$status"
wait_for "$OUT/fsdp16.node1.done" "$TIMEOUT" || exit 1

say "resume8: fsdp16 from step 10 on $NPROC ranks of this node"
# A rerun in the same OUT keeps the earlier resume8 (renamed), never deletes it.
stamp=$(date +%Y%m%d-%H%M%S)
[[ -e "$OUT/resume8" ]] && mv "$OUT/resume8" "$OUT/resume8.$stamp"
[[ -e "$OUT/resume8.log" ]] && mv "$OUT/resume8.log" "$OUT/resume8.$stamp.log"
mkdir -p "$OUT/resume8/checkpoint"
cp -r "$OUT/fsdp16/checkpoint/step-10" "$OUT/resume8/checkpoint/"
timeout "$TIMEOUT" "${TRAIN[@]}" --nproc-per-node "$NPROC" \
  --parallelism.data_parallel_shard_degree "$NPROC" --training.local_batch_size $((16 / NPROC)) \
  --job.dump_folder "$OUT/resume8" > "$OUT/resume8.log" 2>&1
say "resume8 exit $?"

python - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def losses(name):
    path = out / name / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}

full, resumed = losses("fsdp16"), losses("resume8")
checkpoint = out / "fsdp16" / "checkpoint" / "step-10"
files = sorted(p.name for p in checkpoint.glob("*.distcp")) if checkpoint.is_dir() else []
print(f"{'item':<10} {'status':<8} detail")
print(f"{'fsdp16':<10} {'ok' if 20 in full else 'FAILED':<8} steps {len(full)}, "
      f"loss@20 {full.get(20, float('nan')):.4f}, step-10 files {len(files)}")
ok = 20 in resumed and 20 in full and abs(resumed[20] - full[20]) <= 0.02 * abs(full[20])
print(f"{'resume8':<10} {'ok' if ok else 'FAILED':<8} steps {sorted(resumed)[:1]}..20, "
      f"loss@20 {resumed.get(20, float('nan')):.4f} vs fsdp16's (2% allowed)")
sys.exit(0 if ok else 1)
EOF
