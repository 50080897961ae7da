#!/usr/bin/env bash
# One-GPU smoke test of titan's GPU paths: about 5 minutes on an H100/H200-class GPU, all
# under one timeout, everything written under one folder, a summary table at the end.
#
#   From a fresh checkout, on a machine with one NVIDIA GPU and a CUDA build of torch 2.13:
#     pip install -e packages/titan-dims -e packages/titan-ckpt -e packages/titan-optim \
#         -e packages/titan-models -e "packages/titan-train[test]"
#     bash tools/gpu_smoke.sh [OUT_DIR]          # default OUT_DIR: ./gpu-smoke-<date>
#
# What each item proves (see ../shared/reviews/gpu-readiness.md for the findings named):
#   env        torch/CUDA versions, the device, /dev/shm size (F25)
#   plain      the default run on one GPU: bf16 autocast without FSDP (F1), NCCL one-rank
#              group, tokens/s and MFU against the peak table (F24), profiler trace and
#              memory snapshot, checkpoints and the last-step HF export
#   resume     the same folder again: DCP load on CUDA, the run continues
#   async      torchrun, async_with_pinned_mem: pinned staging after a device sync (F4b),
#              the writer process, the commit with digests hashed while written (F7)
#   asyncthr   async_mode=async: the model copied to the host in save(), the optimizer's
#              state from a background thread (from the second save on) while the next
#              forward runs, the optimizer step waiting for it; a second run resumes from
#              that step (10)
#   1b, 3b     Llama 3 1B and 3B in bf16 on one GPU (autocast, compile, per-op AC): tokens/s
#              and MFU. 8B with AdamW needs more than one GPU's memory (weights, gradients
#              and moments in fp32: 128 GB): it belongs to the 8-GPU plan, as does FSDP CPU
#              offload (F3), which needs FSDP, i.e. two ranks or more.
#              With --parallelize.compile the loss over the vocabulary is compiled too (F15).
#   determ     training.deterministic: cuBLAS workspace set (F8)
#   gputests   the device-gated tests, on the GPU: memory metrics (allocated, reserved,
#              retries, OOM count) and a real OOM's memory snapshot (F24), the HF import's
#              per-rank host cut on a CUDA mesh (F19), compiled loss = eager loss (F15)
#   oom        expect failure: Llama 3 8B at 32 x 2048 tokens runs out of memory in step 1;
#              the run must exit non-zero and leave memory_snapshot/iteration_1_exit/ (F24)
#   moe        DeepSeek-V3 debug model (MoE, grouped mm on the GPU)
#   tests      the CPU test suite stays pinned to CPU on a GPU host (F9): titan-dims' tests
#
# The summary's memory columns: peak reserved and peak allocated GiB of the last report, and
# the allocator's retries (above 0: fragmentation).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-gpu-smoke-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
LOG="$OUT/smoke.log"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
unset TITAN_DEVICE  # let detection pick the GPU
declare -A STATUS
DEADLINE=$((SECONDS + 540))  # everything under one limit, so one rerun fits a short window

run() {  # run NAME SECONDS COMMAND...: one item, its own log, its own and the overall limit
  local name="$1" limit="$2" left=$((DEADLINE - SECONDS))
  shift 2
  if ((left < 10)); then
    STATUS[$name]="skipped (the 540 s budget is spent)"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name: $*" | tee -a "$LOG"
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    STATUS[$name]=ok
  else
    STATUS[$name]="FAILED (exit $?, see $OUT/$name.log)"
  fi
  tail -n 3 "$OUT/$name.log" | tee -a "$LOG"
}

TRAIN=(python -m titan_train.cli --metrics.log_freq 1 --metrics.no_enable_tensorboard)

expect_oom() {  # expect_oom FOLDER COMMAND...: the command fails and leaves an OOM snapshot
  local folder="$1" snapshot="$1/memory_snapshot/iteration_1_exit/rank0_memory_snapshot.pickle"
  shift
  if "$@"; then
    echo "expected an out-of-memory failure, but the run succeeded"
    return 1
  fi
  grep -q "OutOfMemoryError\|out of memory" "$OUT/oom.log" || echo "(no OOM message in the log)"
  python -c "import pickle, sys; s = pickle.load(open(sys.argv[1], 'rb'));
print('OOM snapshot:', len(s['segments']), 'segments')" "$snapshot"
}
export -f expect_oom
export OUT

