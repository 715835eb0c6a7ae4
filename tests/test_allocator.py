"""allocator.py and memory.host_allocator: the decision per machine (pure), and the real thing — the
CLI restarting itself on the installed mimalloc, its children getting the user's environment, and
`release()` on either allocator. Peak RSS and step time are measured in bench/host_memory.py."""
import ctypes.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.core import allocator
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.core.errors import ResolveError
from lowvram_grpo.settings.hardware import PROFILES, Hardware, no_gpu_without_torch
from lowvram_grpo.settings.resolve import choose_host_allocator, resolve

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

LIBRARY = allocator.mimalloc_library()
needs_mimalloc = pytest.mark.skipif(LIBRARY is None,
                                    reason="cmeel-mimalloc is not installed (requirements-cpu-nodeps.txt)")
FAKE = "/opt/lib/libmimalloc.so"


def _with(hardware: Hardware, library) -> Hardware:
    return Hardware(**{**hardware.__dict__, "mimalloc_library": library})


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_auto_is_mimalloc_on_a_cpu_run_only_and_only_when_installed(name):
    hardware = PROFILES[name]
    assert choose_host_allocator("auto", _with(hardware, FAKE)) == ("system" if hardware.cuda else "mimalloc")
    assert choose_host_allocator("auto", _with(hardware, None)) == "system"
    assert choose_host_allocator("system", _with(hardware, FAKE)) == "system"
    assert choose_host_allocator("mimalloc", _with(hardware, FAKE)) == "mimalloc"


def test_mimalloc_asked_without_the_wheel_is_refused_with_the_fix():
    config = load_config("tiny", ["memory.host_allocator=mimalloc"])
    with pytest.raises(ResolveError) as err:
        resolve(config, _with(PROFILES["cpu"], None))
    assert err.value.exit_code == 2
    assert ("pip install --no-deps cmeel-mimalloc==3.4.3" in str(err.value)
            and "memory.host_allocator=auto" in str(err.value))


def test_the_decision_is_in_the_resolved_settings():
    resolved = resolve(load_config("tiny", []), _with(PROFILES["cpu"], FAKE))
    assert resolved.host_allocator == "mimalloc" and resolved.summary()["host_allocator"] == "mimalloc"
    assert "host allocator mimalloc" in resolved.describe()


def test_the_library_is_found_only_where_ld_preload_exists():
    assert allocator.mimalloc_library("darwin") is None and allocator.mimalloc_library("win32") is None


@needs_mimalloc
def test_the_installed_library_is_a_shared_object():
    with open(LIBRARY, "rb") as fh:
        assert fh.read(4) == b"\x7fELF"


def test_restart_environment_puts_our_library_first_and_keeps_the_users():
    env = allocator.restart_environment(FAKE, {"LD_PRELOAD": "libm.so.6", "HOME": "/h"})
    assert env["LD_PRELOAD"] == f"{FAKE}:libm.so.6" and env[allocator.RESTARTED] == FAKE and env["HOME"] == "/h"
    assert allocator.restart_environment(FAKE, {"LD_PRELOAD": FAKE})["LD_PRELOAD"] == FAKE  # not twice
    # the restarted process never restarts again, even when the preload did not take
    assert allocator.restart_environment(FAKE, {allocator.RESTARTED: FAKE, "LD_PRELOAD": FAKE}) is None


def test_forget_preload_gives_children_the_users_environment(monkeypatch):
    monkeypatch.setattr(allocator, "_started_with", None)
    environ = {"LD_PRELOAD": f"{FAKE}:libm.so.6", allocator.RESTARTED: FAKE}
    assert allocator.forget_preload(environ) == FAKE
    assert environ == {"LD_PRELOAD": "libm.so.6"}
    assert allocator.restart_environment(FAKE, environ) is None, "a restarted process must not restart again"
    monkeypatch.setattr(allocator, "_started_with", None)
    environ = {"LD_PRELOAD": FAKE, allocator.RESTARTED: FAKE}
    allocator.forget_preload(environ)
    assert environ == {}
    assert allocator.forget_preload({"LD_PRELOAD": "libm.so.6"}) is None  # not a restarted process


