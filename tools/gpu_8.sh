#!/usr/bin/env bash
# The 8-GPU run of the GPU-readiness review (issue 18) on one node: every parallel layout of
# one model from one seed checkpoint against FSDP, checkpoints resharded across layouts, the
# final Hugging Face export and its re-import, a hung rank, torchft replica groups and
# profiling. One time budget for everything (BUDGET seconds, default 5400), all output under
# one folder, a summary table at the end. Not yet run on GPUs; its plumbing was tried on CPU
# (gloo, SMALL=debugmodel SEQ_LEN=64 FT_STEPS=30): fsdp8_small, ddp8_small, ckpt_sync,
# ckpt_pinned, resume_tp, hsdp_small, ft_clean and ft_kill ran and compared as meant (DDP8,
# the resumed TP2xFSDP4 and ft_clean's gradient norm within 0.01% of their references).
#
#   From a fresh checkout, on a node with 8 NVIDIA GPUs and a CUDA build of torch 2.13:
#     pip install -e packages/titan-dims -e packages/titan-ckpt -e packages/titan-optim \
#         -e packages/titan-models -e "packages/titan-train[test,torchft]"
#     bash tools/gpu_8.sh [OUT_DIR]             # default OUT_DIR: ./gpu-8-<date>
#
#   Knobs (environment): BUDGET (s), FLAVOR (default 8B) for the layouts, export and profile;
#   SMALL (default 1B) for DDP, checkpointing, torchft and the hang; ONLY="item item ..." runs
#   those items (and the seeds they need) alone; SEQ_LEN (default 2048). The plumbing can be
#   tried on CPU: SMALL=debugmodel SEQ_LEN=64 ONLY="fsdp8_small ddp8_small" (gloo).
#   Disk: about 70 GB at the peak (the 8B seed 32 GB, the export 2 x 16 GB; a 1B checkpoint
#   with AdamW state ~15 GB); each checkpoint is deleted once no later item reads it.
#
# Items (findings of ../shared/reviews/gpu-readiness.md in brackets); each layout trains 20
# steps of 16 x 2048 tokens from the same seed checkpoint, so its last loss is compared with
# fsdp8's (the "vs ref" column; a "!" marks more than 2% apart):
#   seed, seed_small     the seed checkpoints, one process, built on the host [F10]
#   fsdp8 ... pp2_tp2_fsdp2   FSDP8, compiled (blocks and loss [F15]), HSDP 2x4, TP2xFSDP4,
#                        TP8, CP2xFSDP4 with torch's CP (eager and compiled [F12]) and titan's
#                        two (no compile [F11]), TP2xFSDP4 compiled (the loss under loss
#                        parallel), the compiled CP and TP runs again from warm compile
#                        caches, PP2 1F1B, PP4 Interleaved1F1B and ZBV, PP2xTP2xFSDP2;
#                        tokens/s and MFU per GPU count each token once [F2]
#   fsdp8_small, ddp8_small   DDP8 autocasts to bf16 [F1] (1B: 8B replicas do not fit)
#   pp_init              PP4 stages start with different weights on CUDA [F5]
#   ckpt_sync/async/pinned    saves at steps 5 and 10 in each async mode: the table's notes
#                        hold the save and staging seconds [F4b, F7, F25]
#   resume_tp, ckpt_pp, resume_pp_fsdp   step 10 resumed on another layout (FSDP8 ->
#                        TP2xFSDP4, PP2 -> FSDP8): step 20's loss against fsdp8_small's
#   export, reimport     the last-step HF export of FLAVOR under the 100 s collective timeout
#                        [F14], read back on TP2xFSDP4: equal validation loss [F19]
#   hang                 expect failure: a rank sleeps 120 s at step 3 under a 30 s timeout;
#                        the run must end, with flight-recorder traces [F20, F21, F22]
#   hsdp_small, ft_clean, ft_kill   two torchft replica groups of 4 GPUs under a lighthouse
#                        (bucketed gradient average [F23]) against HSDP 2x4 (gradient
#                        norm: a group logs its own half-batch loss), FT_STEPS steps
#                        (default 100); then group 1 is killed at step 10 and restarted (its
#                        data stream anew): both groups must finish
#   profile              traces and memory snapshots of all 8 ranks (files and sizes) [F24]
#   cp_profile           one profiled CP2xFSDP4 step: host-to-device copies and host syncs
#                        fewer than the attention layers (none per layer) [F6]
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="$(realpath -m "${1:-gpu-8-$(date +%Y%m%d-%H%M%S)}")"
mkdir -p "$OUT"
LOG="$OUT/gpu8.log"
: > "$OUT/items.tsv"
BUDGET="${BUDGET:-5400}"
FLAVOR="${FLAVOR:-8B}"
SMALL="${SMALL:-1B}"
ONLY="${ONLY:-}"
unset TITAN_DEVICE  # let detection pick the GPUs
DEADLINE=$((SECONDS + BUDGET))