main() {
  run env 30 bash -c 'python -c "import torch; print(torch.__version__, torch.version.cuda,
    torch.cuda.get_device_name())"; nvidia-smi; df -h /dev/shm'
  run plain 120 "${TRAIN[@]}" --job.dump_folder "$OUT/plain" --training.steps 20 \
    --checkpoint.interval 5 --checkpoint.last_save_in_hf --profiling.enable_profiling \
    --profiling.profile_freq 10 --profiling.enable_memory_snapshot
  run resume 60 "${TRAIN[@]}" --job.dump_folder "$OUT/plain" --training.steps 25 \
    --checkpoint.interval 5
  run async 90 "${TRAIN[@]}" --nproc-per-node 1 --job.dump_folder "$OUT/async" \
    --training.steps 12 --checkpoint.interval 5 --checkpoint.async_mode async_with_pinned_mem
  run asyncthr 90 bash -c '"$@" --training.steps 12 && "$@" --training.steps 14 \
    --checkpoint.load_step 10' asyncthr "${TRAIN[@]}" --job.dump_folder "$OUT/asyncthr" \
    --checkpoint.interval 5 --checkpoint.async_mode async --checkpoint.no_last_save_model_only
  for flavor in 1B 3B; do
    run "${flavor,,}" 150 "${TRAIN[@]}" --job.dump_folder "$OUT/${flavor,,}" \
      --model.flavor "$flavor" --training.steps 8 --training.seq_len 2048 \
      --training.local_batch_size 2 --parallelize.compile --checkpoint.no_enable \
      --parallelize.activation_checkpoint.mode selective \
      --parallelize.activation_checkpoint.selective_option op
  done
  run determ 60 "${TRAIN[@]}" --job.dump_folder "$OUT/determ" --training.steps 4 \
    --training.deterministic --checkpoint.no_enable
  run gputests 120 env TITAN_DEVICE=cuda python -m pytest -q -p no:cacheprovider -rs \
    packages/titan-train/tests/metrics/test_memory.py packages/titan-train/tests/test_oom_snapshot.py \
    packages/titan-ckpt/tests/test_hf_import_slices.py packages/titan-train/tests/test_compiled_loss.py
  run oom 90 bash -c 'expect_oom "$@"' expect_oom "$OUT/oom" "${TRAIN[@]}" --job.dump_folder "$OUT/oom" \
    --model.flavor 8B --training.steps 2 --training.seq_len 2048 \
    --training.local_batch_size 32 --checkpoint.no_enable
  run moe 90 "${TRAIN[@]}" --job.dump_folder "$OUT/moe" --model.name deepseek_v3 \
    --model.flavor debugmodel --training.steps 10 --checkpoint.no_enable
  run tests 120 python -m pytest -q -p no:cacheprovider packages/titan-dims/tests
}

summary() {
  echo
  echo "item      status    last loss  tokens/s/GPU  MFU %   reserved GiB  alloc GiB  retries"
  for name in env plain resume async asyncthr 1b 3b determ gputests oom moe tests; do
    local metrics="$OUT/$name/metrics.jsonl" numbers="-"
    if [[ -f "$metrics" ]]; then
      numbers=$(python - "$metrics" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
last = records[-1]
nan = float("nan")
print(f"{last['loss']:9.4f}  {last['tps']:12,.0f}  {last.get('mfu_pct', nan):5.1f}"
      f"  {last['memory_gib']:12.2f}  {last.get('memory_allocated_gib', nan):9.2f}"
      f"  {last.get('memory_alloc_retries', nan):7.0f}")
EOF
)
    fi
    printf "%-9s %-9s %s\n" "$name" "${STATUS[$name]:-not run}" "$numbers"
  done
}

main
summary | tee "$OUT/summary.txt"
