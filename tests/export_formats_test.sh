#!/usr/bin/env bash
# remat-train --export by path at 2 ranks, ZeRO stage 3: model.pt (read by Debian's
# python3 with torch.load), model.safetensors and a folder of shards with its index
# (read by a reader of the published format written here: an 8-byte little-endian
# header length, the JSON header, the data), the same tensors bitwise in all three;
# --export-max-shard-size as save_pretrained's max_shard_size; a bad size and a
# folder holding other files stop the run at start, before it trains; X.SAFETENSORS
# is safetensors, an index path or a file of another kind is refused; a re-export
# killed half-way through replacing a folder's shards leaves a folder that
# --pretrained refuses, never a mix of both exports.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$1"
run="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0
       --set zero_optimization.stage=3 --steps 3)

for out in model.pt model.safetensors shards/; do
  # The shard size is a folder export's only (remat-train refuses it with a file).
  shard_size=()
  [[ $out == */ ]] && shard_size=(--export-max-shard-size 20KB)
  if log=$("$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/$out" "${shard_size[@]}" 2>&1) &&
      grep -q "exported the model at step 3 to $tmp/$out" <<<"$log"; then
    pass "--export $out at 2 ranks, stage 3"
  else
    fail "--export $out at 2 ranks, stage 3" "$log"
  fi
done

if out=$(/usr/bin/python3 - "$tmp/model.pt" "$tmp/model.safetensors" "$tmp/shards" 2>&1 <<'PY'
import json, os, struct, sys
import torch

def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    out, end = {}, 0
    for name, e in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = e["data_offsets"]
        assert begin == end, f"{path}: {name} starts at {begin}, the data before ends at {end}"
        end = stop
        raw = bytearray(data[8 + n + begin:8 + n + stop])
        t = torch.frombuffer(raw, dtype=dtypes[e["dtype"]]) if raw else torch.empty(0, dtype=dtypes[e["dtype"]])
        out[name] = t.reshape(e["shape"])
    assert 8 + n + end == len(data), f"{path}: {len(data) - 8 - n - end} bytes after the data"
    return out, meta

pickled = torch.load(sys.argv[1], weights_only=True)
single, meta = read_safetensors(sys.argv[2])
assert meta.get("format") == "pt" and meta.get("remat_step") == "3", meta
assert list(single) == list(pickled), "the file's order is the model's"
index = json.load(open(os.path.join(sys.argv[3], "model.safetensors.index.json")))
files = sorted(set(index["weight_map"].values()))
assert len(files) > 2 and sorted(os.listdir(sys.argv[3])) == files + ["model.safetensors.index.json"], files
sharded, total = {}, 0
for f in files:
    tensors, _ = read_safetensors(os.path.join(sys.argv[3], f))
    for k, t in tensors.items():
        assert k not in sharded and index["weight_map"][k] == f, k
        sharded[k] = t
        total += t.numel() * t.element_size()
assert index["metadata"]["total_size"] == total, (index["metadata"], total)
for name, t in pickled.items():
    assert t.dtype == torch.float32 and torch.equal(t, single[name]) and torch.equal(t, sharded[name]), name
assert sorted(sharded) == sorted(pickled)
print(f"{len(pickled)} tensors, {len(files)} shards, {total} bytes")
PY
); then
  pass "torch.load's model.pt, model.safetensors and the shards hold the same tensors bitwise ($out)"
else
  fail "torch.load's model.pt, model.safetensors and the shards hold the same tensors bitwise" "$out"
fi

# A previous export's folder is replaced whole: 20KB shards, then one.
if log=$("$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/shards" 2>&1) &&
    [[ "$(ls "$tmp/shards" | tr '\n' ' ')" == "model-00001-of-00001.safetensors model.safetensors.index.json " ]]; then
  pass "--export into a previous export's folder replaces its shards"
else
  fail "--export into a previous export's folder replaces its shards" "$log $(ls "$tmp/shards")"
fi