TRAIN=(python -m titan_train.cli train --metrics.log_freq 1 --metrics.no_enable_tensorboard)
# A constant lr after 5 warmup steps (no decay): runs of different lengths, and a run
# resumed at step 10, train every step at the same lr, so losses compare step by step.
BATCH=(--training.seq_len "${SEQ_LEN:-2048}" --training.local_batch_size 2
  --training.global_batch_size 16 --lr_scheduler.warmup_steps 5 --lr_scheduler.decay_ratio 0)
SEED="$OUT/seed/checkpoint"
SEED_SMALL="$OUT/seed_small/checkpoint"

wanted() {  # wanted NAME: whether ONLY (if set) names the item
  [[ -z "$ONLY" || " $ONLY " == *" $1 "* ]]
}

# item NAME SECONDS REF METRIC REF_STEP COMMAND...: one item under its own limit and what is
# left of the budget, logged to OUT/NAME.log; a row of OUT/items.tsv for the summary.
# FOLDER=... names the run folder when it is not OUT/NAME.
item() {
  local name="$1" limit="$2" ref="$3" key="$4" ref_step="$5" left=$((DEADLINE - SECONDS))
  local folder="${FOLDER:-$OUT/$1}"
  shift 5
  wanted "$name" || return 0
  local status started=$SECONDS
  if ((left < 30)); then
    status="skipped (budget spent)"
  else
    ((limit > left)) && limit=$left
    echo "== $name: $*" | tee -a "$LOG"
    if timeout --kill-after 30 "$limit" "$@" > "$OUT/$name.log" 2>&1; then
      status=ok
    else
      status="FAILED($?)"
    fi
    tail -n 2 "$OUT/$name.log" | tee -a "$LOG"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" $((SECONDS - started)) \
    "$folder" "$ref" "$key" "$ref_step" >> "$OUT/items.tsv"
}

# A layout run: 20 steps from SEED, no checkpoint written. layout NAME SECONDS ARGS...
layout() {
  local name="$1" limit="$2"
  shift 2
  item "$name" "$limit" fsdp8 loss "" "${TRAIN[@]}" --nproc-per-node 8 \
    --job.dump_folder "$OUT/$name" --model.flavor "$FLAVOR" "${BATCH[@]}" --training.steps 20 \
    --checkpoint.initial_load_path "$SEED" --checkpoint.load_only "$@"
}

small() {  # small NAME SECONDS REF STEPS ARGS...: a SMALL run of STEPS steps from SEED_SMALL
  local name="$1" limit="$2" ref="$3" steps="$4"
  shift 4
  item "$name" "$limit" "$ref" loss "" "${TRAIN[@]}" --nproc-per-node 8 \
    --job.dump_folder "$OUT/$name" --model.flavor "$SMALL" "${BATCH[@]}" \
    --training.steps "$steps" --checkpoint.initial_load_path "$SEED_SMALL" "$@"
}

P=--parallelism
shard() { echo "$P.data_parallel_shard_degree $1"; }

