#!/bin/bash
# The one command for a lent CUDA card (docs/gpu.md, "What has run on a GPU" and "Running it on a lent card"):
# what the card is, the versions, then the first-run kit on qwen1_5b_4bit and, in what is left, llama8b_4bit,
# each inside a budget, each JSON rewritten as results come (a cut run keeps what finished).
#
#   bash ../shared/gpu/prepare_gpu_site.sh          # once, here: .gpu/site, the packages the card's image lacks
#   bash bench/gpu_window.sh "$OUT"                  # on the card, from the checkout's root, with .gpu carried
#   bash bench/gpu_window.sh /tmp/w --dry            # CPU dry run: everything but the CUDA steps (--preset tiny)
#
# Writes at most 8 files into the folder (the lent machine returns 8): nvidia-smi.txt, versions.txt, steps.txt,
# kit1-PRESET.json + kit1-PRESET.log, kit2-PRESET.json + kit2-PRESET.log. Ends inside LOWVRAM_GPU_WINDOW_S seconds
# (default 540: one command may run 10 minutes). Dry mode: --dry or LOWVRAM_GPU_WINDOW_DRY=1 (default window 90 s).
set -uo pipefail

out="" dry=${LOWVRAM_GPU_WINDOW_DRY:-0}
for arg in "$@"; do
  case "$arg" in
    --dry) dry=1 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $arg: usage: bash bench/gpu_window.sh OUT_FOLDER [--dry]" >&2; exit 2 ;;
    *) if [ -n "$out" ]; then echo "error: one output folder, got $out and $arg" >&2; exit 2; fi; out=$arg ;;
  esac
done
if [ -z "$out" ]; then echo "error: name the output folder: bash bench/gpu_window.sh OUT_FOLDER [--dry]" >&2; exit 2; fi
case "$dry" in 0|1) ;; *) echo "error: LOWVRAM_GPU_WINDOW_DRY must be 0 or 1, got $dry" >&2; exit 2 ;; esac
mkdir -p "$out" || { echo "error: cannot make the output folder $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2

export PYTHONPATH="$PWD/.gpu/site:$PWD" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
if [ "$dry" = 1 ]; then
  window=${LOWVRAM_GPU_WINDOW_S:-90}; presets="tiny tiny"; second_min=20
else
  window=${LOWVRAM_GPU_WINDOW_S:-540}; presets="qwen1_5b_4bit llama8b_4bit"; second_min=90
fi
case "$window" in ''|*[!0-9]*) echo "error: LOWVRAM_GPU_WINDOW_S must be whole seconds, got $window" >&2; exit 2 ;; esac
margin=15   # seconds kept back at the end: the kits stop their children and write their JSON inside their budgets
steps="$out/steps.txt"
step() { echo "=== $1 at +${SECONDS} s" | tee -a "$steps"; }
: > "$steps"
step "window of $window s, dry=$dry, project $(git rev-parse --short HEAD 2>/dev/null || echo '?'), out $out"

step "nvidia-smi"
if [ "$dry" = 1 ]; then
  echo "dry mode (LOWVRAM_GPU_WINDOW_DRY=1 or --dry): no CUDA step runs; nvidia-smi not called" > "$out/nvidia-smi.txt"
elif command -v nvidia-smi >/dev/null; then
  timeout 30 nvidia-smi > "$out/nvidia-smi.txt" 2>&1; echo "rc $?" >> "$out/nvidia-smi.txt"
else
  echo "nvidia-smi: not found on this machine" > "$out/nvidia-smi.txt"
fi

step "versions"
timeout 60 "$py" - > "$out/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
for dist in ("torch", "transformers", "trl", "peft", "bitsandbytes", "unsloth", "unsloth_zoo", "vllm", "datasets",
             "accelerate", "triton"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
try:
    import torch
    print("torch cuda build", torch.version.cuda, "| cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(0), "sm%d%d" % torch.cuda.get_device_capability(0),
              round(torch.cuda.mem_get_info()[1] / 2**30, 1), "GiB")
except Exception as exc:  # the versions above still say what is there
    print("torch:", type(exc).__name__, exc)
EOF
echo "rc $?" >> "$out/versions.txt"

n=0 status=1
for preset in $presets; do
  n=$((n + 1))
  left=$((window - SECONDS - margin))
  if [ "$n" -gt 1 ] && [ "$left" -lt "$second_min" ]; then
    step "kit$n $preset: skipped, $left s left of the window (under $second_min s)"
    continue
  fi
  if [ "$left" -lt 5 ]; then step "kit$n $preset: skipped, $left s left of the window"; continue; fi
  step "kit$n $preset: --budget-s $left"
  json="$out/kit$n-$preset.json" log="$out/kit$n-$preset.log"
  # the kit ends itself inside its budget; timeout is the net under it
  timeout -k 10 $((left + 10)) "$py" -m bench.gpu_first_run --preset "$preset" --budget-s "$left" --out "$json" \
    > "$log" 2>&1
  rc=$?
  echo "rc $rc" >> "$log"
  tail -n 12 "$log" | grep -v '^GRPO' >> "$steps"
  step "kit$n $preset: exit $rc, $( [ -s "$json" ] && echo "JSON written" || echo "no JSON")"
  [ -s "$json" ] && status=0
done
step "done: $(ls "$out" | wc -l) files in $out"
exit $status
