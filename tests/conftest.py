"""Shared test helpers. Tests run real components (transformers, peft, trl, bitsandbytes, unsloth's CPU
backend; in the GPU install set unsloth's patched UnslothGRPOTrainer; vLLM's CPU build) on the locally built
tiny Llama and SmolLM2. None of those is replaced. What stands in for what, precisely:

- a GPU that is not here: named card profiles (hardware.profile: t4, rtx4090, ...) and cuda_facts.CudaFacts
  describe a card to resolve(), the memory plan and the doctor; a stand-in `nvidia-smi` on PATH
  (test_notebook) or `shutil.which` answering for it (test_gpu_path's install cell) is a driver that
  answers; transformers' `is_torch_bf16_gpu_available` says yes for GRPOConfig's bf16 check (test_gpu_set);
  hardware.BF16_MIN_COMPUTE_CAPABILITY is raised to show the doctor reads the one rule (test_doctor);
- GPU-only failures: tests/inject_failures.py raises CUDA's own out-of-memory error from inside a real
  forward or generate (nothing of the package patched); test_memory raises it inside TRL's real methods;
  tests/sm75_vllm_start.py gives the pinned unsloth_zoo load_vllm and vLLM a T4's readings (torch.cuda, vLLM's
  CUDA platform, an empty `vllm._C_stable_libtorch`, a CUDA toolkit's files) and stands in for unsloth's GPU loader
  and vLLM's engine past the sampler's FlashInfer check (test_gpu_wheels; each injection named there);
- failures of real libraries, injected where they happen: math-verify's parse/verify raising
  (test_answers), another TRL version string or a missing Trainer method (test_trl_compat), a missing wheel
  (find_spec, test_smollm2), a filesystem without renameat2 (lora_io._exchange_paths, test_resume), a package
  index given through pip's own configuration (test_gpu_contracts);
- observers that leave the behaviour as it is: host_memory.release counted (test_host_memory), a model
  load that must not happen on bad input (test_bad_inputs), a call of a phase paused so a signal lands in
  it (test_stops' driver);
- size knobs shrunk so a small run shows the large case: gpu_first_run.SHARD_BYTES, the log-prob
  fallback's HOST_CHUNK_ELEMENTS.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# One torch thread per xdist worker, inherited by every process a test starts. Left alone, each process starts
# a thread per visible core; two workers (and their children) then spin against each other. CI's run of
# e161018's parent showed it: a tiny-model priming at 3.5 s/step and the SmolLM2 fixture of test_eval_protocol
# 8x slower than here, while the tests that already set OMP_NUM_THREADS=1 ran at their usual speed.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
# A stage that must run (.ci/run's vLLM CPU stage): with this set to 1 every skip, a module's
# `pytest.importorskip` at collection included, is reported as a failure, so a missing dependency cannot
# turn the stage into a green run of skips.
NO_SKIPS_ENV = "LOWVRAM_GRPO_NO_SKIPS"


def _no_skips() -> bool:
    return os.environ.get(NO_SKIPS_ENV) == "1"


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


def _fail_skip(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = f"{what} skipped under {NO_SKIPS_ENV}=1 (a stage that must run): {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _no_skips() and report.skipped:
        _fail_skip(report, f"{collector.nodeid or 'collection'}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _no_skips() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report, item.nodeid)


# What runs first, each a work unit of its own, before the modules that stay whole on one worker: the longest units
# of a two-worker run, measured on an AVX2-only EPYC (float32): left where collection puts them, two of them met on
# one worker at the end while the other worker had nothing left to do. Times: a CI run's (549 s, 148 s) or alone
# with one torch thread, as a worker runs them (200 s, 132 s).
FIRST = ("tests/test_eval_protocol.py",  # its module-scoped SmolLM2 run: 549 s, made once (the module stays whole)
         "tests/test_tools.py::test_the_readme_tools_example_trains_smollm2_with_a_users_tool_and_the_calculator",
         "tests/test_package.py::test_pip_install_gives_a_console_script_that_runs_from_any_folder",
         "tests/test_decoding.py::test_greedy_answers_are_token_for_token_those_of_transformers_generate")


def work_unit(nodeid: str) -> tuple[int, str]:
    """(its place in FIRST or len(FIRST), its work unit under -n): a FIRST test alone, every other test with its
    module. A test's parameters stay with it (`...::test[a]` is the unit `...::test[a]` names)."""
    module = nodeid.split("::", 1)[0]
    for place, prefix in enumerate(FIRST):
        if nodeid == prefix or nodeid.split("[", 1)[0] == prefix or (prefix == module and "::" not in prefix):
            return place, prefix
    return len(FIRST), module


