#!/usr/bin/env bash
# remat-estimate's cold output, text and --json, byte for byte against the
# files in tests/golden/estimate/ on a fixed set of configurations (ranks 1-8,
# ZeRO stages 0-3, hybrid, bf16/fp16, offload of the optimizer and the
# parameters, tensor and sequence parallelism, "auto" values, the GPU path).
# The cold activation model follows the attention LibTorch runs (runtime/compat.h:
# 2.x's scaled_dot_product_attention), so the 16-bit cases' figures differ on
# LibTorch 2: those files are in tests/golden/estimate/libtorch2/, read there
# in place of the others.
# A refactor of the memory rule must leave every file unchanged; a change of
# the rule itself updates them on purpose (on each LibTorch):
#   tests/estimate_golden_test.sh --update bazel-bin/launch/remat-estimate configs
# Usage: estimate_golden_test.sh [--update] REMAT_ESTIMATE CONFIG_DIR [GOLDEN_DIR]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/testlib.sh"

update=0
[[ "${1:-}" == "--update" ]] && { update=1; shift; }
estimate="$1" configs="$2" golden="${3:-$here/golden/estimate}"
# The memory each rank has is fixed so that the verdict line is the same on every host.
export REMAT_MEMORY_PER_RANK_BYTES=4000000000
unset OMPI_COMM_WORLD_SIZE PMI_SIZE
torch_major=$(sed -nE 's/^#define TORCH_VERSION_MAJOR ([0-9]+).*/\1/p' \
  /usr/include/torch/csrc/api/include/torch/version.h 2>/dev/null)
torch_major=${torch_major:-1}
# golden_of NAME.EXT: the file this LibTorch's output is compared with.
golden_of() {
  if [[ $torch_major -ge 2 && -f "$golden/libtorch2/$1" ]]; then echo "$golden/libtorch2/$1"; else echo "$golden/$1"; fi
}

# NAME CONFIG ARGS...: one estimate.
cases=(
  "default_np1|default.json|-np 1"
  "default_np2|default.json|-np 2"
  "default_np8|default.json|-np 8"
  "stage0_np1|default.json|-np 1 --set zero_optimization.stage=0"
  "zero1_np2|zero1.json|-np 2"
  "zero2_np4|zero2.json|-np 4"
  "zero3_np3|zero3.json|-np 3"
  "no_checkpointing_np2|no_checkpointing.json|-np 2"
  "hybrid_np4|hybrid.json|-np 4"
  "bf16_stage2_np2|zero2.json|-np 2 --set bf16.enabled=true"
  "bf16_stage3_np5|zero3.json|-np 5 --set bf16.enabled=true"
  "fp16_stage1_np2|zero1.json|-np 2 --device cuda --host-memory 8000000000 --set fp16.enabled=true"
  "fp16_stage3_np4|zero3.json|-np 4 --device cuda --host-memory 8000000000 --set fp16.enabled=true"
  "offload_optimizer_stage2_np2|zero2.json|-np 2 --set zero_optimization.offload_optimizer.device=cpu"
  "offload_optimizer_bf16_np4|zero3.json|-np 4 --set bf16.enabled=true --set zero_optimization.offload_optimizer.device=cpu"
  "offload_param_stage3_np2|zero3.json|-np 2 --set zero_optimization.offload_param.device=cpu --set zero_optimization.offload_optimizer.device=cpu"
  "offload_param_fp16_np8|zero3.json|-np 8 --device cuda --host-memory 8000000000 --set fp16.enabled=true --set zero_optimization.offload_param.device=cpu --set zero_optimization.offload_optimizer.device=cpu"
  "activation_offload_np2|offload.json|-np 2"
  "tp2_np2|tp2.json|-np 2"
  "tp2_partitioned_np4|tp2_partitioned.json|-np 4"
  "zero3_tp2_np4|zero3_tp2.json|-np 4"
  "tp2_sequence_parallel_np6|tp2_sequence_parallel.json|-np 6"
  "memory_budget_np2|memory_budget.json|-np 2"
  "auto_micro_batch_np2|default.json|-np 2 --set train_micro_batch_size_per_gpu=auto"
  "auto_zero_values_np4|zero3.json|-np 4 --set zero_optimization.reduce_bucket_size=auto --set zero_optimization.stage3_prefetch_bucket_size=auto"
  "grad_accumulation_np2|grad_accumulation.json|-np 2"
  "cuda_bf16_offload_np8|zero3.json|-np 8 --device cuda --host-memory 8000000000 --set bf16.enabled=true --set zero_optimization.offload_optimizer.device=cpu --set zero_optimization.offload_param.device=cpu"
  "cuda_stage2_np2|zero2.json|-np 2 --device cuda --host-memory 8000000000"
)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for entry in "${cases[@]}"; do
  IFS='|' read -r name config args <<<"$entry"
  # shellcheck disable=SC2086
  "$estimate" --config "$configs/$config" $args --json "$work/$name.json" >"$work/$name.txt" 2>&1
  echo "exit $?" >>"$work/$name.txt"
  for ext in txt json; do
    expected=$(golden_of "$name.$ext")
    if [[ $update -eq 1 && $torch_major -ge 2 ]]; then
      # LibTorch 2: only what differs from the base files.
      if ! cmp -s "$work/$name.$ext" "$golden/$name.$ext"; then
        mkdir -p "$golden/libtorch2" && cp "$work/$name.$ext" "$golden/libtorch2/" && echo "wrote $golden/libtorch2/$name.$ext"
      fi
    elif [[ $update -eq 1 ]]; then
      mkdir -p "$golden" && cp "$work/$name.$ext" "$golden/" && echo "wrote $golden/$name.$ext"
    elif cmp -s "$work/$name.$ext" "$expected"; then
      pass "estimate $name.$ext byte-identical (LibTorch $torch_major)"
    else
      fail "estimate $name.$ext differs from $expected" "$(diff "$expected" "$work/$name.$ext" 2>&1 | head -20)"
    fi
  done
done
[[ $update -eq 1 ]] && exit 0
summary
