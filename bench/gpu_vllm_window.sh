#!/bin/bash
# unsloth + vLLM fast_inference on a lent CUDA card, in one window of 4 back-to-back calls (issue 55). The call list
# (what each call carries, its command and timeout) and its check: `python -m bench.gpu_vllm_window calls`.
#
#   bash bench/gpu_vllm_window.sh N "$OUT"           # on the card, from the checkout's root: call N's work (N = 1..4)
#   bash bench/gpu_vllm_window.sh all /tmp/w --dry   # on a CPU: the call list checked, then calls 1-4 without CUDA
#
# 1 (carries .gpu): .gpu/site copied to $STATE, nvidia-smi, versions, the random Llama-3.2-1B-shaped checkpoint.
# 2, 3 (carry .vs/p01, .vs/p02): vLLM 0.26's parts stashed (join.sh --stash).
# 4 (carries .vs/p03): rejoined and verified (join.sh --verify), installed into $STATE/vsite (bench/vllm_stage/
#   install.sh: pip --no-index --no-deps --target), then python -m bench.gpu_vllm_window run: window.json rewritten
#   after every phase and step, run.log, events.jsonl.
# $STATE (LOWVRAM_VLLM_STATE, default /tmp/lowvram-vllm-window) stays on the machine while it is warm (~30 s after a
# call); every call appends its lines to $STATE/steps.txt and the last returns it. At most 8 files in OUT per call.
# --dry (or LOWVRAM_VLLM_WINDOW_DRY=1): no nvidia-smi, the parts' sha256 checked where they lie (nothing moved or
# installed: this machine's packages run), a scaled-down checkpoint, the run with model.fast_inference=false.
# LOWVRAM_VLLM_ENFORCE_EAGER=1 (call 4): vLLM starts without torch.compile and CUDA graphs (a shorter start).
set -uo pipefail

call="" out="" dry=${LOWVRAM_VLLM_WINDOW_DRY:-0}
usage="usage: bash bench/gpu_vllm_window.sh 1|2|3|4|all OUT_FOLDER [--dry]"
for arg in "$@"; do
  case "$arg" in
    --dry) dry=1 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $arg: $usage" >&2; exit 2 ;;
    *) if [ -z "$call" ]; then call=$arg
       elif [ -z "$out" ]; then out=$arg
       else echo "error: one call and one output folder, got also $arg: $usage" >&2; exit 2; fi ;;
  esac
done
case "$call" in
  1|2|3|4) ;;
  all) [ "$dry" = 1 ] || { echo "error: 'all' runs the calls in one process: on a CPU only, with --dry (on the card each call is its own device call)" >&2; exit 2; } ;;
  *) echo "error: name the call (1-4, or all with --dry): $usage" >&2; exit 2 ;;
