"""Which install fits the driver (lowvram_grpo/settings/driver_fit.py), decided from what nvidia-smi prints, before
anything is installed: CUDA 13 drivers get requirements.txt, CUDA 12 drivers requirements-cuda12.txt (torch and vLLM
0.31's CUDA 12.9 builds), no driver or one too old for torch 2.13 the CPU set. The fixtures are nvidia-smi's own output
as these drivers print it; `python -m lowvram_grpo.install` runs the decision against a stand-in nvidia-smi on PATH."""
import subprocess
import sys

import pytest

from conftest import REPO
from lowvram_grpo.doctor import read_pins
from lowvram_grpo.settings.driver_fit import (CUDA12_FILE, CUDA13_FILE, MIN_DRIVER, SETS, Driver, build_major,
                                              driver_advice, fit_install, hosted_runtime, parse_nvidia_smi)

HEADER = """{date}
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {version:<22} Driver Version: {version:<14} CUDA Version: {cuda:<9}|
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  {gpu:<36}Off |   00000000:00:04.0 Off |                    0 |
| N/A   37C    P8              9W /   70W |       0MiB /  15360MiB |      0%      Default |
+-----------------------------------------+------------------------+----------------------+
"""
# Recorded headers: Colab's T4 runtimes (535.104.05: CUDA 12.2; 550.54.15: CUDA 12.4), a 570 workstation (CUDA 12.8),
# the H100 lent on 2026-11-26 (580.159.04: CUDA 13.0, ../shared/gpu/README.md), and a machine whose driver is not
# loaded.
SMI = {
    "12.2": HEADER.format(date="Tue Nov 24 10:02:11 2026", version="535.104.05", cuda="12.2", gpu="Tesla T4"),
    "12.4": HEADER.format(date="Wed Nov 25 08:41:50 2026", version="550.54.15", cuda="12.4", gpu="Tesla T4"),
    "12.8": HEADER.format(date="Wed Nov 25 19:13:07 2026", version="570.172.08", cuda="12.8",
                          gpu="NVIDIA GeForce RTX 3090"),
    "13.0": HEADER.format(date="Thu Nov 26 14:20:33 2026", version="580.159.04", cuda="13.0",
                          gpu="NVIDIA H100 80GB HBM3"),
    "none": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
            "NVIDIA driver is installed and running.\n",
    "11.4": HEADER.format(date="Mon Nov 23 09:00:00 2026", version="470.256.02", cuda="11.4", gpu="Tesla K80"),
}

#       header  driver        set          file          pip                                       vLLM
TABLE = [
    ("12.2", "535.104.05", "cuda12", CUDA12_FILE, ("install -q -r requirements-cuda12.txt",), True),
    ("12.4", "550.54.15", "cuda12", CUDA12_FILE, ("install -q -r requirements-cuda12.txt",), True),
    ("12.8", "570.172.08", "cuda12", CUDA12_FILE, ("install -q -r requirements-cuda12.txt",), True),
    ("13.0", "580.159.04", "cuda13", CUDA13_FILE, ("install -q -r requirements.txt",), True),
    ("none", None, "cpu", None, ("install -q torch==2.13.0", "install -q -r requirements-cpu.txt",
                                 "install -q --no-deps -r requirements-cpu-nodeps.txt"), False),
    ("11.4", "470.256.02", "cpu-old-driver", None, ("install -q torch==2.13.0", "install -q -r requirements-cpu.txt",
                                                    "install -q --no-deps -r requirements-cpu-nodeps.txt"), False),
]


@pytest.mark.parametrize("header, driver, name, file, pip, vllm", TABLE, ids=[row[0] for row in TABLE])
def test_the_install_that_fits_each_recorded_driver(header, driver, name, file, pip, vllm):
    read = parse_nvidia_smi(SMI[header])
    assert (read.version, read.cuda) == (driver, header) if driver else read is None
    fit = fit_install(read)
    assert (fit.name, fit.pinned.file if fit.pinned else None, fit.commands, fit.vllm) == (name, file, pip, vllm)
    assert all((REPO / word).is_file() for command in pip for word in command.split()
               if word.startswith("requirements"))
    assert "\n" not in fit.line and (driver or "no NVIDIA driver") in fit.line
    if fit.gpu:  # the set's torch runs on this driver: same CUDA major, driver at least that major's minimum
        assert fit.pinned.torch_cuda == read.cuda_major or fit.pinned.torch_cuda < read.cuda_major
        assert tuple(map(int, driver.split("."))) >= tuple(map(int, MIN_DRIVER[fit.pinned.torch_cuda].split(".")))
        assert fit.settings == () and "vLLM generates" in fit.line