seeds() {
  local need_big=0 need_small=0 name
  for name in fsdp8 fsdp8_compile hsdp2x4 tp2_fsdp4 tp8 cp2_fsdp4 cp2_fsdp4_compile \
    tp2_fsdp4_compile cp2_fsdp4_compile_warm tp2_fsdp4_compile_warm cp2_titan cp2_ring \
    pp2_1f1b pp4_interleaved pp4_zbv pp2_tp2_fsdp2 export profile cp_profile; do
    wanted "$name" && need_big=1
  done
  for name in fsdp8_small ddp8_small ckpt_sync ckpt_async ckpt_pinned resume_tp ckpt_pp \
    resume_pp_fsdp hsdp_small ft_clean ft_kill; do
    wanted "$name" && need_small=1
  done
  # One process writes the unsharded model as step 0, built on the host (F10).
  ((need_big)) && ONLY="" item seed 900 "" loss "" "${TRAIN[@]}" --job.dump_folder "$OUT/seed" \
    --model.flavor "$FLAVOR" $(shard 1) --checkpoint.create_seed_checkpoint
  ((need_small)) && ONLY="" item seed_small 300 "" loss "" "${TRAIN[@]}" \
    --job.dump_folder "$OUT/seed_small" --model.flavor "$SMALL" $(shard 1) \
    --checkpoint.create_seed_checkpoint
  return 0
}

layouts() {
  # shellcheck disable=SC2046  # the degree pairs split on purpose
  layout fsdp8 300 $(shard 8)
  layout fsdp8_compile 420 $(shard 8) --parallelize.compile
  layout hsdp2x4 300 $P.data_parallel_replicate_degree 2 $(shard 4)
  layout tp2_fsdp4 300 $P.tensor_parallel_degree 2 $(shard 4)
  layout tp8 300 $P.tensor_parallel_degree 8 $(shard 1)
  layout cp2_fsdp4 300 $P.context_parallel_degree 2 $(shard 4)
  layout cp2_fsdp4_compile 420 $P.context_parallel_degree 2 $(shard 4) --parallelize.compile
  layout tp2_fsdp4_compile 420 $P.tensor_parallel_degree 2 $(shard 4) --parallelize.compile
  # Again, now from torch's warm compile caches: a graph whose trace depends on the rank
  # below dynamo (DTensor dispatch: loss parallel's vocabulary offset, torch CP's ring) can
  # be served to the wrong rank by the AOTAutograd cache (seen for the loss on CPU).
  layout cp2_fsdp4_compile_warm 420 $P.context_parallel_degree 2 $(shard 4) --parallelize.compile
  layout tp2_fsdp4_compile_warm 420 $P.tensor_parallel_degree 2 $(shard 4) --parallelize.compile
  layout cp2_titan 300 $P.context_parallel_degree 2 $(shard 4) --parallelize.cp_attention titan
  layout cp2_ring 300 $P.context_parallel_degree 2 $(shard 4) \
    --parallelize.cp_attention titan_ring
  layout pp2_1f1b 300 $P.pipeline_parallel_degree 2 $(shard 4) --pipeline.schedule 1F1B
  layout pp4_interleaved 300 $P.pipeline_parallel_degree 4 $(shard 2) \
    --pipeline.schedule Interleaved1F1B
  layout pp4_zbv 300 $P.pipeline_parallel_degree 4 $(shard 2) --pipeline.schedule ZBVZeroBubble
  layout pp2_tp2_fsdp2 300 $P.pipeline_parallel_degree 2 $P.tensor_parallel_degree 2 $(shard 2)
  # DDP replicates the whole model and its AdamW state: SMALL, against FSDP8 of SMALL.
  small fsdp8_small 240 "" 20 $(shard 8) --checkpoint.load_only
  small ddp8_small 240 fsdp8_small 20 $P.data_parallel_replicate_degree 8 $(shard 1) \
    --checkpoint.load_only
  # Fresh init (no seed), lr 0: the step-1 checkpoint holds the initial weights (F5).
  item pp_init 300 "" loss "" bash -c '"$@" && python tools/gpu8/pp_init_check.py \
    "'"$OUT"'/pp_init/checkpoint/step-1"' pp_init "${TRAIN[@]}" --nproc-per-node 8 \
    --job.dump_folder "$OUT/pp_init" --model.flavor "$SMALL" "${BATCH[@]}" --training.steps 1 \
    --optimizer.lr 0 --lr_scheduler.warmup_steps 1 $P.pipeline_parallel_degree 4 $(shard 2) \
    --checkpoint.interval 1 --checkpoint.last_save_model_only
  prune pp_init
}

