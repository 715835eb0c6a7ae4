"""The vLLM 0.26 stage's own scripts (bench/vllm_stage, issue 66), on small wheels made here: wheels.txt and TABLE.md
agree; slim.py drops exactly what it names (with its RECORD lines) and copies the rest; split.sh + join.sh carry the
wheels in parts and give back each one byte for byte, refusing a damaged part; install.sh installs with nothing
resolved. The real stage's import chain runs in CI's own stage (tests/test_vllm_stage_chain.py)."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

STAGE = REPO / "bench" / "vllm_stage"
MIB = 2 ** 20


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def test_wheels_txt_pins_each_needed_package_of_the_table_once():
    lines = [line.split() for line in (STAGE / "wheels.txt").read_text().splitlines() if line.strip()]
    assert all(len(sha) == 64 and re.fullmatch(r"[0-9a-f]+", sha) and name.endswith(".whl") for sha, name in lines)
    dists = {_norm(name.split("-")[0]): name.split("-")[1] for _, name in lines}
    assert len(dists) == len(lines) == 27
    table = (STAGE / "TABLE.md").read_text()
    rows = re.findall(r"^\| ([\w.-]+) \| ([\w.]+) \| [\d.]+ \| yes\*? \|", table, re.M)
    needed = {_norm(name): version for name, version in rows}
    assert needed == dists  # each wheel has its row (and the why), each needed row its wheel, at the same version


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    """A wheel-shaped zip holding `files` and a RECORD listing them."""
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items())
    with zipfile.ZipFile(path, "w") as out:
        for name, data in files.items():
            out.writestr(name, data)
        out.writestr("pkg-1.0.dist-info/RECORD", record + "pkg-1.0.dist-info/RECORD,,\n")
    return path


def test_slim_drops_what_it_names_and_its_record_lines(tmp_path):
    sys.path.insert(0, str(STAGE))
    try:
        import slim
    finally:
        sys.path.remove(str(STAGE))
    src = _wheel(tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", {
        "vllm/__init__.py": b"x = 1\n",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
        "vllm/third_party/fmha_sm100/kernel.py": b"k",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"311",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"312",
        "bitsandbytes/libbitsandbytes_cuda126.so": b"126",
        "bitsandbytes/libbitsandbytes_cuda130.so": b"130",
        "bitsandbytes/libbitsandbytes_cpu.so": b"cpu"})
    dst = tmp_path / "slim.whl"
    assert slim.slim_wheel(src, dst) == 4
    with zipfile.ZipFile(dst) as kept:
        names = set(kept.namelist())
        record = kept.read("pkg-1.0.dist-info/RECORD").decode()
    assert names == {"vllm/__init__.py", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
                     "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
                     "bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cpu.so",
                     "pkg-1.0.dist-info/RECORD"}
    assert {line.split(",")[0] for line in record.splitlines()} == names  # the dropped files' lines went with them


def test_slim_refuses_a_stage_that_is_not_there(tmp_path):
    proc = subprocess.run([sys.executable, str(STAGE / "slim.py"), str(tmp_path / "none"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "fetch_wheels.sh" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow  # starts processes
def test_split_and_join_give_back_every_wheel_and_refuse_a_damaged_part(tmp_path):
    """Three wheels (one of 5 MiB, cut into 1 MiB chunks) in 2 MiB folders; join.sh --stash on every folder but the
    last, --verify on the last, as the window's calls do: each wheel back with its sha256. A part with one byte
    changed is refused by name."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    sizes = {"big-1.0-py3-none-any.whl": 5 * MIB, "mid-1.0-py3-none-any.whl": MIB // 2,
             "small-1.0-py3-none-any.whl": 1000}
    for name, size in sizes.items():
        (wheels / name).write_bytes(os.urandom(size))
    sums = {name: _sha(wheels / name) for name in sizes}
    out = tmp_path / "vs"
    env = dict(os.environ, LIMIT_MIB="2", REPO=str(REPO))
    proc = subprocess.run(["bash", str(STAGE / "split.sh"), "-o", str(out), str(wheels)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = sorted(out.glob("p[0-9][0-9]"))
    assert len(parts) >= 4 and all(sum(f.stat().st_size for f in p.iterdir()) <= 2 * MIB for p in parts)
    stash = tmp_path / "stash"
    env = dict(os.environ, VS_STASH=str(stash))
    for part in parts[:-1]:
        proc = subprocess.run(["bash", str(part / "join.sh"), "--stash"], capture_output=True, text=True, env=env,
                              timeout=60)
        assert proc.returncode == 0, proc.stdout
    proc = subprocess.run(["bash", str(parts[-1] / "join.sh"), "--verify"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0 and f"all {len(sizes)} wheels verified" in proc.stdout, proc.stdout
    assert {name: _sha(stash / "wheels" / name) for name in sizes} == sums

    proc = subprocess.run(["bash", str(STAGE / "split.sh"), "-o", str(out), str(wheels)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, LIMIT_MIB="2"))
    chunk = sorted(out.glob("p*/big-1.0-py3-none-any.whl.part*"))[1]
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1
    chunk.write_bytes(bytes(data))
    proc = subprocess.run(["bash", str(sorted(out.glob("p[0-9][0-9]"))[-1] / "join.sh"), "--verify"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, VS_STASH=str(tmp_path / "s2")))
    assert proc.returncode == 1 and f"BAD sha256: {chunk.name}" in proc.stdout, proc.stdout


@pytest.mark.slow  # starts processes
def test_install_sh_installs_with_nothing_resolved(tmp_path):
    """A wheel that asks for a distribution no index here has: installed all the same (--no-deps, --no-index)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    meta = "Metadata-Version: 2.1\nName: stagepkg\nVersion: 1.0\nRequires-Dist: no-such-distribution-anywhere>=9\n"
    with zipfile.ZipFile(wheels / "stagepkg-1.0-py3-none-any.whl", "w") as out:
        out.writestr("stagepkg/__init__.py", "VALUE = 42\n")
        out.writestr("stagepkg-1.0.dist-info/METADATA", meta)
        out.writestr("stagepkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        out.writestr("stagepkg-1.0.dist-info/RECORD", "")
    site = tmp_path / "site"
    proc = subprocess.run(["bash", str(STAGE / "install.sh"), str(wheels), str(site)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([sys.executable, "-c", "import stagepkg; print(stagepkg.VALUE)"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(site)), timeout=60)
    assert out.stdout.strip() == "42"
    proc = subprocess.run(["bash", str(STAGE / "install.sh"), str(tmp_path / "empty"), str(site)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no wheel in")
