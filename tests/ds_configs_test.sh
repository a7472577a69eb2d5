#!/usr/bin/env bash
# The ds_config files DeepSpeed users bring, given to remat-train as they are
# (tests/ds_configs/: copies with the keys of Hugging Face Trainer's ZeRO 1-3
# files, LLaVA's zero2, a bf16 ZeRO-3, a Whisper fine-tune, a p-tuning config
# and a DeepSpeed training script's fp16 file; docs/config.md, "Bringing a
# DeepSpeed config"), at 2 ranks: remat-estimate shows every "auto" decided;
# each trains a few steps (the wall time said), logging each decision once,
# an "auto" micro-batch measured and within the memory it was sized for; an
# "auto" run equals the run given the decided values (read from its save);
# ranks with different memory decide one micro-batch; offload_optimizer keeps its state on the host;
# offload_param the parameter shards; bf16 at stage 3 says the persistence threshold it uses; a 16-bit export
# is bf16; fp16 on a CPU whose LibTorch cannot compute half
# precision is refused naming fp16, the device and the LibTorch, and trains
# with the loss scaler where it can.
# Prints "[remat-test] N passed, M failed".
#   tests/ds_configs_test.sh REMAT_TRAIN REMAT_RUN REMAT_ESTIMATE A_CONFIG_IN_tests/ds_configs
set -uo pipefail
train="$1"
run="$2"
estimate="$3"
ds_dir="$(dirname "$4")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
# What each rank has, for train_micro_batch_size_per_gpu "auto": a small device,
# so that the decided micro-batch stays a quick one on 2 cores.
export REMAT_COMM_TIMEOUT_S=60 REMAT_MEMORY_PER_RANK_BYTES=$((16 << 20))
source "$(dirname "$0")/testlib.sh"

# remat's own sections only (the model, the loop): every DeepSpeed key is the file's.
small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set model.n_head=2 --set train.eval_interval=0 --set train.sample_chars=0)
steps=3
py=/usr/bin/python3  # Debian's, with python3-torch

finite_losses() {
  [[ -f "$1" && $(wc -l <"$1") -eq $steps ]] && awk '{ if ($1 != $1 + 0 || $1 > 10 || $1 <= 0) exit 1 }' <(losses "$1")
}
fp16_on() { $py -c 'import json, sys; print(json.load(open(sys.argv[1])).get("fp16", {}).get("enabled") is True)' "$1"; }

