#!/usr/bin/env bash
# remat's safetensors reader and writer (engine/safetensors.h) against Python:
# a file written by a writer made here from the published format (8-byte
# little-endian header length, JSON header, raw bytes; with Debian's
# python3-torch) is read by remat bitwise; remat's files, one and sharded
# with an index, are read back here bitwise; and where python3-safetensors is
# installed (Debian 13), its load_file reads remat's file and remat reads its
# save_file's.
#
#   tests/safetensors_test.sh SAFETENSORS_TOOL
set -uo pipefail
source "$(dirname "$0")/testlib.sh"
tool=$(realpath "${1:?usage: safetensors_test.sh SAFETENSORS_TOOL}")
py=/usr/bin/python3  # Debian's, with python3-torch
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The Python side: the published format written and read out, the fixed set of
# tests/safetensors_tool.cc, and the dump's line format.
cat >"$tmp/st.py" <<'EOF'
import json, os, struct, sys
import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}

def raw(t):
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()

def write(path, tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        b = raw(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)

def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert (8 + n) % 8 == 0, f"{path}: the data starts at {8 + n}, not 8-byte aligned"
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in header.items())
    at = 0
    for b, e, k in spans:
        assert b == at, f"{path}: {k} starts at {b}, the one before ended at {at}"
        at = e
    assert at == len(data), f"{path}: the tensors cover {at} of {len(data)} bytes"
    out = {}
    for k, e in header.items():
        b, end = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        if end == b:
            out[k] = torch.empty(e["shape"], dtype=dtype)
        else:
            out[k] = torch.frombuffer(bytearray(data[b:end]), dtype=dtype).reshape(e["shape"])
    return out, meta

def read_set(path):
    if not os.path.isdir(path):
        return read(path)[0]
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors, _ = read(os.path.join(path, f))
        for k in tensors:
            assert index["weight_map"][k] == f, f"{k} is in {f}, the index says {index['weight_map'][k]}"
        out.update(tensors)
    assert sorted(out) == sorted(index["weight_map"]), "the index and the shards list other tensors"
    total = sum(t.numel() * t.element_size() for t in out.values())
    assert index["metadata"]["total_size"] == total, f"total_size {index['metadata']['total_size']} != {total}"
    return out

def dump(tensors):
    lines = []
    for k in sorted(tensors):
        t = tensors[k]
        lines.append(f"{k} {NAMES[t.dtype]} [{','.join(str(s) for s in t.shape)}] {raw(t).hex() or '-'}")
    return "\n".join(lines) + "\n"

def remat_set():  # tests/safetensors_tool.cc's `write`
    f = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8 - 3
    return {"model.embed.weight": f, "model.norm.weight": f.to(torch.bfloat16).t(),
            "model.half": f[0:2].to(torch.float16), "model.steps": torch.arange(5) * (1 << 40) - 7,
            "model.mask": (torch.arange(7) % 3) == 0, "model.empty": torch.zeros(0, 3),
            "model.scale": torch.tensor(0.5, dtype=torch.float64)}

def python_set():
    g = torch.Generator().manual_seed(52)
    return {"w.f32": torch.randn(3, 5, generator=g), "w.bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "w.f16": torch.randn(6, generator=g).to(torch.float16),
            "w.i64": torch.randint(-(1 << 50), 1 << 50, (2, 2), generator=g),
            "w.bool": torch.randint(0, 2, (5,), generator=g).bool(), "w.empty": torch.empty(2, 0),
            "w.scalar": torch.tensor(-1.25)}

def same(a, b):
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and raw(a[k]) == raw(b[k]) for k in a)

cmd = sys.argv[1]
if cmd == "write":
    write(sys.argv[2], python_set(), {"format": "pt", "source": "tests/safetensors_test.sh"})
    sys.stdout.write(dump(python_set()))
elif cmd == "check":  # remat's file or folder, read here, against the fixed set
    got = read_set(sys.argv[2])
    if not same(got, remat_set()):
        sys.exit("remat's tensors differ from the fixed set:\n" + dump(got) + "wanted:\n" + dump(remat_set()))
    print(len(got), "tensors bitwise")
