#!/usr/bin/env bash
# install.sh WHEELS SITE - install the stage's wheels (every *.whl in WHEELS) into SITE, nothing resolved and nothing
# downloaded: `pip install --no-index --no-deps --no-compile --target`. The one install step of the stage: call 4 of
# the window runs it on the card (bench/gpu_vllm_window.sh, WHEELS = join.sh's verified /tmp/vstage/wheels), CI's
# import-chain stage runs it on the same wheels (ci_import_chain.sh). PYTHON (default python3) is the interpreter
# whose pip installs: the image's python3 on the card, the stage's venv in CI. SITE is emptied first.
set -euo pipefail
[ $# -eq 2 ] || { echo "error: usage: install.sh WHEELS SITE" >&2; exit 2; }
wheels=$1 site=$2
ls "$wheels"/*.whl > /dev/null 2>&1 || { echo "error: no wheel in $wheels" >&2; exit 2; }
rm -rf "$site"
"${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  "$wheels"/*.whl