def test_a_set_without_vllm_says_so_in_one_line_and_turns_fast_inference_off(monkeypatch):
    """Where no vLLM build fits the driver the set has none, and a run needs model.fast_inference=false."""
    import lowvram_grpo.settings.driver_fit as driver_fit

    monkeypatch.setitem(driver_fit.SETS, 12, driver_fit.PinnedSet(CUDA12_FILE, "2.13.0+cu129", 12,
                                                                  SETS[12].torch_index, None, None))
    fit = fit_install(parse_nvidia_smi(SMI["12.4"]))
    assert (fit.vllm, fit.settings) == (False, ("model.fast_inference=false",))
    assert "\n" not in fit.line and fit.line.endswith("no vLLM: runs need --set model.fast_inference=false")
    assert "--set model.fast_inference=false" in driver_advice(fit, None)


def test_the_sets_torch_and_vllm_are_the_requirement_files_pins():
    """driver_fit.SETS says which wheels each file installs: a pin bump in a file that SETS does not follow fails."""
    for major, pinned in SETS.items():
        pins = read_pins(REPO / pinned.file)
        assert (pins["torch"], pins["vllm"]) == (pinned.torch, pinned.vllm), pinned.file
        assert build_major(pins["torch"], 13) == pinned.torch_cuda == major
        assert build_major(pins["vllm"], 13) == pinned.vllm_cuda == major
    cuda13, cuda12 = read_pins(REPO / CUDA13_FILE), read_pins(REPO / CUDA12_FILE)
    assert cuda12["torch"].split("+")[0] == cuda13["torch"] and cuda12["vllm"].split("+")[0] == cuda13["vllm"]
    swapped = {"torch", "vllm", "torchvision", "torchaudio"}
    assert ({k: v for k, v in cuda12.items() if k not in swapped}
            == {k: v for k, v in cuda13.items() if k not in swapped})
    assert f"/whl/cu{SETS[12].torch.split('+cu')[1]}" in (REPO / CUDA12_FILE).read_text()
    assert f"v{cuda13['vllm']}/vllm-{SETS[12].vllm}-" in (REPO / CUDA12_FILE).read_text()