checkpoints() {
  local mode
  for mode in sync async pinned; do
    local async_mode=$mode
    [[ $mode == sync ]] && async_mode=disabled
    [[ $mode == pinned ]] && async_mode=async_with_pinned_mem
    small "ckpt_$mode" 300 fsdp8_small 10 $(shard 8) --checkpoint.interval 5 \
      --checkpoint.async_mode "$async_mode" --checkpoint.keep_latest_k 2
  done
  prune ckpt_sync ckpt_async
  # Step 10 (full state) resumed on another layout, through step 20, in a copy of the
  # saving run's folder (hard links: no second copy of the checkpoint on disk).
  resume resume_tp ckpt_pinned $P.tensor_parallel_degree 2 $(shard 4)
  prune ckpt_pinned resume_tp
  small ckpt_pp 300 fsdp8_small 10 $P.pipeline_parallel_degree 2 $(shard 4) \
    --checkpoint.interval 10
  resume resume_pp_fsdp ckpt_pp $(shard 8)
  prune ckpt_pp resume_pp_fsdp
}

prune() {  # prune ITEM...: delete the items' checkpoints (their metrics and logs stay)
  local name
  for name in "$@"; do rm -rf "${OUT:?}/$name/checkpoint"; done
}

resume() {  # resume NAME FROM LAYOUT...: FROM's folder, resumed from its step 10 to step 20
  local name="$1" from="$2"
  shift 2
  wanted "$name" || return 0
  rm -rf "${OUT:?}/$name"
  if [[ ! -d "$OUT/$from/checkpoint/step-10" ]]; then
    item "$name" 10 "" loss "" bash -c "echo 'no step-10 checkpoint in $OUT/$from'; exit 1"
    return 0
  fi
  cp -al "$OUT/$from" "$OUT/$name" && rm -f "$OUT/$name/metrics.jsonl"
  item "$name" 300 fsdp8_small loss "" "${TRAIN[@]}" --nproc-per-node 8 \
    --job.dump_folder "$OUT/$name" --model.flavor "$SMALL" "${BATCH[@]}" --training.steps 20 \
    --checkpoint.interval 100 --checkpoint.initial_load_path "$SEED_SMALL" "$@"
}

export_reimport() {
  local validation=(--validation.enable --validation.steps 2
    --validation.local_batch_size 2 --validation.seq_len "${SEQ_LEN:-2048}")
  item export 600 "" validation/loss "" "${TRAIN[@]}" --nproc-per-node 8 \
    --job.dump_folder "$OUT/export" --model.flavor "$FLAVOR" "${BATCH[@]}" --training.steps 5 \
    --checkpoint.initial_load_path "$SEED" $(shard 8) --checkpoint.interval 100 \
    --checkpoint.last_save_model_only --checkpoint.last_save_in_hf \
    --checkpoint.export_dtype bfloat16 --comm.train_timeout_seconds 100 \
    "${validation[@]}" --validation.freq 5
  # lr 0: one step leaves the weights as exported; its validation must match export's.
  item reimport 420 export validation/loss 5 "${TRAIN[@]}" --nproc-per-node 8 \
    --job.dump_folder "$OUT/reimport" --model.flavor "$FLAVOR" "${BATCH[@]}" \
    --training.steps 1 --optimizer.lr 0 --lr_scheduler.warmup_steps 1 \
    --checkpoint.initial_load_path "$OUT/export/checkpoint/step-5/hf" \
    --checkpoint.initial_load_in_hf --checkpoint.load_only \
    $P.tensor_parallel_degree 2 $(shard 4) "${validation[@]}" --validation.freq 1
  prune export
}

