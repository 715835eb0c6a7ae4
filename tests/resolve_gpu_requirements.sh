#!/usr/bin/env bash
# Prove that requirements.txt (the GPU/CUDA install set) resolves with pip's
# resolver, without installing anything and without downloading the
# multi-GB CUDA wheels (torch, vllm, nvidia-*).
#
# How: pip >= 24 with --use-feature=fast-deps reads each wheel's METADATA
# through HTTP range requests, and with --dry-run it never fetches the full
# wheels. (pip 23.x resolves the same way but then downloads every wheel in
# full, several GB, so a pinned newer pip is fetched as a ~2 MB wheel and run
# from that wheel; nothing is written to any site-packages.)
# --isolated: only PyPI, ignoring local mirrors/find-links from pip config
# (they can hold e.g. a CPU-only torch). 'trl[vllm]' adds trl's own
# vllm range to the check.
#
# Needs: Linux x86_64, CPython 3.11 (markers and wheel tags are those of the
# host interpreter, which must match the GPU target), and PyPI reachable.
# Usage: tests/resolve_gpu_requirements.sh [requirements-file]
# Typical run: ~35 s wall, ~85 MB downloaded (index pages + ranged
# reads of wheel METADATA; pip 23.2 + fast-deps instead took ~115 s and
# pulled several GB of wheels).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="${1:-$here/../requirements.txt}"
py="${PYTHON:-python3}"
pip_version="26.3"

"$py" - <<'PY'
import platform, sys
ok = (sys.platform == "linux" and platform.machine() == "x86_64"
      and sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11))
if not ok:
    sys.exit(f"resolve_gpu_requirements: needs CPython 3.11 on Linux x86_64, "
             f"got {sys.implementation.name} {platform.python_version()} "
             f"{sys.platform} {platform.machine()}")
PY

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cert_opt=()
if [[ -n "${PIP_CERT:-}" ]]; then cert_opt=(--cert "$PIP_CERT"); fi

"$py" -m pip --isolated "${cert_opt[@]}" download --quiet --no-deps \
    --disable-pip-version-check \
    "pip==$pip_version" -d "$tmp/pip"
pipwhl="$(ls "$tmp"/pip/pip-"$pip_version"-*.whl)"

start=$(date +%s)
"$py" "$pipwhl/pip" --isolated "${cert_opt[@]}" --disable-pip-version-check \
    install --dry-run --ignore-installed --only-binary=:all: \
    --use-feature=fast-deps --no-cache-dir --progress-bar off \
    --report "$tmp/report.json" \
    -r "$req" 'trl[vllm]' >"$tmp/pip.log" 2>&1 || {
        cat "$tmp/pip.log"
        echo "resolve_gpu_requirements: FAILED: $req does not resolve" >&2
        exit 1
    }
elapsed=$(( $(date +%s) - start ))

"$py" - "$tmp/report.json" "$req" "$tmp/pip.log" "$elapsed" <<'PY'
import json, re, sys
report, req, log, elapsed = sys.argv[1:5]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
got = {norm(i["metadata"]["name"]): i["metadata"]["version"]
       for i in json.load(open(report))["install"]}
bad = []
for line in open(req):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==(\S+)", line)
    if not m:
        bad.append(f"not pinned with ==: {line}")
    elif got.get(norm(m.group(1))) != m.group(3):
        bad.append(f"{m.group(1)}: pinned {m.group(3)}, resolved {got.get(norm(m.group(1)))}")
full = [l.strip() for l in open(log) if l.startswith("Downloading")]
print(f"resolved {len(got)} distributions in {elapsed}s "
      f"(full wheel downloads: {len(full)})")
for k in ("vllm", "torch", "torchvision", "transformers", "trl", "unsloth"):
    print(f"  {k}=={got.get(k)}")
if bad:
    sys.exit("resolve_gpu_requirements: FAILED:\n  " + "\n  ".join(bad))
print("resolve_gpu_requirements: OK")
PY
