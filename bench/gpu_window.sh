#!/bin/bash
# The one command for a lent CUDA card (docs/gpu.md, "Running it on a lent card"): what the card is and the
# versions, the default job (bench/gpu_default_job.py: SmolLM2-135M from the GGUF the calls carried, priming, GRPO,
# held-out before/after, bf16 and 4-bit, our decode loop against transformers' generate), then the first-run kit on
# qwen1_5b_4bit and llama8b_4bit in what is left, each inside a budget, each JSON rewritten as results come (a cut
# run keeps what finished). A kit whose preparation (its stand-in checkpoint) and first run cannot finish in the time
# left is skipped before it starts (bench.gpu_first_run.min_budget_s: an estimate from the preset's model shape).
#
#   bash bench/prepare_gpu_site.sh; python -m bench.gpu_stage split   # once, here; then the calls it lists
#   bash bench/gpu_window.sh "$OUT"                  # on the card, from the checkout's root (the last call)
#   bash bench/gpu_window.sh /tmp/w --dry            # CPU dry run: everything but the CUDA steps
#
# Writes at most 8 files into the folder (the lent machine returns 8): machine.txt (nvidia-smi, versions), steps.txt,
# default-job.json + default-job.log, kit1-PRESET.json + .log, kit2-PRESET.json + .log. Ends inside
# LOWVRAM_GPU_WINDOW_S seconds (default 540: one command may run 10 minutes); the default job gets
# LOWVRAM_GPU_JOB_S of them (default 400) and runs where the GGUF's parts travelled (.gpu-stage-1, -2) or in dry
# mode; LOWVRAM_GPU_WINDOW_PRESETS names the kits' presets. Dry mode (--dry or LOWVRAM_GPU_WINDOW_DRY=1): window
# 90 s, the job's --dry (the GGUF split and joined here, the runs on builtin:tiny), kits on tiny.
set -uo pipefail

out="" dry=${LOWVRAM_GPU_WINDOW_DRY:-0}
for arg in "$@"; do
  case "$arg" in
    --dry) dry=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
  window=${LOWVRAM_GPU_WINDOW_S:-90}; presets=${LOWVRAM_GPU_WINDOW_PRESETS:-tiny tiny}; job_s=${LOWVRAM_GPU_JOB_S:-60}
  cuda=False job_dry=--dry
else
  window=${LOWVRAM_GPU_WINDOW_S:-540}; presets=${LOWVRAM_GPU_WINDOW_PRESETS:-qwen1_5b_4bit llama8b_4bit}
  job_s=${LOWVRAM_GPU_JOB_S:-400}; cuda=True job_dry=
fi
case "$window" in ''|*[!0-9]*) echo "error: LOWVRAM_GPU_WINDOW_S must be whole seconds, got $window" >&2; exit 2 ;; esac
case "$job_s" in ''|*[!0-9]*) echo "error: LOWVRAM_GPU_JOB_S must be whole seconds, got $job_s" >&2; exit 2 ;; esac
margin=15   # seconds kept back at the end: the kits stop their children and write their JSON inside their budgets
steps="$out/steps.txt"
step() { echo "=== $1 at +${SECONDS} s" | tee -a "$steps"; }
: > "$steps"
step "window of $window s, dry=$dry, project $(git rev-parse --short HEAD 2>/dev/null || echo '?'), out $out"

machine="$out/machine.txt"
step "nvidia-smi"
if [ "$dry" = 1 ]; then
  echo "dry mode (LOWVRAM_GPU_WINDOW_DRY=1 or --dry): no CUDA step runs; nvidia-smi not called" > "$machine"
elif command -v nvidia-smi >/dev/null; then
  timeout 30 nvidia-smi > "$machine" 2>&1; echo "rc $?" >> "$machine"
else
  echo "nvidia-smi: not found on this machine" > "$machine"
fi

step "versions"
echo "=== versions" >> "$machine"
timeout 60 "$py" - >> "$machine" 2>&1 <<'EOF'
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
echo "rc $?" >> "$machine"

status=1
left=$((window - SECONDS - margin)); [ "$job_s" -gt "$left" ] && job_s=$left
if [ "$dry" = 0 ] && ! [ -d .gpu-stage-1 ]; then
  step "default job: skipped, the GGUF's parts did not travel (.gpu-stage-1 is missing: python -m bench.gpu_stage calls)"
elif [ "$job_s" -lt 5 ]; then
  step "default job: skipped, $job_s s left of the window"
else
  step "default job: --budget-s $job_s"
  json="$out/default-job.json" log="$out/default-job.log"
  # the job ends itself inside its budget; timeout is the net under it
  timeout -k 10 $((job_s + 10)) "$py" -m bench.gpu_default_job $job_dry --budget-s "$job_s" --out "$json" > "$log" 2>&1
  rc=$?
  echo "rc $rc" >> "$log"
  step "default job: exit $rc, $( [ -s "$json" ] && echo "JSON written" || echo "no JSON")"
  [ -s "$json" ] && status=0
fi

n=0
for preset in $presets; do
  n=$((n + 1))
  # its preparation (the stand-in checkpoint of the preset's shape) and first run, by the kit's own estimate
  need=$(timeout 60 "$py" -c "from bench.gpu_first_run import min_budget_s; print(int(min_budget_s('$preset', $cuda) + 0.999))" 2>>"$steps")
  if [ -z "$need" ]; then step "kit$n $preset: skipped, its estimate failed (above)"; continue; fi
  left=$((window - SECONDS - margin))
  if [ "$left" -lt "$need" ]; then
    step "kit$n $preset: skipped, $left s left of the window, its preparation and first run need ~$need s"
    continue
  fi
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