def test_a_process_not_on_the_resolved_allocator_says_how_to_start_on_it():
    assert allocator.active() == "glibc"  # pytest runs on the system allocator
    note = allocator.mismatch_note("mimalloc", FAKE)
    assert note.startswith("note: ") and f"LD_PRELOAD={FAKE}" in note and "runs on glibc" in note
    assert allocator.mismatch_note("system", FAKE) is None


_RESTART = textwrap.dedent("""
    import json, os, subprocess, sys
    from lowvram_grpo.core import allocator
    library = allocator.forget_preload()
    if library is None:
        allocator.restart_with(allocator.mimalloc_library(), [sys.executable, "-c", sys.argv[1], sys.argv[1]])
        print(json.dumps({"restarted": False}))
    else:
        child = subprocess.run(
            [sys.executable, "-c", "from lowvram_grpo.core import allocator; print(allocator.active())"],
            capture_output=True, text=True, check=True).stdout.strip()
        print(json.dumps({"restarted": True, "active": allocator.active(), "release": allocator.release(),
                          "ld_preload": os.environ.get("LD_PRELOAD"), "child": child}))
""")


@needs_mimalloc
def test_restart_with_runs_the_same_command_on_mimalloc_and_its_children_on_the_users_preload():
    user_preload = ctypes.util.find_library("m")  # a library the user preloads: kept for them
    proc = subprocess.run([sys.executable, "-c", _RESTART, _RESTART], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LD_PRELOAD": user_preload})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"restarted": True, "active": "mimalloc", "release": True, "ld_preload": user_preload,
                   "child": "glibc"}


def test_no_gpu_is_known_without_torch_only_where_torch_could_not_see_one(tmp_path):
    node = tmp_path / "nvidiactl"
    node.touch()
    assert no_gpu_without_torch("2.13.0+cpu", nodes=(str(node),))  # a CPU build of torch sees no card
    assert not no_gpu_without_torch("2.13.0", nodes=(str(node),))  # a CUDA build and a driver's node: ask torch
    assert no_gpu_without_torch("2.13.0+cu126", nodes=(str(tmp_path / "absent"),))  # no driver: no card
    import torch

    assert not (no_gpu_without_torch() and torch.cuda.is_available())  # this machine: never wrong about a card


@needs_mimalloc
@pytest.mark.parametrize("asked, active", [("auto", "mimalloc"), ("system", "glibc")])
def test_the_cli_runs_on_the_allocator_it_resolves_to(tmp_path, tiny_model_dir, asked, active):
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "1", "--set", f"memory.host_allocator={asked}",
                   "--set", "eval.enabled=false", "--output-dir", str(out), timeout=300,
                   env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})  # each process's imports, on stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    imports = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    # auto: the first process decides without torch (no GPU here) and restarts; torch is imported once, after it
    assert (imports.count("site"), imports.count("torch")) == ((2, 1) if asked == "auto" else (1, 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["host_allocator_active"] == active
    assert summary["resolved"]["host_allocator"] == ("mimalloc" if asked == "auto" else "system")
    assert f"host allocator {summary['resolved']['host_allocator']}" in proc.stdout
    assert "note: memory.host_allocator" not in proc.stdout + proc.stderr


@needs_mimalloc
def test_an_error_after_the_restart_is_still_one_line(tmp_path):
    """The missing dataset is found by the restarted process (data is read after the settings): one error line."""
    out = tmp_path / "never"
    proc = run_cli("--preset", "tiny", "--dataset", str(tmp_path / "missing.jsonl"),
                   "--output-dir", str(out), timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert (proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
            and "does not exist" in lines[0]), proc.stderr
    assert not out.exists()
