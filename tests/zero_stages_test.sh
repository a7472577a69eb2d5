#!/usr/bin/env bash
# remat-train with ZeRO stages 1 and 2 and hybrid sharding (configs/zero1.json,
# zero2.json, hybrid.json) against stage 0; saves resumed at another
# data-parallel size and stage (2 -> 3 and 4 -> 2 ranks); a flipped bit in a
# file read only when re-slicing; and --export read back by Python's
# torch.load, compared bitwise with the parameters assembled from the save.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$1"
run="$2"
configs_dir="$(dirname "$3")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

field() { sed -E "s/.*\"$2\":([^,}]*).*/\1/" "$1" | tail -1; }
small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0
       --set zero_optimization.reduce_bucket_size=4000)

# Largest |a - b| over two loss columns, and whether it is within 1e-5.
within() {
  paste -d' ' <(losses "$1") <(losses "$2") |
    awk 'NF != 2 { bad = 1 } { d = $1 - $2; if (d < 0) d = -d; if (d > worst) worst = d; n++ }
         END { printf "%d steps, max |difference| %.3g\n", n, worst; exit (bad || n != 20 || worst > 1e-5) }'
}

# 1. Stages 1 and 2 (2 ranks) and hybrid sharding (4 ranks) train as stage 0
#    does over 20 steps, within 1e-5, moving what stage 0 moves (stages 1, 2).
for case in "zero1 2" "zero2 2" "hybrid 4"; do
  set -- $case
  cfg=$1 np=$2
  REMAT_LOG_LEVEL=info "$run" -np "$np" -- "$train" --config "$configs_dir/$cfg.json" --steps 20 "${small[@]}" \
    --metrics "$tmp/$cfg.jsonl" >"$tmp/$cfg.out" 2>&1
  "$run" -np "$np" -- "$train" --config "$configs_dir/$cfg.json" --steps 20 "${small[@]}" \
    --set zero_optimization.stage=0 --set zero_optimization.hybrid_shard_size=0 \
    --metrics "$tmp/${cfg}_stage0.jsonl" >"$tmp/${cfg}_stage0.out" 2>&1
  if verdict=$(within "$tmp/$cfg.jsonl" "$tmp/${cfg}_stage0.jsonl"); then
    pass "$cfg.json on $np ranks equals stage 0 within 1e-5 ($verdict)"
  else
    fail "$cfg.json on $np ranks equals stage 0 within 1e-5 ($verdict)" "$(cat "$tmp/$cfg.out")" \
      "$(paste <(losses "$tmp/$cfg.jsonl") <(losses "$tmp/${cfg}_stage0.jsonl"))"
  fi
done
for cfg in zero1 zero2; do
  a=$(field "$tmp/$cfg.jsonl" zero_comm_bytes) b=$(field "$tmp/${cfg}_stage0.jsonl" zero_comm_bytes)
  if [[ -n "$a" && -n "$b" ]] && awk -v a="$a" -v b="$b" 'BEGIN { exit !(b > 0 && a >= b && a < 1.01 * b) }'; then
    pass "$cfg.json moves what stage 0 moves per step ($a vs $b bytes)"
  else
    fail "$cfg.json moves what stage 0 moves per step ($a vs $b bytes)"
  fi
done
if grep -q "data-parallel size 4 = shard 2 x replicate 2" "$tmp/hybrid.out"; then
  pass "hybrid.json logs its layout (4 = shard 2 x replicate 2)"
else
  fail "hybrid.json logs its layout" "$(cat "$tmp/hybrid.out")"
fi
expect "a hybrid_shard_size that does not divide the data-parallel size is named" \
  "hybrid_shard_size 3 must divide the data-parallel size 4" \
  "$run" -np 4 -- "$train" --config "$configs_dir/hybrid.json" --steps 1 "${small[@]}" \
  --set zero_optimization.hybrid_shard_size=3

# 2. A stage 3 save of 2 ranks resumes at stage 1 on 3 ranks and at stage 2 on
#    4; a stage 2 save of 4 ranks at stage 3 on 2. Each resumed run, asked for
#    no further step, exports exactly the model the save holds. A file of
#    the export's name plus .tmp (the user's) is left alone.
echo "not remat's" >"$tmp/s3_step5.pt.tmp"
"$run" -np 2 -- "$train" --config "$configs_dir/zero3.json" --steps 5 "${small[@]}" \
  --save-dir "$tmp/s3" --export "$tmp/s3_step5.pt" >"$tmp/s3.out" 2>&1
left=$(ls "$tmp" | grep -c '^s3_step5\.pt\.tmp\.')
if [[ -f "$tmp/s3_step5.pt" && "$(cat "$tmp/s3_step5.pt.tmp")" == "not remat's" && $left -eq 0 ]]; then
  pass "--export X leaves a file X.tmp alone and no temporary file of its own"
else
  fail "--export X leaves a file X.tmp alone and no temporary file of its own ($left left)" "$(cat "$tmp/s3.out")" \
    "X.tmp: $(cat "$tmp/s3_step5.pt.tmp" 2>&1)"
fi
"$run" -np 4 -- "$train" --config "$configs_dir/zero2.json" --steps 5 "${small[@]}" \
  --save-dir "$tmp/s2" --export "$tmp/s2_step5.pt" >"$tmp/s2.out" 2>&1