esac
[ -n "$out" ] || { echo "error: name the output folder: $usage" >&2; exit 2; }
case "$dry" in 0|1) ;; *) echo "error: LOWVRAM_VLLM_WINDOW_DRY must be 0 or 1, got $dry" >&2; exit 2 ;; esac
mkdir -p "$out" || { echo "error: cannot make the output folder $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2

state=${LOWVRAM_VLLM_STATE:-/tmp/lowvram-vllm-window}
mkdir -p "$state" || { echo "error: cannot make $state" >&2; exit 2; }
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
dryflag=""; [ "$dry" = 1 ] && dryflag="--dry"
eager=""; [ "${LOWVRAM_VLLM_ENFORCE_EAGER:-0}" = 1 ] && eager="--enforce-eager"  # vLLM without compile / CUDA graphs
# the card's Python path: the carried site (Python 3.12, for the image's torch 2.11) before the checkout; a dry run
# uses this machine's packages (the site is still copied, as on the card)
site_path() { if [ "$dry" = 1 ]; then echo "$root"; else echo "$state/gpu-site:$root"; fi; }

step() { echo "=== call $n: $1 at $(date -u +%H:%M:%S) UTC (+${SECONDS} s of this call)" | tee -a "$state/steps.txt"; }
fail() { step "FAILED: $1"; echo "error: call $n: $1" >&2; exit "${2:-1}"; }

call_1() {
  step "begins (dry=$dry, project $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  if [ -d .gpu/site ]; then
    rm -rf "$state/gpu-site" && cp -a .gpu/site "$state/gpu-site" || fail "cannot copy .gpu/site to $state"
    step ".gpu/site copied to $state/gpu-site ($(du -sm "$state/gpu-site" | cut -f1) MiB)"
  elif [ "$dry" = 1 ]; then
    step "dry: no .gpu/site here (bash bench/prepare_gpu_site.sh builds it): this machine's packages run"
  else
    fail ".gpu/site is not here: this call carries .gpu (bash bench/prepare_gpu_site.sh builds it)" 2
  fi
  if [ "$dry" = 1 ]; then
    echo "dry mode: no CUDA step runs; nvidia-smi not called" > "$o/nvidia-smi.txt"
  else
    timeout 30 nvidia-smi > "$o/nvidia-smi.txt" 2>&1; echo "rc $?" >> "$o/nvidia-smi.txt"
  fi
  PYTHONPATH=$(site_path) timeout 60 "$py" -m bench.gpu_vllm_window versions > "$o/versions-1.json" 2> "$o/build.log"
  step "versions: rc $?"
  PYTHONPATH=$(site_path) timeout 45 "$py" -m bench.gpu_vllm_window build "$state/model" $dryflag >> "$o/build.log" 2>&1
  rc=$?; tail -n 1 "$o/build.log" | tee -a "$state/steps.txt"
  [ $rc = 0 ] || step "building the checkpoint failed (rc $rc, build.log): call 4 builds it"
  step "ends"
}

call_stash() {  # calls 2 and 3: one part each
  part=$(printf 'p%02d' $((n - 1)))
  step "begins: $part"
  if [ "$dry" = 1 ]; then
    if [ -d ".vs/$part" ]; then
      "$py" -m bench.gpu_vllm_window verify ".vs/$part" > "$o/stash.log" 2>&1 || fail "$(tail -n 1 "$o/stash.log")"
      step "dry: .vs/$part verified in place ($(grep -c '^ok' "$o/stash.log") files)"
    else
      step "dry: no .vs/$part here (make the parts: bench/vllm_stage/README.md, docs/gpu.md)"
    fi
  else
    [ -f ".vs/$part/join.sh" ] || fail ".vs/$part is not here: this call carries it" 2
    bash ".vs/$part/join.sh" --stash > "$o/stash.log" 2>&1 || fail "join.sh --stash: $(tail -n 1 "$o/stash.log")"
    tail -n 1 "$o/stash.log" | tee -a "$state/steps.txt"
  fi
  step "ends"
}

call_4() {
  step "begins: p03, install, the run"
  limit=$("$py" -m bench.gpu_vllm_window timeout 4) || fail "cannot read call 4's timeout" 2
  if [ "$dry" = 1 ]; then
    parts=$(ls -d .vs/p[0-9][0-9] 2>/dev/null | tr '\n' ' ')
    if [ -n "$parts" ]; then
      # shellcheck disable=SC2086
      "$py" -m bench.gpu_vllm_window verify $parts > "$o/install.log" 2>&1 || fail "$(tail -n 1 "$o/install.log")"
      step "dry: $parts verified, split wheels rejoined in memory; nothing installed (this machine's packages run)"
    else
      echo "dry mode: no vLLM parts here; nothing installed" > "$o/install.log"
      step "dry: no vLLM parts here; nothing installed"
    fi
    echo '{"dry": true}' > "$state/install.json"
  else
    [ -d "$state/gpu-site" ] || fail "no $state/gpu-site: the machine was given back since call 1 (a fresh one keeps nothing): issue the calls again from call 1, back to back" 2
    [ -f .vs/p03/join.sh ] || fail ".vs/p03 is not here: this call carries it" 2
    t0=$SECONDS
    bash .vs/p03/join.sh --verify > "$o/install.log" 2>&1 || fail "join.sh --verify: $(tail -n 1 "$o/install.log")"
    stash=${VS_STASH:-/tmp/vstage}
    # the stage's one install step (CI's import-chain stage runs the same script on the same wheels)
    PYTHON=python3 bash bench/vllm_stage/install.sh "$stash/wheels" "$state/vsite" >> "$o/install.log" 2>&1 ||
      fail "pip install of the vLLM wheels: $(tail -n 1 "$o/install.log")"
    echo "{\"seconds\": $((SECONDS - t0)), \"mib\": $(du -sm "$state/vsite" | cut -f1), \"wheels\": $(ls "$stash"/wheels/*.whl | wc -l)}" > "$state/install.json"
    step "installed: $(cat "$state/install.json")"
  fi
  if [ ! -f "$state/model/stand_in.json" ]; then   # call 1 could not build it in its time
    PYTHONPATH=$(site_path) "$py" -m bench.gpu_vllm_window build "$state/model" $dryflag >> "$o/install.log" 2>&1 ||
      fail "building the checkpoint failed: $(tail -n 1 "$o/install.log")"
    step "the checkpoint built in this call"
  fi
  left=$((limit - SECONDS - 60))   # the run stops at the budget's end; 40 s for its safe stop, 20 for the JSON
  [ "$left" -ge 30 ] || fail "$left s left of call 4's $limit s: not enough for the run"
  step "the run: --budget-s $left"
  pp=$(site_path); [ "$dry" = 1 ] || pp="$state/vsite:$pp"
  PYTHONPATH=$pp timeout -k 10 $((left + 50)) "$py" -m bench.gpu_vllm_window run --out "$o/window.json" \
    --model-dir "$state/model" --budget-s "$left" --run-dir "$state/run" --events "$o/events.jsonl" \
    --calls-log "$state/steps.txt" --install "$state/install.json" $dryflag $eager > "$o/run.log" 2>&1
  rc=$?
  grep -E '^(window:|  )' "$o/run.log" | tail -n 8 | tee -a "$state/steps.txt"
  step "ends: run exit $rc, $( [ -s "$o/window.json" ] && echo "window.json written" || echo "no window.json")"
  cp "$state/steps.txt" "$o/steps.txt"
  return $rc
}

run_call() {  # call $1 into folder $2
  n=$1 o=$2; mkdir -p "$o"
  case "$n" in
    1) call_1 ;;
    2|3) call_stash ;;
    4) call_4 ;;
  esac
}

if [ "$call" = all ]; then
  : > "$state/steps.txt"
  n=list
  "$py" -m bench.gpu_vllm_window calls > "$out/calls.txt" 2>&1 || { cat "$out/calls.txt" >&2; exit 2; }
  step "the call list holds (calls.txt)"
  status=0
  for c in 1 2 3 4; do
    ( run_call "$c" "$out/call$c" ) || { status=$?; break; }
  done
  exit $status
fi
[ "$call" = 1 ] && : > "$state/steps.txt"
run_call "$call" "$out"
