#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer over remat's own code.
#
#   tools/sanitize.sh          the full run (about 20 CPU-minutes to build here):
#                              every unit test, the multi-rank tests at 2 and 4
#                              ranks, and a short training run that saves and resumes
#   tools/sanitize.sh --quick  the config parser and the safetensors reader with
#                              their fuzz tests only (a few minutes; ./test.sh
#                              runs this one)
#
# UBSan includes float-cast-overflow (not part of GCC's -fsanitize=undefined)
# and every report is fatal. LibTorch and Open MPI are not instrumented, so
# leaks are not checked (detect_leaks=0) and what is found is in remat's code
# or in the headers it compiles. Builds in its own Bazel output base, so the
# normal build's cache is untouched. Prints "[remat-test] N passed, M failed".
set -uo pipefail
cd "$(dirname "$0")/.."
source tests/testlib.sh

mode=full
[[ "${1:-}" == "--quick" ]] && mode=quick

flags=(--copt=-fsanitize=address,undefined,float-cast-overflow --copt=-fno-sanitize-recover=all
       --copt=-fno-omit-frame-pointer --copt=-O1 --copt=-g1
       --linkopt=-fsanitize=address,undefined,float-cast-overflow)
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export REMAT_LOG_LEVEL=warn REMAT_COMM_TIMEOUT_S=120
# Its own output base, and no bazel-* links in the checkout (they keep pointing
# at the normal build).
bazel_s() { bazel --output_base="$HOME/.cache/remat-bazel-sanitize" "$1" --symlink_prefix=/ "${@:2}"; }

if [[ $mode == quick ]]; then
  targets=(//engine:config_test //engine:safetensors_test)
else
  # Every package by name: //... would walk into the normal build's bazel-* links.
  targets=(//runtime/... //nn/... //rng/... //data/... //optim/... //checkpointing/... //parallel/...
           //models/... //engine/... //launch/... //tests/... //configs/...)
fi
log=$(mktemp)
if ! bazel_s build "${flags[@]}" "${targets[@]}" >"$log" 2>&1; then
  tail -30 "$log"
  fail "sanitized build"
  summary
  exit 1
fi
pass "sanitized build of ${targets[*]}"

# run NAME COMMAND...: passes when the command exits 0 with no sanitizer report.
run() {
  local name="$1" out rc
  shift
  out=$(timeout 900 "$@" 2>&1); rc=$?
  if [[ $rc -eq 0 ]] && ! grep -qE "ERROR: AddressSanitizer|runtime error:" <<<"$out"; then
    pass "$name"
  else
    fail "$name (exit $rc)" "$(grep -E -A12 "ERROR: AddressSanitizer|runtime error:" <<<"$out" | head -40)" \
      "$(tail -15 <<<"$out")"
  fi
}

bin=$(bazel_s info "${flags[@]}" bazel-bin 2>/dev/null)
run "config_test (fuzz included) under ASan + UBSan" "$bin/engine/config_test"
run "safetensors_test (fuzz included) under ASan + UBSan" "$bin/engine/safetensors_test"
if [[ $mode == full ]]; then
  for t in runtime/runtime_unit_test runtime/memory_test rng/rng_tracker_test \
           checkpointing/checkpoint_test tests/policy_test checkpointing/checkpoint_contract_test \
           nn/module_call_test engine/optim_test optim/host_adam_test; do
    run "$t under ASan + UBSan" "$bin/$t"
  done
  for t in runtime/communicator_test_bin parallel/parallel_test_bin parallel/zero_test_bin engine/zero_engine_test_bin \
           tests/stored_inputs_test_bin engine/engine_test_bin; do
    for np in 2 4; do
      run "$t at $np ranks under ASan + UBSan" launch/remat-run.sh -np "$np" -- "$bin/$t"
    done
  done
  tmp=$(mktemp -d)
  small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
         --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0)
  run "remat-train saves under ASan + UBSan (ZeRO-3, full checkpointing)" \
    launch/remat-run.sh -np 2 -- "$bin/launch/remat-train" "${small[@]}" --steps 4 \
    --set zero_optimization.stage=3 --set activation_checkpointing.variant=full --save-dir "$tmp/s"
  run "remat-train resumes under ASan + UBSan" \
    launch/remat-run.sh -np 2 -- "$bin/launch/remat-train" "${small[@]}" --steps 6 \
    --set zero_optimization.stage=3 --set activation_checkpointing.variant=full --resume "$tmp/s"
  rm -rf "$tmp"
fi
summary
