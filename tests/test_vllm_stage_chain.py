"""The vLLM 0.26 stage's import chain, executed (issue 66): run by CI's import-chain stage in its own venv.

bench/vllm_stage/ci_import_chain.sh builds a Python 3.12 venv standing in for the lent card's image
(bench/vllm_stage/image-packages.txt: torch 2.11.0 as PyPI builds it for CUDA 13.0, transformers 5.17.0 and the
image's packages the card had), `.gpu/site` as bench/prepare_gpu_site.sh builds it, and the stage's wheels fetched,
slimmed, split, rejoined and verified by join.sh and installed by install.sh as call 4 installs them; then runs this
file there with LOWVRAM_VLLM_STAGE_SITE (the installed stage), LOWVRAM_VLLM_GPU_SITE (.gpu/site),
LOWVRAM_VLLM_STAGE_WHEELS (the verified wheels) and LOWVRAM_VLLM_STUB_DIR (the stand-in libcuda.so.1) set, and
LOWVRAM_GRPO_NO_SKIPS=1. Anywhere else (the CPU suite) every test here skips.

Each group of bench/vllm_stage/import_chain.py runs in its own process with call 4's PYTHONPATH (the stage, then
.gpu/site, then the checkout). A failed import fails its test with the module Python could not find, where the
import was written, and which wheel of the stage should have provided it: a wheel missing from the stage fails by name.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

STAGE = REPO / "bench" / "vllm_stage"
SITE = os.environ.get("LOWVRAM_VLLM_STAGE_SITE")
GPU_SITE = os.environ.get("LOWVRAM_VLLM_GPU_SITE")
WHEELS = os.environ.get("LOWVRAM_VLLM_STAGE_WHEELS")
STUB_DIR = os.environ.get("LOWVRAM_VLLM_STUB_DIR")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (SITE and GPU_SITE and WHEELS and STUB_DIR),
    reason="CI's import-chain stage only (bench/vllm_stage/ci_import_chain.sh sets LOWVRAM_VLLM_STAGE_SITE ...)")]


def pinned() -> dict[str, str]:
    """{wheel file name: its distribution, normalized} from wheels.txt."""
    names = {}
    for line in (STAGE / "wheels.txt").read_text().splitlines():
        if line.strip():
            wheel = line.split()[1]
            names[wheel] = re.sub(r"[-_.]+", "_", wheel.split("-")[0]).lower()
    return names


def owner(module: str) -> str:
    """Which wheel of the stage should provide the top-level `module`, in words."""
    top = module.split(".")[0].lower()
    for wheel, dist in pinned().items():
        if dist == top:
            return f"wheels.txt lists {wheel}, but the installed stage lacks it: the stage is incomplete"
    return (f"no wheel of the stage provides {top!r}: add its wheel to bench/vllm_stage/wheels.txt "
            f"(and TABLE.md), or to image-packages.txt if the card's image has it")


def run_group(group: str, site: str | None = None, stub: bool = False, timeout: int = 600) -> tuple[dict, str]:
    """One group of import_chain.py in its own process, with call 4's PYTHONPATH. Returns (its report, output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site or SITE, GPU_SITE, str(REPO)]), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("LD_LIBRARY_PATH", None)
    if stub:
        env["LD_LIBRARY_PATH"] = STUB_DIR
    proc = subprocess.run([sys.executable, str(STAGE / "import_chain.py"), group], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.environ.get("LOWVRAM_VLLM_STAGE_CWD", str(REPO)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CHAIN ")]
    assert lines, f"import_chain.py {group}: no CHAIN line (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("CHAIN "):]), proc.stderr


def assert_chain(report: dict) -> None:
    failed = report["failed"]
    if failed is None:
        return
    where = f" (at {failed['raised_at']})" if failed["raised_at"] else ""
    named = f"; {owner(failed['missing'])}" if failed["missing"] else ""
    if "unsloth/import_fixes.py" in (failed["raised_at"] or ""):  # unsloth's disable_broken_vllm hides the cause
        named = "; unsloth blocked vLLM after vLLM's own import failed: test_vllm_imports_from_the_stage names why"
    done = ", ".join(step["import"] for step in report["imported"]) or "nothing"
    pytest.fail(f"call 4's import chain stops at `{failed['import']}`: {failed['error']}{where}{named} "
                f"(imported before it: {done})", pytrace=False)


def test_the_stage_is_installed_as_call_4_installs_it():
    """The venv stands in for the image (Python 3.12, torch 2.11.0 of PyPI's CUDA 13.0 build, transformers 5.17.0)
    and the installed stage holds exactly wheels.txt's distributions at their versions, nothing resolved beside them."""
    import torch
    import transformers

    assert sys.version_info[:2] == (3, 12)
    assert torch.__version__.split("+")[0] == "2.11.0" and torch.version.cuda and torch.version.cuda.startswith("13.")
    assert transformers.__version__ == "5.17.0"
    installed = sorted(re.sub(r"[-_.]+", "_", p.name[:-len(".dist-info")]).lower()
                       for p in Path(SITE).glob("*.dist-info"))
    wanted = sorted(re.sub(r"[-_.]+", "_", "-".join(w.split("-")[:2])).lower() for w in pinned())
    assert installed == wanted
    assert sorted(p.name for p in Path(WHEELS).glob("*.whl")) == sorted(pinned())


def test_vllm_imports_from_the_stage():
    report, _ = run_group("vllm")
    assert_chain(report)
    assert report["facts"]["vllm"] == "0.26.0"
    assert report["facts"]["vllm_file"].startswith(SITE)


def test_trl_grpo_trainer_imports_with_the_staged_vllm():
    report, _ = run_group("trl")
    assert_chain(report)
    assert report["facts"]["trl_sees_vllm"] is True


def test_unsloth_patches_trl_and_unsloth_zoo_vllm_utils_imports():
    """Behind the stand-in driver: unsloth's import force-loads vLLM's compiled extensions and, where they fail (no
    libcuda.so.1 on a CPU), blocks vLLM for the process (seen here without it: vllm.entrypoints.llm then stops in
    unsloth/import_fixes.py with "No module named 'vllm'"). On the card the driver is there."""
    report, _ = run_group("unsloth", stub=True)
    assert_chain(report)
    assert report["facts"]["patch_problem"] is None
    assert report["facts"]["grpo_trainer"] == "UnslothGRPOTrainer" and report["facts"]["trl_sees_vllm"] is True


def test_the_engine_start_modules_import_behind_the_stand_in_driver():
    report, _ = run_group("engine", stub=True)
    assert_chain(report)
    assert report["facts"]["capability"] == "9.0"
    assert len(report["imported"]) == 4 + 11  # the extensions, the platform, the modules (import_chain.py)


def test_without_the_stand_in_driver_vllms_extensions_do_not_load():
    """The control: here is no NVIDIA driver, so the engine group passes only because of the stand-in libcuda.so.1."""
    report, _ = run_group("engine", stub=False)
    assert report["failed"] is not None and report["failed"]["import"] == "vllm._C_stable_libtorch"
    assert "libcuda.so.1" in report["failed"]["error"]


def test_a_wheel_missing_from_the_stage_fails_by_name(tmp_path):
    """The stage without llguidance (as the H100's of 2026-11-27 was), installed by the same install.sh: the vllm
    group stops at vllm.v1.engine.core, naming llguidance and the class-body annotation that reaches it."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for wheel in Path(WHEELS).glob("*.whl"):
        if not wheel.name.startswith("llguidance-"):
            os.symlink(wheel, wheels / wheel.name)
    site = tmp_path / "vsite"
    subprocess.run(["bash", str(STAGE / "install.sh"), str(wheels), str(site)], check=True, timeout=300,
                   env=dict(os.environ, PYTHON=sys.executable))
    report, _ = run_group("vllm", site=str(site))
    failed = report["failed"]
    assert failed is not None and failed["import"] == "vllm.v1.engine.core", report
    assert failed["missing"] == "llguidance" and "No module named 'llguidance'" in failed["error"]
    assert failed["raised_at"].endswith("vllm/v1/structured_output/backend_guidance.py:144"), failed
    assert "lacks it" in owner(failed["missing"])
    shutil.rmtree(site)