def pytest_collection_modifyitems(config, items):
    """FIRST's long tests first, then the rest in collection order (stable)."""
    items.sort(key=lambda item: work_unit(item.nodeid)[0])


def pytest_xdist_make_scheduler(config, log):
    """Under -n: each module one work unit on one worker, so its module-scoped runs and engines are made once, and
    FIRST's long tests units of their own, handed out first, so the two workers end together.

    pytest-xdist's own `--dist loadgroup` no longer groups under pytest 9.2 (it renames `item._nodeid`, which pytest
    9.2's node ids no longer read: pytest-xdist issue #1386); its scope scheduler with our split of the node ids
    does, through xdist's public scheduler hook. tests/test_ci_shape.py runs a two-worker session to see it."""
    from xdist.scheduler import LoadScopeScheduling  # xdist is imported only when -n is given

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # the one method LoadFileScheduling overrides too
            return work_unit(nodeid)[1]

    # in collection order (FIRST's first), not xdist's default of the units with the most tests first, which hands
    # out the one-test FIRST units last
    config.option.loadscopereorder = False
    return ByUnit(config, log)


def default_signals() -> None:
    """A child's `preexec_fn`: SIGINT, SIGTERM and SIGHUP at their defaults, as a terminal or a scheduler starts a
    command. A test that signals its child needs it: under a script's background job (CI launched that way) the
    child would start with SIGINT ignored, which the package keeps ignored, as the shell meant (stops.py)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def requirements_pins() -> dict[str, str]:
    """requirements.txt's pins (the GPU install set): {name: version}."""
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name] = version
    return pins


def installed_version(name: str):
    """The installed distribution's version, or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


GPU_SET_MARKERS = ("vllm", "vllm-bnb-plugin", "unsloth", "unsloth_zoo")


def require_gpu_set() -> dict[str, str]:
    """For a module that runs only in the GPU install set (requirements.txt): its pins when this venv is that set;
    else the module is skipped, or, with LOWVRAM_GRPO_GPU_SET=1 (CI's GPU-set stage), the collection fails."""
    pins = requirements_pins()
    if all(installed_version(n) == pins[n] for n in GPU_SET_MARKERS):
        return pins
    if os.environ.get("LOWVRAM_GRPO_GPU_SET") == "1":
        raise RuntimeError("LOWVRAM_GRPO_GPU_SET=1 but this venv is not requirements.txt's set: "
                           + ", ".join(f"{n} {installed_version(n)} (pinned {pins[n]})" for n in GPU_SET_MARKERS))
    pytest.skip("not the GPU install set (requirements.txt); .ci/run runs this module in a venv of its own",
                allow_module_level=True)


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m lowvram_grpo.run ARGS` in a fresh process, from the repo root."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lowvram_grpo.run", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env,
    )


def load_handle(preset: str, sets=(), hardware=None):
    """The product's model for `preset` with `sets` (resolved on `hardware`, default this machine's), hf backend,
    as a run loads it (decode settings installed)."""
    from lowvram_grpo.model.backends import load_model, prepare_backend  # torch and transformers: only tests that load
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve

    resolved = resolve(load_config(preset, list(sets)), hardware or detect(), "hf")
    prepare_backend(resolved.backend)
    return load_model(resolved, log=lambda *_: None)


def perturb_adapter(model, scale: float, seed: int = 0) -> None:
    """A trained-looking adapter: LoRA's B starts at zero (the adapter changes nothing); give it values drawn at
    `scale`."""
    import torch  # only tests with a model

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from lowvram_grpo.model.builtin_models import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture
def gsm8k_path() -> Path:
    if not SHARED_GSM8K.is_file():
        pytest.skip(f"{SHARED_GSM8K} is absent (the shared GSM8K data is not beside this checkout)")
    return SHARED_GSM8K


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One real `--preset tiny --max-steps 3` CLI run, shared by the tests that read its outputs
    (they only read, except the report rebuild, which rewrites the same files)."""
    out = tmp_path_factory.mktemp("tiny-cli") / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "3", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def assert_same_adapter(expected_dir: Path, got_dir: Path, atol: float = 0.0, what: str = "training") -> None:
    """The adapter in `got_dir` is the one in `expected_dir` (same tensors; bit for bit when atol is 0), and its
    LoRA B weights moved (`what` moved nothing otherwise)."""
    import torch
    from safetensors.torch import load_file

    expected = load_file(str(Path(expected_dir) / "adapter_model.safetensors"))
    got = load_file(str(Path(got_dir) / "adapter_model.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        same = (torch.equal(got[name], expected[name]) if atol == 0
                else torch.allclose(got[name], expected[name], atol=atol, rtol=0))
        assert same, name
    assert any(torch.count_nonzero(v) for k, v in got.items() if "lora_B" in k), f"{what} moved nothing"