hang() {
  # Succeeds when the run fails and the flight recorder wrote traces.
  item hang 420 "" loss "" bash -c '! HANG_SECONDS=120 HANG_STEP=3 python -m \
    torch.distributed.run --standalone --nproc-per-node 8 tools/gpu8/hang_rank.py "$@" && \
    ls -la "'"$OUT"'/hang/comm_traces" && test -n "$(ls "'"$OUT"'/hang/comm_traces")"' hang \
    train --metrics.log_freq 1 --metrics.no_enable_tensorboard --job.dump_folder "$OUT/hang" \
    --model.flavor "$SMALL" "${BATCH[@]}" --training.steps 10 --checkpoint.no_enable \
    --comm.train_timeout_seconds 30 $(shard 8)
}

torchft() {
  local steps="${FT_STEPS:-100}"
  small hsdp_small 300 "" "$steps" $P.data_parallel_replicate_degree 2 $(shard 4) \
    --checkpoint.load_only
  # Each group takes half of the 16 sequences a step: 8 per group (2 on each of 4 GPUs).
  local groups=("${TRAIN[@]}" --nproc-per-node 4 --model.flavor "$SMALL" "${BATCH[@]}"
    --training.global_batch_size 8 --training.steps "$steps"
    --checkpoint.initial_load_path "$SEED_SMALL" --checkpoint.interval 5
    --checkpoint.keep_latest_k 2 $(shard 4))
  # A group logs the loss of its own half of the batch; the gradient norm is the job's
  # (averaged over the groups): the one to compare with HSDP's.
  item ft_clean 420 hsdp_small grad_norm "" bash tools/gpu8/ft_groups.sh "$OUT/ft_clean" 0 \
    "${groups[@]}"
  item ft_kill 600 hsdp_small grad_norm "" bash tools/gpu8/ft_groups.sh "$OUT/ft_kill" 1 \
    "${groups[@]}"
  prune ft_clean ft_kill
}

profile() {
  item profile 420 fsdp8 loss "" bash -c '"$@" && cd "'"$OUT"'/profile" && find profile_traces \
    memory_snapshot -type f -printf "%s %p\n" | sort -k2 && test "$(find profile_traces \
    -name "rank*_trace.json" | wc -l)" -eq 8 && test "$(find memory_snapshot -name \
    "rank*_memory_snapshot.pickle" | wc -l)" -eq 8' profile "${TRAIN[@]}" --nproc-per-node 8 \
    --job.dump_folder "$OUT/profile" --model.flavor "$FLAVOR" "${BATCH[@]}" --training.steps 10 \
    --checkpoint.initial_load_path "$SEED" --checkpoint.load_only $(shard 8) \
    --profiling.enable_profiling --profiling.enable_memory_snapshot --profiling.profile_freq 10 \
    --metrics.save_for_all_ranks
}

cp_profile() {  # one profiled CP2xFSDP4 step: no copy or sync per attention layer [F6]
  local layers
  layers=$(python -c "from titan_models import llama3_args; print(llama3_args('$FLAVOR').n_layers)")
  item cp_profile 420 "" loss "" bash -c '"$@" && python tools/gpu8/cp_trace.py \
    "$(find "'"$OUT"'/cp_profile/profile_traces" -name "rank0_trace.json" | sort | tail -n 1)" \
    '"$layers" cp_profile "${TRAIN[@]}" --nproc-per-node 8 --job.dump_folder "$OUT/cp_profile" \
    --model.flavor "$FLAVOR" "${BATCH[@]}" --training.steps 5 --checkpoint.initial_load_path \
    "$SEED" --checkpoint.load_only $(shard 4) $P.context_parallel_degree 2 \
    --profiling.enable_profiling --profiling.profile_freq 5 --profiling.profiler_warmup 1 \
    --profiling.profiler_active 1
}

{
  python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(),
    'x', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  df -h /dev/shm "$OUT"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log" | tee -a "$LOG"
seeds
layouts
checkpoints
export_reimport
hang
torchft
profile
cp_profile
python tools/gpu8/summary.py "$OUT" | tee "$OUT/summary.txt"
