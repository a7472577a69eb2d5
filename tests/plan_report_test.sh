#!/usr/bin/env bash
# remat-train's planner report end to end: memory_budget_fraction "knee" plans
# at the knee of the planner's frontier and --plan-report DIR writes that
# frontier (frontier.csv, the knee's row being the plan in effect, and
# frontier.png where python3 has matplotlib); bad inputs fail before training
# with what to change. Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$1"
run="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=info
source "$(dirname "$0")/testlib.sh"

ac=activation_checkpointing
small=(--set model.n_layer=4 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0
       --set $ac.variant=auto)

# 1. The knee on 2 ranks: the report is rank 0's, the plan every rank's.
report="$tmp/knee_report"
metrics="$tmp/knee.jsonl"
rm -rf "$report"
out=$("$run" -np 2 -- "$train" --steps 3 "${small[@]}" --set $ac.memory_budget_fraction=knee \
    --plan-report "$report" --metrics "$metrics" 2>&1)
rc=$?
if [[ $rc -eq 0 && -s "$report/frontier.csv" && $(wc -l <"$metrics") -eq 3 ]]; then
  pass "knee run: 3 steps, frontier.csv written"
else
  fail "knee run: 3 steps, frontier.csv written (exit $rc)" "$out"
fi
check=$(python3 - "$report/frontier.csv" "$metrics" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1])))
steps = [json.loads(line) for line in open(sys.argv[2])]
problems = []
header = ["point", "budget_bytes", "budget_fraction", "predicted_peak_bytes", "predicted_peak_mib", "extra_ms",
          "extra_cpu_ms", "extra_wall_ms", "knee", "chosen", "plan"]
if list(rows[0].keys()) != header:
    problems.append(f"header {list(rows[0].keys())}")
if len(rows) < 3:
    problems.append(f"only {len(rows)} points")
peaks = [int(r["predicted_peak_bytes"]) for r in rows]
times = [float(r["extra_ms"]) for r in rows]
# Times descend; the CSV prints them to 0.001 ms, so two frontier points whose
# times differ by less can print alike (seen: 1.437 and 1.437).
if peaks != sorted(set(peaks)) or any(b < a for a, b in zip(times[1:], times)):
    problems.append("peaks do not ascend or times do not descend")
if times[-1] != 0:
    problems.append("the last point has extra time")
knees = [r for r in rows if r["knee"] == "1"]
chosen = [r for r in rows if r["chosen"] == "1"]
if len(knees) != 1 or knees != chosen:
    problems.append(f"{len(knees)} knee rows, {len(chosen)} chosen rows, not the same one")
elif steps[0]["act_plan"] != knees[0]["plan"]:
    problems.append(f"plan in effect {steps[0]['act_plan']} is not the knee's {knees[0]['plan']}")
elif steps[0]["act_plan_budget_bytes"] != int(knees[0]["budget_bytes"]):
    problems.append("the plan's budget is not the knee's peak")
if any(s["act_plan"] != steps[0]["act_plan"] for s in steps):
    problems.append("the plan changed between steps")
print("; ".join(problems) if problems else "ok", rows and knees and f"(knee: point {knees[0]['point']} of {len(rows)})")
PY
)
if [[ "$check" == ok* ]]; then
  pass "frontier.csv: ascending peaks, descending times, the knee's row is the plan in effect $check"
else
  fail "frontier.csv: ascending peaks, descending times, the knee's row is the plan in effect" "$check" \
    "$(cat "$report/frontier.csv")"
fi
if grep -qF "the knee is point" <<<"$out" && grep -qF "wrote the frontier" <<<"$out"; then
  pass "the log names the knee and the report"
else
  fail "the log names the knee and the report" "$out"
fi
# The picture where matplotlib is, else the command that draws it.
if python3 -c "import matplotlib" 2>/dev/null; then
  if [[ -s "$report/frontier.png" && -s "$report/plot_frontier.py" ]]; then
    pass "frontier.png drawn"
  else
    fail "frontier.png drawn" "$out"
  fi
elif [[ -s "$report/plot_frontier.py" ]] && grep -qF "to draw it: python3 " <<<"$out"; then
  pass "no matplotlib: the script and the command that draws the frontier are left"
else
  fail "no matplotlib: the script and the command that draws the frontier are left" "$out"
fi

# 2. A fraction with a report: its point is marked, the knee too.
report2="$tmp/fraction_report"
out=$("$run" -np 1 -- "$train" --steps 1 "${small[@]}" --set $ac.memory_budget_fraction=0.5 \
    --plan-report "$report2" 2>&1)
if [[ $? -eq 0 ]] && [[ $(awk -F, 'NR > 1 && $10 == 1' "$report2/frontier.csv" | wc -l) -eq 1 ]] &&
   [[ $(awk -F, 'NR > 1 && $9 == 1' "$report2/frontier.csv" | wc -l) -eq 1 ]]; then
  pass "fraction 0.5 with --plan-report: one chosen row, one knee row"
else
  fail "fraction 0.5 with --plan-report: one chosen row, one knee row" "$out" "$(cat "$report2/frontier.csv")"
fi

# 3. Bad inputs, refused before training.
touch "$tmp/a_file"
expect "--plan-report on a file" "--plan-report '$tmp/a_file' is a file, not a folder" \
  "$train" --steps 1 "${small[@]}" --set $ac.memory_budget_fraction=knee --plan-report "$tmp/a_file"
expect "--plan-report where no folder can be made" "--plan-report: cannot create the folder '/proc/remat-report'" \
  "$train" --steps 1 "${small[@]}" --set $ac.memory_budget_fraction=knee --plan-report /proc/remat-report
expect "--plan-report without variant auto" "--plan-report writes the memory planner's frontier, but \
activation_checkpointing.variant is \"full\"" \
  "$train" --steps 1 "${small[@]}" --set $ac.variant=full --plan-report "$tmp/unused"
metrics1="$tmp/one_block.jsonl"
rm -f "$metrics1"
expect_all "the knee of one block" "memory_budget_fraction is \"knee\"" "the model has 1 block in 'blocks'" \
  "Set memory_budget_fraction to a number" -- \
  "$train" --steps 1 "${small[@]}" --set model.n_layer=1 --set $ac.memory_budget_fraction=knee \
  --metrics "$metrics1"
if [[ ! -s "$metrics1" ]]; then
  pass "the knee of one block trains no step"
else
  fail "the knee of one block trains no step" "$(cat "$metrics1")"
fi
expect "a misspelt knee" "is neither a number nor \"knee\"; did you mean \"knee\"?" \
  "$train" --steps 1 "${small[@]}" --set $ac.memory_budget_fraction=kne

summary