for cfg in hf_zero1 hf_zero2 hf_zero3 llava_zero2 bf16_zero3 whisper_zero2 ptuning_zero2 ds_fp16_zero1; do
  file="$ds_dir/$cfg.json"
  autos=$(grep -c '"auto"' "$file")
  # remat-estimate decides every "auto" as remat-train will, and shows each.
  "$estimate" -np 2 --config "$file" "${small[@]}" --json "$tmp/$cfg.est.json" >"$tmp/$cfg.est" 2>&1
  rc=$?
  shown=$(grep -c '"auto" -> ' "$tmp/$cfg.est")
  # fp16 where this LibTorch cannot compute it: refused as remat-train refuses it, after the values.
  refused=$(grep -c "fp16.enabled is true, but the cpu device cannot compute in fp16" "$tmp/$cfg.est")
  if [[ $shown -eq $autos && $rc -eq 0 && $refused -eq 0 ]] ||
      [[ $shown -eq $autos && $rc -eq 1 && $refused -gt 0 && $(fp16_on "$file") == True ]]; then
    pass "$cfg.json: remat-estimate shows its $autos \"auto\" values decided$( ((refused)) && echo ", and refuses fp16 here")"
  else
    fail "$cfg.json: remat-estimate shows its $autos \"auto\" values decided ($shown shown, exit $rc)" \
      "$(cat "$tmp/$cfg.est")"
  fi

  start=$(date +%s.%N)
  REMAT_LOG_LEVEL=info "$run" -np 2 -- "$train" --config "$file" --steps $steps "${small[@]}" \
    --metrics "$tmp/$cfg.jsonl" --export "$tmp/$cfg.pt" --save-dir "$tmp/$cfg.saves" >"$tmp/$cfg.out" 2>&1
  rc=$?
  if [[ $(fp16_on "$file") == True ]] && grep -q "fp16.enabled is true, but the cpu device cannot compute in fp16" \
       "$tmp/$cfg.out"; then
    # Refused only where this LibTorch lacks half precision on the CPU (1.13).
    if [[ $rc -ne 0 ]] && grep -q "with this LibTorch (1\." "$tmp/$cfg.out"; then
      pass "$cfg.json: fp16 on this CPU is refused naming fp16, the device and the LibTorch (exit $rc)"
    else
      fail "$cfg.json: fp16 is refused where LibTorch computes half precision (exit $rc)" "$(cat "$tmp/$cfg.out")"
    fi
    continue
  fi
  wall=$($py -c "import time; print(round(time.time() - $start, 1))")
  if [[ $rc -eq 0 ]] && finite_losses "$tmp/$cfg.jsonl"; then
    pass "$cfg.json trains $steps steps at 2 ranks in $wall s (losses $(losses "$tmp/$cfg.jsonl" | tr '\n' ' '))"
  else
    fail "$cfg.json trains $steps steps at 2 ranks (exit $rc)" "$(cat "$tmp/$cfg.out")"
    continue
  fi
  logged=$(grep -c '"auto" -> ' "$tmp/$cfg.out")
  if [[ $logged -eq $autos ]]; then
    pass "$cfg.json: remat-train logs each of its $autos \"auto\" values once, with what it chose"
  else
    fail "$cfg.json: remat-train logs each of its $autos \"auto\" values once ($logged lines)" \
      "$(grep -F '"auto"' "$tmp/$cfg.out")"
  fi
  # An "auto" micro-batch: measured (the search's line, once), and it fits
  # what each rank has: the measured peak stays under it.
  if grep -q '"train_micro_batch_size_per_gpu": "auto"' "$file"; then
    if [[ $(grep -c "micro-batch search (forward+backward tokens/s per rank" "$tmp/$cfg.out") -eq 1 ]]; then
      pass "$cfg.json: the \"auto\" micro-batch is measured: $(grep -o '1: [^;]*; chose [0-9]*' "$tmp/$cfg.out")"
    else
      fail "$cfg.json: the \"auto\" micro-batch is measured, the search logged once" "$(cat "$tmp/$cfg.out")"
    fi
    peak=$(grep -o '"mem_peak_bytes":[0-9]*' "$tmp/$cfg.jsonl" | cut -d: -f2 | sort -n | tail -1)
    if [[ -n "$peak" && "$peak" -le $REMAT_MEMORY_PER_RANK_BYTES ]]; then
      pass "$cfg.json: the \"auto\" micro-batch's measured peak, $peak bytes, fits the $REMAT_MEMORY_PER_RANK_BYTES each rank has"
    else
      fail "$cfg.json: the \"auto\" micro-batch's measured peak (${peak:-none}) fits $REMAT_MEMORY_PER_RANK_BYTES" \
        "$(grep -F 'micro_batch_size_per_gpu "auto"' "$tmp/$cfg.out")"
    fi
  fi
  # fp16 where this CPU computes it: the loss scaler's scale on every line.
  if [[ $(fp16_on "$file") == True ]]; then
    if [[ $(grep -c '"loss_scale":' "$tmp/$cfg.jsonl") -eq $steps ]]; then
      pass "$cfg.json trains in fp16 with the loss scaler (loss_scale on every metrics line)"
    else
      fail "$cfg.json trains in fp16 with the loss scaler" "$(cat "$tmp/$cfg.jsonl")"
    fi
  fi
  # offload_optimizer "cpu": the optimizer's state on the host, counted.
  if grep -q '"offload_optimizer"' "$file"; then
    bytes=$(sed -nE 's/.*"host_optimizer_bytes":([0-9]+).*/\1/p' "$tmp/$cfg.jsonl" | tail -1)
    if [[ -n "$bytes" && "$bytes" -gt 0 ]]; then
      pass "$cfg.json: offload_optimizer keeps the optimizer on the host ($bytes bytes)"
    else
      fail "$cfg.json: offload_optimizer keeps the optimizer on the host" "$(tail -1 "$tmp/$cfg.jsonl")"
    fi
  fi
