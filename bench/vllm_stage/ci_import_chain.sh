#!/usr/bin/env bash
# ci_import_chain.sh WORK - CI's import-chain stage for the vLLM 0.26 stage (issue 66): call 4 of the lent card's
# window, as far as a CPU executes it. Everything is built under WORK (emptied first; ~6.5 GB):
#   1. WORK/venv: Python 3.12 (pyenv's; PYTHON312 overrides) with image-packages.txt (torch 2.11.0 as PyPI builds it
#      for CUDA 13.0, transformers 5.17.0, the image's packages the card had) and pytest: the lent image's stand-in.
#   2. WORK/gpu-site: bench/prepare_gpu_site.sh, as call 1 carries it (.gpu/site).
#   3. The stage as the window carries it: fetch_wheels.sh (into .vllm-wheels/fetched, reused when its sha256 hold),
#      slim.py, split.sh into WORK/vs, join.sh --verify into WORK/vstage, install.sh into WORK/vsite: the install call
#      4 runs (pip --no-index --no-deps --no-compile --target).
#   4. WORK/stub/libcuda.so.1 from tests/virtual_card/stub_libcuda.c (a driver whose every entry fails).
#   5. tests/test_vllm_stage_chain.py in WORK/venv, no skip allowed (LOWVRAM_GRPO_NO_SKIPS=1): the imports call 4
#      makes before its first CUDA call and vLLM's engine-start modules; a wheel missing from the stage fails by name.
# Prints each step's seconds and WORK's size at the end; exit 0 only if every step and test passed.
set -euo pipefail
[ $# -eq 1 ] || { echo "error: usage: bash bench/vllm_stage/ci_import_chain.sh WORK" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
work=$1
case "$work" in
  /|"$HOME"|"$root"|"$root"/*) echo "error: WORK must be a folder of its own, not $work" >&2; exit 2 ;;
esac
py312=${PYTHON312:-$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python 2>/dev/null | sort -V | tail -n 1)}
[ -x "$py312" ] || { echo "error: no Python 3.12 (pyenv's versions/3.12.*, or PYTHON312)" >&2; exit 2; }
stub_c=tests/virtual_card/stub_libcuda.c
[ -f "$stub_c" ] || { echo "error: $stub_c is not in this checkout" >&2; exit 2; }
# CHAIN_KEEP_VENV=1: a venv WORK already holds is kept (pip then installs only what it lacks); the rest is rebuilt
if [ "${CHAIN_KEEP_VENV:-0}" = 1 ] && [ -x "$work/venv/bin/python" ]; then
  find "$work" -mindepth 1 -maxdepth 1 ! -name venv -exec rm -rf {} +
else
  rm -rf "$work" && mkdir -p "$work" && "$py312" -m venv "$work/venv"
fi
work=$(cd "$work" && pwd)
t=$SECONDS
took() { echo "ci-chain: $1: $((SECONDS - t)) s (at $(date -u +%T) UTC)"; t=$SECONDS; }

"$work/venv/bin/pip" install -q --no-compile -r bench/vllm_stage/image-packages.txt \
  pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 > "$work/pip.log" 2>&1 ||
  { grep -v "is ignored: it is neither" "$work/pip.log" | tail -n 20 >&2
    echo "error: the image's stand-in did not install (image-packages.txt)" >&2; exit 1; }
took "the image's stand-in ($("$work/venv/bin/python" -V), torch $("$work/venv/bin/python" -c \
'import torch; print(torch.__version__, "cuda", torch.version.cuda)'))"
bash bench/prepare_gpu_site.sh "$work/gpu-site" > /dev/null
took ".gpu/site ($(du -sm "$work/gpu-site" | cut -f1) MiB)"
bash bench/vllm_stage/fetch_wheels.sh
python3 bench/vllm_stage/slim.py .vllm-wheels/fetched "$work/slim" | tail -n 1
bash bench/vllm_stage/split.sh -o "$work/vs" "$work/slim" > /dev/null
last=$(ls -d "$work"/vs/p[0-9][0-9] | tail -n 1)
VS_STASH="$work/vstage" bash "$last/join.sh" --verify | tail -n 1
PYTHON="$work/venv/bin/python" bash bench/vllm_stage/install.sh "$work/vstage/wheels" "$work/vsite"
took "the stage: fetched, slimmed, split ($(ls -d "$work"/vs/p[0-9][0-9] | wc -l) parts), joined, installed \
($(du -sm "$work/vsite" | cut -f1) MiB)"
mkdir -p "$work/stub" "$work/cwd"
gcc -shared -fPIC -o "$work/stub/libcuda.so.1" "$stub_c"
ln -sf libcuda.so.1 "$work/stub/libcuda.so"
status=0
# LOWVRAM_CHAIN_LOCK: a lock file to hold while the tests run (a shared machine's CPU lock); CI sets none
lock=(); [ -z "${LOWVRAM_CHAIN_LOCK:-}" ] || lock=(flock "$LOWVRAM_CHAIN_LOCK")
LOWVRAM_VLLM_STAGE_SITE="$work/vsite" LOWVRAM_VLLM_GPU_SITE="$work/gpu-site" LOWVRAM_VLLM_STUB_DIR="$work/stub" \
  LOWVRAM_VLLM_STAGE_WHEELS="$work/vstage/wheels" LOWVRAM_VLLM_STAGE_CWD="$work/cwd" LOWVRAM_GRPO_NO_SKIPS=1 \
  "${lock[@]}" "$work/venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/test_vllm_stage_chain.py || status=$?
took "the import chain (tests/test_vllm_stage_chain.py, exit $status)"
echo "ci-chain: $work holds $(du -sm "$work" | cut -f1) MiB;" \
  "the fetched wheels $(du -sm .vllm-wheels/fetched | cut -f1) MiB"
exit $status
