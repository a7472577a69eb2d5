# Shared by the whole-job test scripts: case accounting and the "expect a clear
# error" check. Source it, then call summary at the end.
passed=0
failed=0

pass() {
  echo "[ PASSED ] $1"
  passed=$((passed + 1))
}

# fail NAME [DETAIL...]: the last lines of each detail are printed.
fail() {
  echo "[ FAILED ] $1"
  shift
  printf '%s\n' "$@" | tail -20
  failed=$((failed + 1))
}

# expect NAME TEXT COMMAND...: the command must end with a nonzero exit (not a
# timeout, not a signal) and print TEXT.
expect() {
  local name="$1" text="$2"
  shift 2
  local out rc
  # NUL bytes in a program's output are dropped (bash 5.2 warns about each one).
  out=$(timeout 120 "$@" 2>&1 | tr -d '\000'; exit "${PIPESTATUS[0]}")
  rc=$?
  if [[ $rc -ne 0 && $rc -ne 124 && $rc -lt 128 ]] && grep -qF -- "$text" <<<"$out"; then
    pass "$name (exit $rc)"
  else
    fail "$name (exit $rc, wanted a nonzero exit and: $text)" "$out"
  fi
}

# skip NAME WHY: a case this machine cannot run (counted neither way).
skip() {
  echo "[ SKIPPED ] $1 ($2)"
}

# expect_all NAME TEXT... -- COMMAND...: like expect, with every TEXT printed.
expect_all() {
  local name="$1" texts=() text out rc missing=""
  shift
  while [[ $# -gt 0 && "$1" != "--" ]]; do texts+=("$1"); shift; done
  shift
  out=$(timeout 120 "$@" 2>&1 | tr -d '\000'; exit "${PIPESTATUS[0]}")
  rc=$?
  for text in "${texts[@]}"; do grep -qF -- "$text" <<<"$out" || missing+=" '$text'"; done
  if [[ $rc -ne 0 && $rc -ne 124 && $rc -lt 128 && -z "$missing" ]]; then
    pass "$name (exit $rc)"
  else
    fail "$name (exit $rc, wanted a nonzero exit and:$missing)" "$out"
  fi
}

# The loss column of a metrics file, exactly as printed (round-trip precision).
losses() { sed -E 's/.*"loss":([^,}]*).*/\1/' "$1"; }

# flip_bit FILE: flips one bit in the middle of FILE.
flip_bit() {
  /usr/bin/python3 - "$1" <<'EOF'
import sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
data[len(data) // 2] ^= 0x01
open(path, "wb").write(bytes(data))
EOF
}

# reseal MANIFEST: recomputes a manifest's own checksum (manifest_crc32: the
# CRC-32 of its compact JSON, keys sorted, without that field), as a careful
# hand edit would, so that what lies beneath the checksum is tested.
reseal() {
  /usr/bin/python3 - "$1" <<'EOF'
import json, sys, zlib
path = sys.argv[1]
manifest = json.load(open(path))
manifest.pop("manifest_crc32", None)
text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
manifest["manifest_crc32"] = zlib.crc32(text.encode("utf-8"))
json.dump(manifest, open(path, "w"), indent=1)
EOF
}

# Prints the line ./test.sh adds up and returns nonzero on any failure.
summary() {
  echo "[remat-test] $passed passed, $failed failed"
  [[ $failed -eq 0 ]]
}
