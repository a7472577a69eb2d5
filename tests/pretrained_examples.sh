# Fine-tuning the examples from safetensors (Engine::load_pretrained):
# sourced by tests/examples_test.sh (its run, same, pass, fail, $tmp).
#
#   a. A Hugging Face LLaMA-named file (model.layers.N.self_attn.q_proj.weight,
#      ..., a rotary table the map ignores), written here by python3 from the
#      published format out of a llama --export, loads through hf_llama_names:
#      llama --pretrained trains at 2 ranks, at ZeRO stage 3 and at tensor
#      parallel size 2, exactly as --base from the same weights (losses
#      bitwise; the control, from the initial weights, differs); so does lora,
#      its adapters kept as initialised.
#   b. Its --export X.safetensors, read by python3 from the published format,
#      equals the trained parameters (the --base run's pickle export) bitwise,
#      and read back by the loader at another size and stage (--pretrained,
#      no step, --export) too.
#   c. That export reloaded into fresh engines at another data-parallel size
#      and stage evaluates the loss the trained engine evaluated, bitwise (every
#      rank computes the whole batch in the same order); at tensor-parallel size
#      2 within 1e-6 relative (the row-parallel sums and the vocabulary-parallel
#      loss add in another order).
#   d. A file of another shape is one error naming the mismatches; --pretrained
#      with --resume is refused.
pt_steps=4
pt_noclip=(--set gradient_clipping=0)

# The starting weights: a short llama run's export, renamed to Hugging Face's names.
if run pt_seed llama --steps 3 --export "$tmp/pt_seed.pt" &&
   out=$(/usr/bin/python3 - "$tmp/pt_seed.pt" "$tmp/hf.safetensors" 2>&1 <<'EOF'
import json, re, struct, sys, torch
weights = torch.load(sys.argv[1], weights_only=True)
parts = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
         "w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj",
         "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
def hf(name):
    if name in ("tok_emb.weight", "norm.weight"):
        return "model." + {"tok_emb.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}[name]
    if name == "lm_head.weight":
        return name
    layer, part = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.weight", name).groups()
    return f"model.layers.{layer}.{parts[part]}.weight"
tensors = {hf(n): t for n, t in weights.items()}
tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
header, data = {"__metadata__": {"format": "pt"}}, b""
for name in sorted(tensors):
    t = tensors[name].contiguous()
    raw = bytes(t.view(torch.uint8).flatten().tolist())
    header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
    data += raw
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
with open(sys.argv[2], "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + data)
print(f"{len(tensors)} tensors")
EOF
); then
  pass "python3 writes a Hugging Face-named safetensors file from the llama export ($out)"
else
  fail "python3 writes a Hugging Face-named safetensors file from the llama export" "$out" "$(cat "$tmp/pt_seed.out")"
fi

# python3's reader of the published format: every tensor of a .safetensors file.
cat >"$tmp/read_safetensors.py" <<'EOF'
import json, struct, torch
def read_safetensors(path):
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        raw = bytearray(blob[8 + n + begin:8 + n + end])
        out[name] = torch.frombuffer(raw, dtype=dtypes[e["dtype"]]).reshape(e["shape"]) if raw else \
            torch.empty(e["shape"], dtype=dtypes[e["dtype"]])
    return out
EOF

# The control: from the example's own initial weights the losses differ.
run pt_init llama --steps $pt_steps "${pt_noclip[@]}" --set zero_optimization.stage=3 --losses "$tmp/pt_init.txt" ||
  fail "llama from its initial weights" "$(cat "$tmp/pt_init.out")"

# a. and b. at ZeRO stage 3 and at tensor-parallel size 2 (both 2 ranks).
for layout in stage3 tp2; do
  set_layout=(--set zero_optimization.stage=3)
  [[ $layout == tp2 ]] && set_layout=(--set tensor_parallel.size=2)
  run "pt_$layout" llama --steps $pt_steps "${pt_noclip[@]}" "${set_layout[@]}" --pretrained "$tmp/hf.safetensors" \
    --eval --losses "$tmp/pt_$layout.txt" --export "$tmp/pt_$layout.safetensors" ||
    fail "llama --pretrained ($layout)" "$(cat "$tmp/pt_$layout.out")"
  run "ptbase_$layout" llama --steps $pt_steps "${pt_noclip[@]}" "${set_layout[@]}" --base "$tmp/pt_seed.pt" \
    --losses "$tmp/ptbase_$layout.txt" --export "$tmp/ptbase_$layout.pt" ||
    fail "llama --base ($layout)" "$(cat "$tmp/ptbase_$layout.out")"
  if grep -q "30 tensors, 0 kept as initialised, 1 ignored" "$tmp/pt_$layout.out"; then
    same "llama --pretrained from Hugging Face names trains as --base from the same weights ($layout)" \
      "$tmp/pt_$layout.txt" "$tmp/ptbase_$layout.txt" $pt_steps
  else
    fail "llama --pretrained ($layout) loaded the file, its rotary table ignored" "$(cat "$tmp/pt_$layout.out")"
  fi
  # Read back by the loader at another size and stage, exported again.
  back_layout=(--set tensor_parallel.size=2 --set zero_optimization.stage=1)
  [[ $layout == tp2 ]] && back_layout=(--set zero_optimization.stage=3)
  NP=2 run "ptback_$layout" llama --steps 0 "${back_layout[@]}" --pretrained "$tmp/pt_$layout.safetensors" \
    --export "$tmp/ptback_$layout.pt" || fail "llama reads back its export ($layout)" "$(cat "$tmp/ptback_$layout.out")"
  if out=$(/usr/bin/python3 - "$tmp/pt_$layout.safetensors" "$tmp/ptbase_$layout.pt" "$tmp/ptback_$layout.pt" \
             "$tmp/read_safetensors.py" 2>&1 <<'EOF'
import sys, torch
exec(open(sys.argv[4]).read())
exported = read_safetensors(sys.argv[1])
for path in sys.argv[2:4]:
    trained = torch.load(path, weights_only=True)
    assert set(trained) == set(exported), (path, set(trained) ^ set(exported))
    bad = [n for n, t in trained.items() if not (t.dtype == exported[n].dtype and torch.equal(t, exported[n]))]
    assert not bad, (path, bad)
print(f"{len(exported)} tensors")
EOF
  ); then
    pass "llama ($layout): the safetensors export equals the trained parameters bitwise, and read back by the loader ($out)"
  else
    fail "llama ($layout): the safetensors export equals the trained parameters bitwise, and read back by the loader" "$out"
  fi
done

differs "llama control: from the initial weights instead of the file" "$tmp/pt_init.txt" "$tmp/pt_stage3.txt"

# c. The stage-3 export, reloaded at data-parallel size 1 (stage 0) and 2
#    (stage 1), and at tensor-parallel size 2: the loss the trained engine evaluated.
trained=$(sed -nE 's/^final eval loss (.*)/\1/p' "$tmp/pt_stage3.out")
NP=1 run pt_eval_dp1 llama --steps 0 --pretrained "$tmp/pt_stage3.safetensors" --eval
run pt_eval_dp2 llama --steps 0 --set zero_optimization.stage=1 --pretrained "$tmp/pt_stage3.safetensors" --eval
run pt_eval_tp2 llama --steps 0 --set tensor_parallel.size=2 --pretrained "$tmp/pt_stage3.safetensors" --eval
for label in pt_eval_dp1 pt_eval_dp2; do
  got=$(sed -nE 's/^eval loss (.*)/\1/p' "$tmp/$label.out")
  if [[ -n $trained && $got == "$trained" ]]; then
    pass "the stage-3 export reloaded ($label) evaluates the trained engine's loss bitwise ($got)"
  else
    fail "the stage-3 export reloaded ($label) evaluates the trained engine's loss bitwise ($got vs $trained)" \
      "$(cat "$tmp/$label.out")"
  fi
done
got=$(sed -nE 's/^eval loss (.*)/\1/p' "$tmp/pt_eval_tp2.out")
if [[ -n $trained && -n $got ]] && awk -v a="$got" -v b="$trained" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-6 * b) }'; then
  pass "the stage-3 export reloaded at tensor-parallel size 2 evaluates the trained engine's loss within 1e-6 relative ($got vs $trained)"
