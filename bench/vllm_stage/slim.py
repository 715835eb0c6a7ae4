"""Slim the stage's wheels for the lent card: what a Hopper card with torch 2.11.0+cu130 never loads is left out.

    python bench/vllm_stage/slim.py [SRC [DST]]     # default: .vllm-wheels/fetched -> .vllm-wheels/slim

Every wheel of wheels.txt must be in SRC with its pinned sha256 (fetch_wheels.sh puts them there). vllm-*.whl is
written again without vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention 2; Hopper runs FA3), the vllm-rs Rust
HTTP frontend, deep_gemm's builds for other Pythons and third_party/fmha_sm100/ (Blackwell's sparse attention, imported
only inside MiniMax-M3 functions): 290 -> ~145 MiB; bitsandbytes-*.whl without its CUDA 11/12, CUDA 13.2, ROCm and XPU
libraries (it keeps cpu and cuda130, the image's torch): 41 -> ~3 MiB. The dropped files leave the wheel's RECORD too,
so pip installs the rest as usual. Every other wheel is copied as it is. DST is emptied first (its wheels only).
Prints one line per slimmed wheel and the total; a missing or changed wheel: one `error:` line, exit 2.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MIB = 2 ** 20
DROP = re.compile(r"^(vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so"             # FA2; Hopper runs FA3
                  r"|vllm/vllm-rs"                                              # Rust HTTP frontend binary
                  r"|vllm/third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-.*\.so"  # other Pythons
                  r"|vllm/third_party/fmha_sm100/.*"                            # Blackwell FMHA (MiniMax-M3, lazy)
                  r"|bitsandbytes/libbitsandbytes_(cuda1[12]\d|cuda132|rocm\d+|xpu\d+)\.so)$")  # cpu, cuda130 kept
SLIMMED = ("vllm-", "bitsandbytes-")


def pinned(listing: Path = HERE / "wheels.txt") -> dict[str, str]:
    """{wheel file name: sha256} from wheels.txt (sha256sum lines)."""
    pins = {}
    for line in listing.read_text().splitlines():
        if line.strip():
            sha, name = line.split()
            pins[name] = sha
    return pins


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def slim_wheel(src: Path, dst: Path) -> int:
    """Write `src` to `dst` without the files DROP matches, their RECORD lines with them. Returns files dropped."""
    dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if DROP.match(item.filename):
                dropped += 1
                continue
            data = zin.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(True)
                data = "".join(line for line in lines if not DROP.match(line.split(",", 1)[0])).encode()
            zout.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
    return dropped


def main(argv: list[str]) -> int:
    if len(argv) > 2:
        print("error: usage: slim.py [SRC [DST]]", file=sys.stderr)
        return 2
    src = Path(argv[0]) if argv else ROOT / ".vllm-wheels" / "fetched"
    dst = Path(argv[1]) if len(argv) > 1 else ROOT / ".vllm-wheels" / "slim"
    pins = pinned()
    for name, sha in pins.items():
        if not (src / name).is_file():
            print(f"error: {name} is not in {src}: run bench/vllm_stage/fetch_wheels.sh first", file=sys.stderr)
            return 2
        if sha256(src / name) != sha:
            print(f"error: {src / name}: sha256 differs from wheels.txt: fetch it again", file=sys.stderr)
            return 2
    if src.resolve() == dst.resolve():
        print("error: SRC and DST are the same folder", file=sys.stderr)
        return 2
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("*.whl"):
        old.unlink()
    total = 0
    for name in sorted(pins):
        if name.startswith(SLIMMED):
            dropped = slim_wheel(src / name, dst / name)
            print(f"slim: {name}: {dropped} files dropped, {(src / name).stat().st_size / MIB:.1f} -> "
                  f"{(dst / name).stat().st_size / MIB:.1f} MiB")
        else:
            shutil.copyfile(src / name, dst / name)
        total += (dst / name).stat().st_size
    print(f"slim: {len(pins)} wheels in {dst}, {total / MIB:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