expect "--export-max-shard-size that is not a size" "--export-max-shard-size '5XB' is not a size" \
  "$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/x/" --export-max-shard-size 5XB
mkdir -p "$tmp/hf" && echo '{}' >"$tmp/hf/config.json"
expect "--export into a folder holding other files" "--export '$tmp/hf' is a folder holding 'config.json'" \
  "$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/hf"

# The format by the path, letters in any case; a path that would lose a file is refused.
if log=$("$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/X.SAFETENSORS" 2>&1) &&
    [[ "$(head -c 8 "$tmp/X.SAFETENSORS" | od -An -tu8 | tr -d ' ')" -lt 100000 ]] &&
    [[ "$(head -c 2 "$tmp/X.SAFETENSORS")" != "PK" ]]; then
  pass "--export X.SAFETENSORS writes a safetensors file"
else
  fail "--export X.SAFETENSORS writes a safetensors file" "$log"
fi
expect "--export of a sharded export's index is refused" \
  "ends in .json: an export writes weights, never an index alone. For a sharded safetensors export give its folder" \
  "$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/shards/model.safetensors.index.json"
echo "my notes" >"$tmp/notes.pt"
expect "--export over a file of another kind is refused" \
  "exists and is a file of 9 bytes that is neither a pickle archive" \
  "$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/notes.pt"
[[ "$(cat "$tmp/notes.pt")" == "my notes" ]] && pass "the file refused is kept" || fail "the file refused is kept"
expect "--export-max-shard-size 0" "--export-max-shard-size '0' is zero: a size must be positive" \
  "$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/x/" --export-max-shard-size 0
expect "--export-max-shard-size 8EiB" "--export-max-shard-size '8EiB' is too large: a size is at most 9223372036854775807" \
  "$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/x/" --export-max-shard-size 8EiB
expect "--export-max-shard-size 0.5" "--export-max-shard-size '0.5' is not a whole number of bytes" \
  "$run" -np 2 -- "$train" "${small[@]}" --export "$tmp/x/" --export-max-shard-size 0.5

# A re-export into the shards' folder killed (SIGKILL) before its third rename:
# the old index went first, so --pretrained refuses the folder; the next export
# into it removes the killed one's temporaries and is whole.
small=("${small[@]:0:${#small[@]}-2}")  # without "--steps 3": each run gives its own
"$run" -np 2 -- "$train" "${small[@]}" --steps 2 --export "$tmp/mix/" --export-max-shard-size 20KB >/dev/null 2>&1
log=$(REMAT_FAULT_EXPORT_RENAME_KILL=3 timeout 120 "$run" -np 2 -- "$train" "${small[@]}" --steps 4 \
        --export "$tmp/mix" --export-max-shard-size 20KB 2>&1)
rc=$?
if [[ $rc -ne 0 && ! -e "$tmp/mix/model.safetensors.index.json" ]] && ls "$tmp/mix" | grep -q 'remat-tmp'; then
  pass "an export killed half-way through its renames leaves no index (exit $rc)"
else
  fail "an export killed half-way through its renames leaves no index (exit $rc)" "$log" "$(ls "$tmp/mix")"
fi
expect "--pretrained of a folder an export left half-replaced is refused" \
  "and no model.safetensors.index.json: an export into it was interrupted or failed before writing its index" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/mix"
if log=$(REMAT_LOG_LEVEL=info "$run" -np 2 -- "$train" "${small[@]}" --steps 3 --export "$tmp/mix" \
           --export-max-shard-size 20KB 2>&1) && grep -q "the temporary file of an earlier write" <<<"$log" &&
    ! ls "$tmp/mix" | grep -q 'remat-tmp' &&
    "$run" -np 2 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/mix" >/dev/null 2>&1; then
  pass "the next export removes the killed one's temporaries (logged) and --pretrained reads it"
else
  fail "the next export removes the killed one's temporaries (logged) and --pretrained reads it" "$log" "$(ls "$tmp/mix")"
fi

summary
