#!/usr/bin/env bash
# shellcheck disable=SC2317  # the item functions run through `bash -c item_NAME`
# One-GPU smoke test of titan's GPU paths, made for an offline node: runs from a checkout
# with the machine's own python3 and CUDA torch, installs nothing from an index, stops itself
# after 7 minutes, and leaves a summary table, its log and a tarball of the item logs in $OUT.
#
#   Where pip reaches an index (once, any machine):  bash tools/gpu_wheels.sh   # fills .whl/
#   On the GPU node, from the repository root:       bash tools/gpu_smoke.sh
#   Rerun some items only (env always runs):         ONLY=moe,async bash tools/gpu_smoke.sh
#
# Nothing is installed: the packages are imported from packages/*/src through PYTHONPATH,
# the wheels in .whl/ (titan-train's pure-Python dependencies that a stock torch image lacks:
# tyro, docstring-parser, typeguard) are unpacked with pip --no-index --target into the work
# folder, and a minimal .dist-info per titan package is written there too: titan-train finds
# its models, and titan-ckpt its state-dict adapters, through entry points, which Python reads
# from .dist-info folders only. The commands run as `python3 -m titan_train.cli`.
# It needs on the node: torch with CUDA, numpy, pyarrow, tiktoken, tokenizers, tensorboard,
# xxhash, safetensors and pytest (a stock PyTorch image has them).
#
# Environment: OUT (results folder; unset: ./gpu-smoke-<date>), ONLY (items, comma-separated),
# PYTHON (default python3), WORK (default /tmp/titan-gpu-smoke; every run and checkpoint
# goes there), WHEELS (default .whl). Exit status: 0 every item passed, 1 an item failed,
# 2 a usage error, 3 no CUDA device (after the env item, nothing else run).
#
# The items, in order of value (a window cut short still says the most); limits in seconds,
# set without a GPU measurement, adding up to the 420 s deadline:
#   env       python, torch, CUDA, the device, nvidia-smi, /dev/shm (F25); titan imports and
#             its registered models and adapters; whether CUDA is usable
#   plain     the default run on one GPU: bf16 autocast without FSDP (F1), NCCL one-rank
#             group, tokens/s and MFU against the peak table (F24), profiler trace and
#             memory snapshot, checkpoints and the last-step HF export
#   moe       DeepSeek-V3 debug model (MoE, grouped mm on the GPU)
#   async     async_with_pinned_mem: pinned staging after a device sync (F4b), the writer
#             process, the commit with digests hashed while written (F7)
#   asyncthr  async_mode=async: the model copied to the host in save(), the optimizer's state
#             from a background thread while the next forward runs; a second run resumes
#             from that step (10)
#   determ    training.deterministic: cuBLAS workspace set (F8)
#   resume    plain's folder again: its step 15 loaded on CUDA (DCP: model, optimizer, data),
#             the run continues to step 19 (needs plain's run)
#   gputests  the device-gated tests on the GPU: memory metrics and a real OOM's snapshot
#             (F24), the HF import's per-rank host cut on a CUDA mesh (F19), compiled loss =
#             eager loss (F15), pinned non-blocking batch copies, the async save's copy on its
#             own stream
#   tests     the CPU test suite stays pinned to CPU on a GPU host (F9): titan-dims' tests
#   1b, 3b    Llama 3 1B and 3B in bf16 (autocast, compile, per-op AC): tokens/s and MFU
#   oom       expect failure: Llama 3 8B at 32 x 2048 tokens runs out of memory in step 1;
#             the run must exit non-zero and leave memory_snapshot/iteration_1_exit/ (F24)
# The table's memory columns: peak reserved and allocated GiB of the last report, and the
# allocator's retries (above 0: fragmentation).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY="${PYTHON:-python3}"
WORK="${WORK:-/tmp/titan-gpu-smoke}"
WHEELS="${WHEELS:-$ROOT/.whl}"
DEADLINE_S=420
ITEMS=(env:60 plain:45 moe:30 async:30 asyncthr:40 determ:20 resume:25 gputests:45 tests:25
  1b:40 3b:40 oom:20)  # env: a cold import of a CUDA torch can take 20 s
NO_DEVICE=3