for case in "s3 zero1 3" "s3 zero2 4" "s2 zero3 2"; do
  set -- $case
  save=$1 cfg=$2 np=$3
  name="a stage ${save#s} save resumed by $cfg.json on $np ranks"
  out=$("$run" -np "$np" -- "$train" --config "$configs_dir/$cfg.json" --steps 5 "${small[@]}" \
    --resume "$tmp/$save" --export "$tmp/${save}_$cfg.pt" 2>&1)
  if [[ -f "$tmp/${save}_$cfg.pt" ]] && cmp -s "$tmp/${save}_step5.pt" "$tmp/${save}_$cfg.pt"; then
    pass "$name holds the saved parameters exactly (the exports are byte-identical)"
  else
    fail "$name holds the saved parameters exactly" "$out"
  fi
  out=$("$run" -np "$np" -- "$train" --config "$configs_dir/$cfg.json" --steps 8 "${small[@]}" \
    --resume "$tmp/$save" --metrics "$tmp/${save}_$cfg.jsonl" 2>&1)
  if [[ $? -eq 0 && $(wc -l <"$tmp/${save}_$cfg.jsonl") -eq 3 ]] &&
     grep -q "was made at data-parallel size" <<<"$out" &&
     awk '{ if ($1 != $1 + 0 || $1 > 10) exit 1 }' <(losses "$tmp/${save}_$cfg.jsonl"); then
    pass "$name trains steps 6-8 ($(losses "$tmp/${save}_$cfg.jsonl" | tr '\n' ' '))"
  else
    fail "$name trains steps 6-8" "$out"
  fi
done

# 3. A flipped bit in a file this rank reads only to re-slice (rank 1's file,
#    read by the single rank of a 1-rank resume) is named.
cp -r "$tmp/s3" "$tmp/flipped"
flip_bit "$tmp/flipped/step_00000005/rank_1.pt"
expect "a flipped bit in a file read to re-slice is named" "step_00000005/rank_1.pt' is damaged" \
  "$train" --config "$configs_dir/zero3.json" --steps 6 "${small[@]}" --resume "$tmp/flipped"

# 4. The export is a {name: tensor} dictionary Python's torch.load reads, with
#    the model's state-dict names and every tensor bitwise equal to the
#    parameters assembled from the step-5 save's shards (its manifest layout).
# Debian's own python3 (python3-torch), whatever else is on PATH.
if out=$(/usr/bin/python3 - "$tmp/s2_step5.pt" "$tmp/s2/step_00000005" 2>&1 <<'EOF'
import json, sys
import torch
# weights_only: the strict loader (the default from PyTorch 2.6 on) must take it.
exported = torch.load(sys.argv[1], weights_only=True)
folder = sys.argv[2]
manifest = json.load(open(f"{folder}/manifest.json"))
flat = {}
for entry in manifest["files"]:
    tensors = dict(torch.jit.load(f"{folder}/{entry['name']}").tensors.named_parameters())
    for i, segments in enumerate(entry["tensors"]):
        values = tensors[f"t{i}"].detach().reshape(-1)
        for name, param_offset, offset, length in segments:
            numel = exported[name].numel() if name in exported else 0
            flat.setdefault(name, torch.full((numel,), float("nan")))
            flat[name][param_offset:param_offset + length] = values[offset:offset + length]
assert isinstance(exported, dict), type(exported)
assert sorted(exported) == sorted(flat), (sorted(exported), sorted(flat))
for name, tensor in exported.items():
    assert tensor.dtype == torch.float32, (name, tensor.dtype)
    assembled = flat[name].view(tensor.shape)
    assert torch.equal(tensor, assembled), name
print(f"{len(exported)} tensors, {sum(t.numel() for t in exported.values())} elements equal")
EOF
); then
  pass "torch.load reads the export; every tensor equals the save's shards bitwise ($out)"
else
  fail "torch.load reads the export; every tensor equals the save's shards bitwise" "$out"
fi
# A directory is a sharded safetensors export's folder: one holding files of
# another kind (here the test's own) is refused before training.
expect "an --export folder holding other files stops the run before training" "--export '$tmp' is a folder holding '" \
  "$train" --config "$configs_dir/zero1.json" --steps 1 "${small[@]}" --export "$tmp"
expect "an --export path that cannot be written stops the run before training" "--export '$tmp/no/such/dir/m.pt': its folder '$tmp/no/such/dir' does not exist" \
  "$train" --config "$configs_dir/zero1.json" --steps 1 "${small[@]}" --export "$tmp/no/such/dir/m.pt"
# A path the export's rename would replace: a symbolic link (which stays one)
# or a fifo (never opened: that would wait for a reader).
ln -sf "$tmp/s3_step5.pt" "$tmp/link.pt"
expect "an --export path that is a symbolic link stops the run before training" \
  "--export '$tmp/link.pt' is a symbolic link, not a regular file" \
  "$train" --config "$configs_dir/zero1.json" --steps 1 "${small[@]}" --export "$tmp/link.pt"
if [[ -L "$tmp/link.pt" ]]; then pass "the symbolic link is left as it was"; else fail "the symbolic link is left as it was"; fi
rm -f "$tmp/fifo.pt" && mkfifo "$tmp/fifo.pt"
expect "an --export path that is a fifo stops the run before training" "--export '$tmp/fifo.pt' is a fifo" \
  "$train" --config "$configs_dir/zero1.json" --steps 1 "${small[@]}" --export "$tmp/fifo.pt"

summary