done

# An "auto" run is the run given what remat decided: hf_zero1.json with each
# decided value set by hand (from the run's save, which records them with the
# measured micro-batch) trains the same bits.
sets=()
while IFS= read -r s; do sets+=(--set "$s"); done < <($py - "$tmp/hf_zero1.saves/step_00000003/manifest.json" <<'PY'
import json, sys
for key, d in json.load(open(sys.argv[1]))["decisions"]["auto"].items():
    print(f"{key}={json.dumps(d['value'])}")
PY
)
"$run" -np 2 -- "$train" --config "$ds_dir/hf_zero1.json" --steps $steps "${small[@]}" "${sets[@]}" \
  --metrics "$tmp/hf_zero1_given.jsonl" >"$tmp/hf_zero1_given.out" 2>&1
if [[ ${#sets[@]} -gt 20 ]] && finite_losses "$tmp/hf_zero1_given.jsonl" &&
   cmp -s <(losses "$tmp/hf_zero1.jsonl") <(losses "$tmp/hf_zero1_given.jsonl") &&
   ! grep -q '"auto" -> ' "$tmp/hf_zero1_given.out"; then
  pass "hf_zero1.json's \"auto\" run equals the run given the decided values, bit for bit ($((${#sets[@]} / 2)) keys)"
else
  fail "hf_zero1.json's \"auto\" run equals the run given the decided values" "${sets[*]}" \
    "$(paste <(losses "$tmp/hf_zero1.jsonl") <(losses "$tmp/hf_zero1_given.jsonl"))" "$(cat "$tmp/hf_zero1_given.out")"
fi

# remat-estimate --steps decides the scheduler's "auto" values as remat-train
# --steps does (whisper_zero2.json: WarmupDecayLR, total and warm-up "auto").
"$estimate" -np 2 --config "$ds_dir/whisper_zero2.json" "${small[@]}" --steps $steps >"$tmp/whisper_steps.est" 2>&1
for key in scheduler.params.total_num_steps scheduler.params.warmup_num_steps; do
  a=$(grep -o "$key \"auto\" -> [0-9]*" "$tmp/whisper_steps.est")
  b=$(grep -o "$key \"auto\" -> [0-9]*" "$tmp/whisper_zero2.out")
  if [[ -n "$a" && "$a" == "$b" ]]; then
    pass "remat-estimate --steps $steps decides $key as remat-train --steps $steps does (${a##* })"
  else
    fail "remat-estimate --steps $steps decides $key as remat-train does ('$a' vs '$b')" "$(cat "$tmp/whisper_steps.est")"
  fi
done

# Ranks with different memory measure the same candidates, up to the
# smallest rank's fit, and decide alike (they stopped the job, each having
# decided its own largest micro-batch).
out=$("$run" -np 2 -- bash -c 'REMAT_MEMORY_PER_RANK_BYTES=$(((OMPI_COMM_WORLD_RANK + 1) << 24)) exec "$0" "$@"' \
      "$train" --config "$ds_dir/hf_zero1.json" --steps 1 "${small[@]}" 2>&1 | tr -d '\000')
if grep -q "step 1/1" <<<"$out" && grep -q "micro-batch search" <<<"$out"; then
  pass "ranks with 16 MiB and 32 MiB decide one \"auto\" micro-batch and train"
else
  fail "ranks with different memory decide one \"auto\" micro-batch" "$out"
fi

# offload_param (hf_zero3.json, beside offload_optimizer): with every parameter
# sharded (no persistence threshold), the shards live on the host, and the run
# trains the bits of the same run with both offloads off (at one micro-batch,
# the one hf_zero3.json's run measured: each run would measure its own).
zero3_micro=$($py -c 'import json, sys; print(json.load(open(sys.argv[1]))["decisions"]["batch"]["train_micro_batch_size_per_gpu"])' \
  "$tmp/hf_zero3.saves/step_00000003/manifest.json" 2>/dev/null)
for off in on off; do
  extra=(--set train_micro_batch_size_per_gpu="${zero3_micro:-4}")
  [[ $off == off ]] && extra+=(--set zero_optimization.offload_param.device=none
                               --set zero_optimization.offload_optimizer.device=none)
  "$run" -np 2 -- "$train" --config "$ds_dir/hf_zero3.json" --steps $steps "${small[@]}" "${extra[@]}" \
    --set zero_optimization.stage3_param_persistence_threshold=0 --metrics "$tmp/hf_zero3_p0_$off.jsonl" \
    >"$tmp/hf_zero3_p0_$off.out" 2>&1
done
# At the file's threshold ("auto": remat's 100000) the small GPT shards
# nothing, and the log says offload_param has nothing to offload and why.
if grep -q "offload_param has nothing to offload: no parameter is sharded" "$tmp/hf_zero3.out"; then
  pass "hf_zero3.json: offload_param with nothing sharded says so, naming stage3_param_persistence_threshold"
else
  fail "hf_zero3.json: offload_param with nothing sharded says so" "$(grep offload_param "$tmp/hf_zero3.out")"
fi
bytes=$(sed -nE 's/.*"host_parameter_bytes":([0-9]+).*/\1/p' "$tmp/hf_zero3_p0_on.jsonl" | tail -1)
if [[ -n "$bytes" && "$bytes" -gt 0 ]] && finite_losses "$tmp/hf_zero3_p0_on.jsonl" &&
   cmp -s <(losses "$tmp/hf_zero3_p0_on.jsonl") <(losses "$tmp/hf_zero3_p0_off.jsonl"); then
  pass "hf_zero3.json: offload_param keeps the parameter shards on the host ($bytes bytes), the same losses bit for bit"
else
  fail "hf_zero3.json: offload_param keeps the parameter shards on the host, the same losses" \
    "$(tail -3 "$tmp/hf_zero3_p0_on.out")" "$(paste <(losses "$tmp/hf_zero3_p0_on.jsonl") <(losses "$tmp/hf_zero3_p0_off.jsonl"))"
fi

# bf16 at stage 3 shards every parameter: the persistence threshold's "auto"
# (bf16_zero3.json) says the 0 stage 3 uses and why, in its one line.
line=$(grep -F 'zero_optimization.stage3_param_persistence_threshold "auto" -> ' "$tmp/bf16_zero3.out")
if [[ $(grep -c . <<<"$line") -eq 1 && "$line" == *'"auto" -> 0: under bf16 stage 3 shards every parameter'* ]] &&
   ! grep -q 'persistence_threshold "auto" -> 100000' "$tmp/bf16_zero3.out"; then
  pass "bf16_zero3.json: the persistence threshold's \"auto\" is the 0 that bf16's stage 3 uses, said once with why"
else
  fail "bf16_zero3.json: the persistence threshold's \"auto\" is the 0 that bf16's stage 3 uses" \
    "$(grep -F persistence "$tmp/bf16_zero3.out")"
fi

# stage3_gather_16bit_weights_on_model_save with bf16: the export is bf16;
# with float32 compute (hf_zero3.json's "auto" on a CPU) it stays float32.
for case in "bf16_zero3 torch.bfloat16" "hf_zero3 torch.float32"; do
  set -- $case
  if out=$($py - "$tmp/$1.pt" "$2" 2>&1 <<'PY'
import sys
import torch
exported = torch.load(sys.argv[1], weights_only=True)
dtypes = {str(t.dtype) for t in exported.values()}
assert dtypes == {sys.argv[2]}, dtypes
print(f"{len(exported)} tensors, {sys.argv[2]}")
PY
); then
    pass "$1.json: stage3_gather_16bit_weights_on_model_save exports $2 ($out)"
  else
    fail "$1.json: stage3_gather_16bit_weights_on_model_save exports $2" "$out"
  fi
done

# A ZeRO-Infinity file (infinity_zero3.json: both offloads to "nvme", the aio
# section tuned, nvme_path /local_nvme). remat-estimate reads it as it is:
# the moments on disk, no shard there (its max_in_cpu, 1e9, keeps them in
# memory), and /local_nvme, not on this machine, said and not checked. With
# both nvme_path a folder here and max_in_cpu 0 the file trains with the
# optimizer state and the parameter shards on disk, bitwise as with both
# devices "cpu" (where its aio section is said once to have no effect), and
# its files are removed.
inf="$ds_dir/infinity_zero3.json"
"$estimate" -np 2 --config "$inf" "${small[@]}" >"$tmp/inf.est" 2>&1
rc=$?
if [[ $rc -eq 0 ]] && grep -q "its Adam moments on disk (nvme_path): " "$tmp/inf.est" &&
    ! grep -q "the parameter shards on disk" "$tmp/inf.est" &&
    grep -q "^disk: nvme_path '/local_nvme' holds the Adam moments [0-9.]* [KM]iB per rank, [0-9.]* [KM]iB for 2 ranks; it is not on this machine (No such file or directory), so its free space is not checked$" "$tmp/inf.est"; then
  pass "infinity_zero3.json: remat-estimate shows the moments on disk and says /local_nvme is not on this machine (exit $rc)"
else
  fail "infinity_zero3.json: remat-estimate (exit $rc)" "$(cat "$tmp/inf.est")"
fi
# The file is read alone before any --set: the devices are changed in copies.
mkdir -p "$tmp/nvme"
sed 's/"device": "nvme"/"device": "cpu"/' "$inf" >"$tmp/infinity_cpu.json"
python3 - "$inf" "$tmp/infinity_nvme.json" "$tmp/nvme" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
for section in ("offload_optimizer", "offload_param"):
    c["zero_optimization"][section]["nvme_path"] = sys.argv[3]
c["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
c["zero_optimization"]["sub_group_size"] = 20000  # several sub-groups on the small model
json.dump(c, open(sys.argv[2], "w"))
PY
REMAT_LOG_LEVEL=info "$run" -np 2 -- "$train" --config "$tmp/infinity_cpu.json" --steps $steps "${small[@]}" \
  --metrics "$tmp/inf.jsonl" >"$tmp/inf.out" 2>&1
rc=$?
aio_lines=$(grep -c "aio (block_size 262144, queue_depth 32, thread_count 1, single_submit false, overlap_events true) has no effect in this run" "$tmp/inf.out")
if [[ $rc -eq 0 && $aio_lines -eq 1 ]] && finite_losses "$tmp/inf.jsonl"; then
  pass "infinity_zero3.json with the devices \"cpu\": trains $steps steps, its aio section said once to have no effect"
else
  fail "infinity_zero3.json with the devices \"cpu\" trains (exit $rc, $aio_lines aio lines)" "$(tail -30 "$tmp/inf.out")"
fi
"$estimate" -np 2 --config "$tmp/infinity_nvme.json" "${small[@]}" >"$tmp/inf_nvme.est" 2>&1
est_rc=$?
REMAT_LOG_LEVEL=info "$run" -np 2 -- "$train" --config "$tmp/infinity_nvme.json" --steps $steps "${small[@]}" \
  --metrics "$tmp/inf_nvme.jsonl" >"$tmp/inf_nvme.out" 2>&1
rc=$?
if [[ $rc -eq 0 ]] && grep -q "offload_optimizer nvme: the Adam moments of" "$tmp/inf_nvme.out" &&
    grep -q "offload_param nvme: \([0-9]*\) of \1 float32 parameter shard elements in '$tmp/nvme/remat-parameters/rank0/rank0.parameters'" "$tmp/inf_nvme.out" &&
    ! grep -q "aio (" "$tmp/inf_nvme.out" &&
    cmp -s <(python3 -c 'import json,sys; [print(repr(json.loads(l)["loss"])) for l in open(sys.argv[1])]' "$tmp/inf.jsonl") \
           <(python3 -c 'import json,sys; [print(repr(json.loads(l)["loss"])) for l in open(sys.argv[1])]' "$tmp/inf_nvme.jsonl") &&
    [[ -z $(find "$tmp/nvme" -name '*.optimizer' -o -name '*.parameters') ]]; then
  pass "infinity_zero3.json with both offloads on \"nvme\": $steps losses bitwise those of \"cpu\", its files removed"
else
  fail "infinity_zero3.json with both offloads on \"nvme\" (exit $rc)" "$(tail -30 "$tmp/inf_nvme.out"; find "$tmp/nvme")"
fi
# remat-estimate of the same file: both on disk, the folder's free space checked.
if [[ $est_rc -eq 0 ]] && grep -q "the parameter shards on disk (offload_param.nvme_path): " "$tmp/inf_nvme.est" &&
    grep -q "^disk: nvme_path '$tmp/nvme' holds the Adam moments [0-9.]* [KM]iB + the parameter shards [0-9.]* [KM]iB per rank, [0-9.]* [KM]iB for 2 ranks; it has [0-9.]* [KMGT]iB free: fits$" "$tmp/inf_nvme.est"; then
  pass "infinity_zero3.json with nvme_path here: remat-estimate shows both on disk and checks the free space"
else
  fail "infinity_zero3.json with nvme_path here: remat-estimate (exit $est_rc)" "$(cat "$tmp/inf_nvme.est")"
fi
# At tensor parallel 2 stage 3 flattens each unit's split and replicated
# parameters apart, each a page-padded shard of its own: the estimate's disk
# bytes are the run's, with every shard on disk and with max_in_cpu keeping some.
for mic in 0 3000; do
  tp_args=(--config "$tmp/infinity_nvme.json" "${small[@]}" --set tensor_parallel.size=2
           --set zero_optimization.offload_param.max_in_cpu=$mic)
  "$estimate" -np 2 "${tp_args[@]}" --json "$tmp/tp_$mic.est.json" >"$tmp/tp_$mic.est" 2>&1
  "$run" -np 2 -- "$train" "${tp_args[@]}" --steps 1 --metrics "$tmp/tp_$mic.jsonl" >"$tmp/tp_$mic.out" 2>&1
  rc=$?
  pair=$(python3 - "$tmp/tp_$mic.est.json" "$tmp/tp_$mic.jsonl" <<'PY'
import json, sys
row = [r for r in json.load(open(sys.argv[1]))["rows"] if r["configured"]][0]
run = json.loads(open(sys.argv[2]).readline())
print(row.get("disk_parameter_bytes", 0), run.get("nvme_parameter_bytes", 0))
PY
)
  read -r est_bytes run_bytes <<<"$pair"
  if [[ $rc -eq 0 && -n $run_bytes && $run_bytes -gt 0 && $est_bytes == "$run_bytes" ]]; then
    pass "tensor parallel 2, max_in_cpu $mic: remat-estimate's parameter shards on disk are the run's, $run_bytes bytes"
  else
    fail "tensor parallel 2, max_in_cpu $mic: estimate $est_bytes vs run $run_bytes bytes on disk (exit $rc)" \
      "$(tail -5 "$tmp/tp_$mic.out")"
  fi
done
# nvme_path a file, which remat-train refuses at start: remat-estimate says
# so and exits 2, not "fits" with the free space of the file's disk.
touch "$tmp/not_a_folder"
"$estimate" -np 2 --config "$tmp/infinity_nvme.json" "${small[@]}" \
  --set zero_optimization.offload_param.nvme_path="$tmp/not_a_folder" >"$tmp/inf_file.est" 2>&1
est_rc=$?
if [[ $est_rc -eq 2 ]] &&
    grep -q "^disk: nvme_path '$tmp/not_a_folder' holds the parameter shards [0-9.]* [KM]iB per rank, [0-9.]* [KM]iB for 2 ranks; it is not a folder: give nvme_path a folder on a fast local disk$" "$tmp/inf_file.est"; then
  pass "nvme_path a file: remat-estimate says it is not a folder and exits 2"
else
  fail "nvme_path a file: remat-estimate (exit $est_rc)" "$(cat "$tmp/inf_file.est")"
fi

summary