declare -A LIMIT STATUS
NAMES=()
total=0
for item in "${ITEMS[@]}"; do
  NAMES+=("${item%%:*}")
  LIMIT[${item%%:*}]=${item#*:}
  total=$((total + ${item#*:}))
done
((total <= DEADLINE_S)) || { echo "gpu_smoke.sh: item limits add up to $total s > $DEADLINE_S s" >&2; exit 2; }
SELECTED=" ${NAMES[*]} "
if [[ -n "${ONLY:-}" ]]; then
  for name in ${ONLY//,/ }; do
    if [[ " ${NAMES[*]} " != *" $name "* ]]; then
      echo "gpu_smoke.sh: ONLY names an unknown item '$name'; items: ${NAMES[*]}" >&2
      exit 2
    fi
  done
  SELECTED=" env ${ONLY//,/ } "
fi
if [[ -z "${OUT:-}" ]]; then
  OUT="$ROOT/gpu-smoke-$(date +%Y%m%d-%H%M%S)"
  echo "OUT is unset: results go to $OUT"
fi
mkdir -p "$OUT" "$WORK" || exit 2
LOG="$WORK/smoke.log"
: > "$LOG"
DEADLINE=$((SECONDS + DEADLINE_S))
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
unset TITAN_DEVICE       # let detection pick the GPU (the tests item's conftest pins CPU)
export PIP_NO_INDEX=1 PIP_ROOT_USER_ACTION=ignore  # nothing here may reach an index
export PY WORK ROOT

# The import path: the carried wheels and the generated .dist-info, then titan's sources.
SITE="$WORK/site"
rm -rf "$SITE" && mkdir -p "$SITE"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
  echo "unpack: $PY -m pip install --no-index --no-deps --target $SITE ${wheels[*]}" >> "$LOG"
  "$PY" -m pip install --no-index --no-deps --quiet --target "$SITE" "${wheels[@]}" >> "$LOG" 2>&1 ||
    echo "unpacking the wheels in $WHEELS failed (see $LOG)" | tee -a "$LOG"
fi
"$PY" - "$SITE" packages/*/ >> "$LOG" 2>&1 <<'EOF' || echo "writing the .dist-info failed" | tee -a "$LOG"
# A .dist-info per package: its name, version and entry points, read from its pyproject.toml.
import pathlib, re, sys, tomllib
site = pathlib.Path(sys.argv[1])
for package in map(pathlib.Path, sys.argv[2:]):
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    about = next((package / "src").glob("*/__about__.py")).read_text()
    version = re.search(r'__version__ = "([^"]+)"', about)[1]
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    info = site / f"{project['name'].replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n")
    info.joinpath("entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in groups.items()))
    print("dist-info:", info.name)
EOF
PYTHONPATH="$SITE$(printf ':%s/src' "$ROOT"/packages/*)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
shopt -u nullglob

train() { "$PY" -m titan_train.cli --metrics.log_freq 1 --metrics.no_enable_tensorboard "$@"; }

item_env() {
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  df -h /dev/shm
  "$PY" - <<'EOF' || return 1
import importlib.util, platform, sys
import torch
cuda = torch.cuda.is_available()
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if cuda else None)
needed = ["tyro", "numpy", "pyarrow", "tiktoken", "tokenizers", "tensorboard", "xxhash",
          "safetensors", "pytest"]
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing: {', '.join(missing)}: run `bash tools/gpu_wheels.sh` where pip reaches "
             "an index and bring .whl/ along (a stock torch image has the others)")
from importlib.metadata import entry_points
import tyro  # noqa: F401 (an old typing_extensions breaks it here, not in a run)
import titan_train.cli  # noqa: F401
from titan_train.config.registry import list_models
adapters = sorted(ep.name for ep in entry_points(group="titan.state_dict_adapters"))
print("models", list_models(), "adapters", adapters)
if not {"llama3", "deepseek_v3"} <= set(list_models()) or "llama3" not in adapters:
    sys.exit("titan's entry points are missing: the work folder's site/*.dist-info not found")
print("cuda_available", cuda)
EOF
}
item_plain() {
  train --job.dump_folder "$WORK/plain" --training.steps 20 --checkpoint.interval 5 \
    --checkpoint.last_save_model_only --checkpoint.last_save_in_hf --profiling.enable_profiling \
    --profiling.profile_freq 10 \
    --profiling.enable_memory_snapshot
}
item_moe() {
  train --job.dump_folder "$WORK/moe" --model.name deepseek_v3 --model.flavor debugmodel \
    --training.steps 10 --checkpoint.no_enable
}
item_async() {
  train --job.dump_folder "$WORK/async" --training.steps 12 --checkpoint.interval 5 \
    --checkpoint.async_mode async_with_pinned_mem
}
item_asyncthr() {
  local args=(--job.dump_folder "$WORK/asyncthr" --checkpoint.interval 5
    --checkpoint.async_mode async --checkpoint.no_last_save_model_only)
  train "${args[@]}" --training.steps 12 && train "${args[@]}" --training.steps 14 \
    --checkpoint.load_step 10
}
item_determ() {
  train --job.dump_folder "$WORK/determ" --training.steps 4 --training.deterministic \
    --checkpoint.no_enable
}
item_resume() {
  [[ -d "$WORK/plain" ]] || { echo "no run in $WORK/plain to resume: ONLY=plain,resume"; return 1; }
  # step 20 is plain's model-only HF export: resume the full state of step 15
  train --job.dump_folder "$WORK/plain" --checkpoint.load_step 15 --training.steps 19 \
    --checkpoint.interval 5
}
item_gputests() {
  TITAN_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -rs \
    packages/titan-train/tests/metrics/test_memory.py packages/titan-train/tests/test_oom_snapshot.py \
    packages/titan-ckpt/tests/test_hf_import_slices.py packages/titan-train/tests/test_compiled_loss.py \
    packages/titan-train/tests/test_next_batches.py \
    packages/titan-ckpt/tests/test_async.py::test_deferred_copy_runs_on_its_own_stream_after_the_queued_step
}
item_tests() { "$PY" -m pytest -q -p no:cacheprovider packages/titan-dims/tests; }
compiled() {  # compiled FLAVOR: one Llama 3 flavor, bf16, compiled, per-op AC
  train --job.dump_folder "$WORK/${1,,}" --model.flavor "$1" --training.steps 6 \
    --training.seq_len 2048 --training.local_batch_size 2 --parallelize.compile \
    --checkpoint.no_enable --parallelize.activation_checkpoint.mode selective \
    --parallelize.activation_checkpoint.selective_option op
}
item_1b() { compiled 1B; }
item_3b() { compiled 3B; }
item_oom() {  # the run must fail and leave the OOM snapshot
  local snapshot="$WORK/oom/memory_snapshot/iteration_1_exit/rank0_memory_snapshot.pickle"
  if train --job.dump_folder "$WORK/oom" --model.flavor 8B --training.steps 2 \
    --training.seq_len 2048 --training.local_batch_size 32 --checkpoint.no_enable; then
    echo "expected an out-of-memory failure, but the run succeeded"
    return 1
  fi
  "$PY" -c "import pickle, sys; s = pickle.load(open(sys.argv[1], 'rb'));
print('OOM snapshot:', len(s['segments']), 'segments')" "$snapshot"
}
export -f train compiled "${NAMES[@]/#/item_}"

run_item() {  # run_item NAME: its own log and limit, one console line
  local name="$1" limit="${LIMIT[$1]}" left=$((DEADLINE - SECONDS)) start=$SECONDS rc=0
  local last=""
  if ((left < 5)); then
    STATUS[$name]="skipped (deadline)"
  else
    ((limit > left)) && limit=$left
    [[ $name == resume ]] || rm -rf "${WORK:?}/$name"
    echo "== $name (limit $limit s, log $WORK/$name.log)" >> "$LOG"
    timeout -k 10 "$limit" bash -c "item_$name" > "$WORK/$name.log" 2>&1 || rc=$?
    tail -n 5 "$WORK/$name.log" >> "$LOG"
    if ((rc == 0)); then STATUS[$name]=ok
    elif ((rc == 124 || rc == 137)); then STATUS[$name]="FAILED (timeout)"
    else STATUS[$name]="FAILED (exit $rc)"
    fi
    last=$(tail -n 1 "$WORK/$name.log" | cut -c1-100)
  fi
  printf "%-9s %-18s %4d s  %s\n" "$name" "${STATUS[$name]}" $((SECONDS - start)) "$last" |
    tee -a "$LOG"
}

summary() {
  echo "item      status             last loss  tokens/s/GPU  MFU %  reserved GiB  alloc GiB  retries"
  for name in "${NAMES[@]}"; do
    local metrics="$WORK/$name/metrics.jsonl" numbers="-"
    if [[ -f "$metrics" ]]; then
      numbers=$("$PY" - "$metrics" <<'EOF'
import json, sys
last = [json.loads(line) for line in open(sys.argv[1])][-1]
nan = float("nan")
print(f"{last['loss']:9.4f}  {last['tps']:12,.0f}  {last.get('mfu_pct', nan):5.1f}"
      f"  {last['memory_gib']:12.2f}  {last.get('memory_allocated_gib', nan):9.2f}"
      f"  {last.get('memory_alloc_retries', nan):7.0f}")
EOF
)
    fi
    printf "%-9s %-18s %s\n" "$name" "${STATUS[$name]:-not run}" "$numbers"
  done
}

finish() {  # finish STATUS: the table, then the log and the item logs into $OUT
  summary | tee "$OUT/summary.txt"
  cp "$LOG" "$OUT/smoke.log"
  (cd "$WORK" && find . -path ./site -prune -o \( -name '*.log' -o -name '*.jsonl' \) -print |
    tar czf "$OUT/logs.tar.gz" -T -)
  echo "results: $OUT (summary.txt, smoke.log, logs.tar.gz); runs in $WORK"
  exit "$1"
}

echo "gpu_smoke: $PY, work in $WORK, deadline $DEADLINE_S s, items:$SELECTED" | tee -a "$LOG"
run_item env
if [[ ${STATUS[env]} != ok ]]; then
  echo "the environment item failed: nothing else can run (see $OUT/smoke.log)" | tee -a "$LOG"
  finish 1
fi
if ! grep -q "cuda_available True" "$WORK/env.log"; then
  echo "no CUDA device: torch sees no GPU here; stopping after the env item (exit $NO_DEVICE)" |
    tee -a "$LOG"
  finish "$NO_DEVICE"
fi
for name in "${NAMES[@]:1}"; do
  [[ $SELECTED == *" $name "* ]] && run_item "$name"
done
failed=0
for name in "${NAMES[@]}"; do
  [[ ${STATUS[$name]:-ok} == ok ]] || failed=1
done
finish "$failed"