elif cmd == "lib-load":  # python3-safetensors reads remat's file
    from safetensors.torch import load_file
    got = load_file(sys.argv[2])
    if not same(got, remat_set()):
        sys.exit("safetensors.torch.load_file differs:\n" + dump(got))
    print(len(got), "tensors bitwise")
elif cmd == "lib-save":  # python3-safetensors writes one for remat
    from safetensors.torch import save_file
    t = {k: v.contiguous() for k, v in python_set().items()}
    save_file(t, sys.argv[2], metadata={"format": "pt"})
    sys.stdout.write(dump(t))
elif cmd == "has-lib":
    import safetensors.torch
EOF

# 1. A file written here from the published format, read by remat bitwise.
if want=$("$py" "$tmp/st.py" write "$tmp/py.safetensors" 2>&1) && got=$("$tool" dump "$tmp/py.safetensors" 2>&1) &&
   [[ "$got" == "$want" ]]; then
  pass "a file written from the format in Python (f32, bf16, f16, i64, bool, zero-size, scalar) read by remat bitwise"
else
  fail "remat reads a file written in Python" "wanted:" "$want" "got:" "$got"
fi

# 2. remat's file read here bitwise (the header's layout checked too).
if "$tool" write "$tmp/remat.safetensors" && out=$("$py" "$tmp/st.py" check "$tmp/remat.safetensors" 2>&1); then
  pass "remat's file read in Python from the format: $out"
else
  fail "Python reads remat's file" "${out:-the tool failed}"
fi

# 3. Shards of at most 100 bytes: several files, the index written last, read here bitwise.
if "$tool" write "$tmp/shards" 100 && out=$("$py" "$tmp/st.py" check "$tmp/shards" 2>&1); then
  n=$(ls "$tmp/shards" | grep -c '^model-.*-of-.*\.safetensors$')
  if [[ $n -ge 3 && -f $tmp/shards/model.safetensors.index.json ]] && ! ls "$tmp/shards" | grep -q remat-tmp; then
    pass "remat's shards ($n files and the index) read in Python: $out"
  else
    fail "remat's shards" "$(ls -l "$tmp/shards")"
  fi
else
  fail "Python reads remat's shards" "${out:-the tool failed}"
fi
if got=$("$tool" dump "$tmp/shards" 2>&1) && [[ "$got" == "$("$tool" dump "$tmp/remat.safetensors")" ]]; then
  pass "remat reads its shards through the index as its single file"
else
  fail "remat reads its shards" "$got"
fi

# 4. Bad files end in a clear error and exit 1, never a crash.
head -c 100 "$tmp/remat.safetensors" >"$tmp/cut.safetensors"
expect "a truncated file is refused" "the file is truncated" "$tool" dump "$tmp/cut.safetensors"
printf '\xff\xff\xff\xff\xff\xff\x00\x00{}' >"$tmp/huge.safetensors"
expect "a huge header length is refused" "a safetensors reader accepts" "$tool" dump "$tmp/huge.safetensors"

# 5. Python's safetensors package where it is installed (Debian 13's python3-safetensors).
if "$py" "$tmp/st.py" has-lib 2>/dev/null; then
  if out=$("$py" "$tmp/st.py" lib-load "$tmp/remat.safetensors" 2>&1); then
    pass "safetensors.torch.load_file reads remat's file: $out"
  else
    fail "safetensors.torch.load_file reads remat's file" "$out"
  fi
  if want=$("$py" "$tmp/st.py" lib-save "$tmp/lib.safetensors" 2>&1) && got=$("$tool" dump "$tmp/lib.safetensors" 2>&1) &&
     [[ "$got" == "$want" ]]; then
    pass "remat reads safetensors.torch.save_file's file bitwise"
  else
    fail "remat reads safetensors.torch.save_file's file" "wanted:" "$want" "got:" "$got"
  fi
else
  skip "python3-safetensors checks" "the package is not installed here (Debian 13 has it)"
fi
summary
