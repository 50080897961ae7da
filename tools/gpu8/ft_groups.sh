#!/usr/bin/env bash
# Two torchft replica groups of 4 GPUs each (titan-train --nproc-per-node 4) under a local
# lighthouse, sharing one dump folder; used by tools/gpu_8.sh.
#
#   bash tools/gpu8/ft_groups.sh FOLDER KILL TRAIN_ARGS...
#
# KILL=1 kills replica group 1 (its launcher and ranks) once its metrics reach step 10 and
# starts it again: it must rejoin (healing from group 0) and both groups must finish. The
# shared checkpoint has moved on by then while group 1's own data position has not, so the
# restart starts its data stream anew (checkpoint.exclude_from_loading dataloader, as
# titan-train's message says).
# Exit 0 when both groups end with status 0.
set -uo pipefail
folder="$1" kill_one="$2"
shift 2
IFS=, read -ra gpus <<< "${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}"
if ((${#gpus[@]} < 8)); then
  echo "needs 8 GPUs, sees ${#gpus[@]}"
  exit 1
fi
port=$((29600 + RANDOM % 300))
torchft_lighthouse --min_replicas 1 --bind "[::]:$port" --join_timeout_ms 10000 &
lighthouse=$!
export TORCHFT_LIGHTHOUSE="http://localhost:$port"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -- -"$pid" 2> /dev/null; done
  kill "$lighthouse" 2> /dev/null
}
trap cleanup EXIT
trap 'exit 1' TERM INT  # a timeout: the EXIT trap takes the groups down

args=("$@" --job.dump_folder "$folder" --fault_tolerance.enable --fault_tolerance.group_size 2)
for replica in 0 1; do
  devices=$(IFS=,; echo "${gpus[*]:$((4 * replica)):4}")
  CUDA_VISIBLE_DEVICES="$devices" setsid "${args[@]}" --fault_tolerance.replica_id "$replica" \
    > "$folder-group$replica.log" 2>&1 &
  pids[replica]=$!
done

if ((kill_one)); then
  metrics="$folder/ft-replica-1/metrics.jsonl"
  until [[ -f "$metrics" ]] && (($(wc -l < "$metrics") >= 10)); do
    if ! kill -0 "${pids[1]}" 2> /dev/null; then
      echo "replica group 1 ended before step 10"
      exit 1
    fi
    sleep 2
  done
  echo "killing replica group 1 after $(wc -l < "$metrics") records"
  kill -- -"${pids[1]}"
  wait "${pids[1]}"
  sleep 5
  CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${gpus[*]:4:4}")" setsid "${args[@]}" \
    --fault_tolerance.replica_id 1 --checkpoint.exclude_from_loading dataloader \
    >> "$folder-group1.log" 2>&1 &
  pids[1]=$!
  echo "restarted replica group 1"
fi

status=0
for replica in 0 1; do
  wait "${pids[$replica]}" || status=1
done
pids=()
tail -n 3 "$folder-group0.log" "$folder-group1.log"
exit $status