else
  fail "the stage-3 export reloaded at tensor-parallel size 2 evaluates the trained engine's loss within 1e-6 relative ($got vs $trained)" \
    "$(cat "$tmp/pt_eval_tp2.out")"
fi

# a. LoRA from the Hugging Face file at stage 3: its adapters kept as
#    initialised, trained as from --base.
run pt_lora lora --steps $pt_steps "${pt_noclip[@]}" --set zero_optimization.stage=3 --pretrained "$tmp/hf.safetensors" \
  --losses "$tmp/pt_lora.txt" || fail "lora --pretrained" "$(cat "$tmp/pt_lora.out")"
run ptbase_lora lora --steps $pt_steps "${pt_noclip[@]}" --set zero_optimization.stage=3 --base "$tmp/pt_seed.pt" \
  --losses "$tmp/ptbase_lora.txt" || fail "lora --base" "$(cat "$tmp/ptbase_lora.out")"
if grep -q "30 tensors, 42 kept as initialised, 1 ignored" "$tmp/pt_lora.out"; then
  same "lora --pretrained from Hugging Face names (adapters kept as initialised) trains as --base" \
    "$tmp/pt_lora.txt" "$tmp/ptbase_lora.txt" $pt_steps
else
  fail "lora --pretrained: 30 tensors loaded, the 42 adapters kept as initialised" "$(cat "$tmp/pt_lora.out")"
fi

# d. Mismatches and misuse: clear errors, nonzero exits.
expect "llama --pretrained of another shape (--kv-heads 4) names the mismatches" \
  "shapes that differ from the parameter's whole shape: 'model.layers.0.self_attn.k_proj.weight' as 'blocks.0.wk.weight'" \
  launch/remat-run.sh -np 2 -- "$root/llama/llama" --steps 1 --kv-heads 4 --pretrained "$tmp/hf.safetensors"
expect "llama --pretrained with --resume is refused" "--pretrained and --resume both give the starting weights" \
  launch/remat-run.sh -np 2 -- "$root/llama/llama" --steps 1 --pretrained "$tmp/hf.safetensors" --resume "$tmp"