def test_a_driver_update_is_never_advised_where_it_cannot_be_done():
    """On Colab and Kaggle the driver is the host's: the install that fits it, no update; elsewhere both ways."""
    fit = fit_install(parse_nvidia_smi(SMI["12.4"]))
    for runtime in ("Colab", "Kaggle"):
        advice = driver_advice(fit, runtime)
        assert "pip install -r requirements-cuda12.txt" in advice and "update the NVIDIA driver" not in advice
        assert f"a {runtime} runtime's NVIDIA driver is the host's and cannot be updated" in advice
    both = driver_advice(fit, None)
    assert "pip install -r requirements-cuda12.txt" in both and "update the NVIDIA driver to >= 580.65.06" in both
    old = fit_install(parse_nvidia_smi(SMI["11.4"]))
    assert "update" not in driver_advice(old, "Colab").replace("cannot be updated", "")
    assert hosted_runtime({"COLAB_RELEASE_TAG": "release-colab_20261120-060000"}, lambda name: None) == "Colab"
    assert hosted_runtime({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, lambda name: None) == "Kaggle"
    assert hosted_runtime({}, lambda name: object() if name == "google.colab" else None) == "Colab"
    assert hosted_runtime({}, lambda name: None) is None


def test_wheel_versions_name_their_cuda():
    assert [build_major(v, 13) for v in ("2.13.0", "2.13.0+cu129", "2.13.0+cu126", "2.13.0+cu130", "2.13.0+cpu",
                                         None)] \
        == [13, 12, 12, 13, None, None]
    assert Driver("580.159.04", "13.0").cuda_major == 13 and Driver(None, None).cuda_major is None


@pytest.mark.parametrize("header", ["12.4", "13.0", "none"])
def test_the_install_command_reads_nvidia_smi_and_names_the_set(header, tmp_path):
    """`python -m lowvram_grpo.install --dry-run` (the README's GPU install) with a stand-in nvidia-smi on PATH."""
    import os

    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\ncat <<'EOF'\n{SMI[header]}EOF\n"
                                      + ("exit 9\n" if header == "none" else ""))
    (tools / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "lowvram_grpo.install", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fit = fit_install(parse_nvidia_smi(SMI[header]))
    assert proc.stdout.splitlines() == [fit.line] + [f"pip {c}" for c in fit.commands]


def test_the_install_command_refuses_a_bad_option_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "lowvram_grpo.install", "--cuda", "12"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: unrecognized arguments: --cuda 12 (see --help)"]


def test_the_doctor_checks_the_cuda12_sets_pins_where_its_torch_is_installed(monkeypatch):
    """Where the installed torch is a CUDA 12 build (+cu129: this CPU machine cannot hold one, so its installed version
    is given), the doctor compares against requirements-cuda12.txt, and its fix installs that file."""
    from lowvram_grpo.settings import installed

    real = installed.installed_version
    monkeypatch.setattr(installed, "installed_version", lambda name: "2.13.0+cu129" if name == "torch" else real(name))
    chosen = installed.choose_set(gpu_present=True)
    assert (chosen.files == (CUDA12_FILE,) and chosen.pins["torch"] == "2.13.0+cu129"
            and chosen.pins["vllm"] == SETS[12].vllm)
    assert chosen.install_hint().startswith("pip install -q -r requirements-cuda12.txt")
    monkeypatch.setattr(installed, "installed_version", lambda name: "2.13.0" if name == "torch" else real(name))
    assert installed.choose_set(gpu_present=True).files == (CUDA13_FILE,)


# Issue 65, defect 4: the install decided by the driver AND GPU 0's compute capability
# (nvidia-smi --query-gpu=compute_cap).
#       header  compute cap  set              file            vLLM
CARDS = [
    ("12.4", (6, 0), "cuda126", "requirements-cuda126.txt", False),  # Kaggle's P100 (driver 550, CUDA 12.4)
    ("12.4", (7, 0), "cuda126", "requirements-cuda126.txt", False),  # a V100 on a CUDA 12 driver
    ("13.0", (7, 0), "cuda126", "requirements-cuda126.txt", False),  # a V100 on a CUDA 13 driver: no newer set has sm70
    ("12.4", (7, 5), "cuda12", CUDA12_FILE, True),                   # Colab's T4
    ("12.8", (8, 6), "cuda12", CUDA12_FILE, True),
    ("13.0", (9, 0), "cuda13", CUDA13_FILE, True),
    ("13.0", (12, 0), "cuda13", CUDA13_FILE, True),                  # Blackwell: sm_120 in the CUDA 13 build
    ("13.0", (3, 7), "cpu-no-kernels", None, False),                 # a K80: no torch 2.13 build has its kernels
    ("12.4", None, "cuda12", CUDA12_FILE, True),                     # the card not known: by the driver, as before
]


@pytest.mark.parametrize("header, cc, name, file, vllm", CARDS, ids=[f"{c[0]}-{c[1]}" for c in CARDS])
def test_the_install_has_kernels_for_the_card(header, cc, name, file, vllm):
    """The set is one whose torch has kernels for GPU 0 (driver_fit.TORCH_ARCHS, PyTorch's published matrix); a P100 or
    V100 gets torch 2.13's CUDA 12.6 build without vLLM, on any CUDA 12/13 driver; a card none has, one line saying so.
    Before issue 65 a CUDA 12 driver got requirements-cuda12.txt whatever its card (cu129 has no sm60/sm70)."""
    from lowvram_grpo.settings.driver_fit import LEGACY, TORCH_ARCHS, torch_has_kernels

    read = parse_nvidia_smi(SMI[header])
    fit = fit_install(Driver(read.version, read.cuda, cc))
    assert (fit.name, fit.pinned.file if fit.pinned else None, fit.vllm) == (name, file, vllm)
    assert "\n" not in fit.line and (REPO / (file or CUDA13_FILE)).is_file()
    if cc is not None and fit.gpu:
        assert torch_has_kernels(cc, TORCH_ARCHS[fit.pinned.torch]) and f"kernels for sm{cc[0]}{cc[1]}" in fit.line
    if fit.pinned is LEGACY:
        assert fit.settings == ("model.fast_inference=false",) and "no vLLM" in fit.line
        assert ("--backend hf" in fit.line) is (cc < (7, 0))  # torch's inductor compiles no Triton kernel below sm70
        advice = driver_advice(fit, "Kaggle")
        assert advice.startswith("pip install -r requirements-cuda126.txt") and "update" not in advice
    if name == "cpu-no-kernels":
        assert fit.line.endswith("the CPU set, runs on the CPU") and "sm37" in fit.line
        assert "sm37" in driver_advice(fit, None) and "smollm2_cpu" in driver_advice(fit, None)


def test_the_pinned_torch_builds_kernels_are_their_published_arch_lists():
    """What each pinned torch carries, Linux x86_64 (PyTorch RELEASE.md's matrix for 2.12-2.14): the CUDA 13.0 build
    from sm75 with Blackwell's PTX, the CUDA 12.9 build from sm75, the CUDA 12.6 build sm50 to sm90 only."""
    from lowvram_grpo.settings.driver_fit import LEGACY, TORCH_ARCHS, torch_has_kernels

    def cards(torch):
        return [cc for cc in [(5, 0), (6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
                if torch_has_kernels(cc, TORCH_ARCHS[torch])]

    assert cards(SETS[13].torch) == cards(SETS[12].torch) == [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
    assert cards(LEGACY.torch) == [(5, 0), (6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]
    assert set(TORCH_ARCHS) == {SETS[13].torch, SETS[12].torch, LEGACY.torch}


def test_the_cuda126_set_is_requirements_txt_without_vllm_and_with_its_torch():
    """requirements-cuda126.txt: requirements.txt's pins, vllm and vllm-bnb-plugin left out, torch and torchvision the
    CUDA 12.6 builds from PyTorch's cu126 index; a pin bump in requirements.txt it does not follow fails here."""
    from lowvram_grpo.settings.driver_fit import LEGACY

    legacy, cuda13 = read_pins(REPO / LEGACY.file), read_pins(REPO / CUDA13_FILE)
    assert legacy["torch"] == LEGACY.torch and legacy["torch"].split("+")[0] == cuda13["torch"]
    assert build_major(legacy["torch"], 13) == LEGACY.torch_cuda == 12 and LEGACY.vllm is None
    assert legacy.pop("torchvision").endswith("+cu126")
    assert legacy == {k: v for k, v in cuda13.items() if k not in ("vllm", "vllm-bnb-plugin")} | {"torch": LEGACY.torch}
    assert f"--extra-index-url {LEGACY.torch_index}" in (REPO / LEGACY.file).read_text()


def test_the_doctor_names_the_set_with_kernels_for_the_card():
    """A V100 under the CUDA 13 set: the doctor's block gives requirements-cuda126.txt (torch 2.13's one build with
    sm70 kernels) and the setting it needs; it no longer says CUDA 12.x builds carry sm70 (cu129 does not)."""
    from lowvram_grpo.settings.cuda_facts import Card, CudaFacts, cuda_lines

    v100 = Card(0, "Tesla V100-SXM2-16GB", (7, 0), int(15.8 * 2 ** 30), int(15.4 * 2 ** 30))
    cu130 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
    for driver, cuda in (("580.82.07", "13.0"), ("550.54.15", "12.4")):
        facts = CudaFacts("2.13.0+cu130", "13.0", cu130, driver, cuda, (v100.name,), (v100,))
        lines = cuda_lines(facts, uses_vllm=False)
        (kernels,) = [line for line in lines if line.status == "BLOCK" and "none runs on sm70" in line.text]
        assert kernels.fix == ("pip install -r requirements-cuda126.txt (torch 2.13.0+cu126 has kernels for sm70), "
                               "then run with --set model.fast_inference=false")
        assert any("requirements-cuda126.txt is the set for this driver" in line.text for line in lines)
    k80 = Card(0, "Tesla K80", (3, 7), 12 * 2 ** 30, 11 * 2 ** 30)
    facts = CudaFacts("2.13.0+cu130", "13.0", cu130, "580.82.07", "13.0", (k80.name,), (k80,))
    lines = cuda_lines(facts, uses_vllm=False)
    (kernels,) = [line for line in lines if line.status == "BLOCK" and "none runs on sm37" in line.text]
    assert kernels.fix.startswith("no torch 2.13 build runs on this card (sm37)")


def test_the_doctor_compares_a_cu126_torch_with_its_own_file(monkeypatch):
    from lowvram_grpo.settings import installed
    from lowvram_grpo.settings.driver_fit import LEGACY

    real = installed.installed_version
    monkeypatch.setattr(installed, "installed_version", lambda name: "2.13.0+cu126" if name == "torch" else real(name))
    chosen = installed.choose_set(gpu_present=True)
    assert chosen.files == (LEGACY.file,) and chosen.pins["torch"] == LEGACY.torch and "vllm" not in chosen.pins


@pytest.mark.parametrize("answer, cc", [("7.0\n", (7, 0)), ("8.6\n8.6\n", (8, 6)), ("", None),
                                        ("Field \"compute_cap\" is not a valid field to query.\n", None)])
def test_the_install_command_reads_the_cards_compute_capability(answer, cc, tmp_path):
    """`python -m lowvram_grpo.install --dry-run` asks nvidia-smi for GPU 0's compute capability; a driver that cannot
    answer (an old one) leaves the decision to the driver."""
    import os

    tools = tmp_path / "bin"
    tools.mkdir()
    query = ('if [ "$1" = "--query-gpu=compute_cap" ]; then\n'
             + (f"printf '{answer.replace(chr(10), chr(92) + 'n')}'\nexit {0 if cc else 6}\n")
             + "fi\n")
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\n{query}cat <<'EOF'\n{SMI['12.4']}EOF\n")
    (tools / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "lowvram_grpo.install", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    read = parse_nvidia_smi(SMI["12.4"])
    fit = fit_install(Driver(read.version, read.cuda, cc))
    assert proc.stdout.splitlines() == [fit.line] + [f"pip {c}" for c in fit.commands]
    assert fit.name == ("cuda126" if cc == (7, 0) else "cuda12")
