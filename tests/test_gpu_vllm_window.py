"""The lent card's unsloth + vLLM window (bench/gpu_vllm_window.py, .sh; issue 55), on a CPU: the call list checked
against a checkout (each call's folders with the travelling tree within 60 MiB, no path carried twice, every carried
folder ignored by git, every vLLM part carried, the timeouts within the window), each check seen failing on its
planted violation in a scratch checkout; the vLLM parts' sha256 check; the run's settings planned on an H100; the
report's arithmetic; and the whole window in its CPU dry mode: every call's work but the CUDA steps, with the real
run (python -m lowvram_grpo.run on the unsloth backend) observed and its JSON written."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

from bench import gpu_vllm_window as window

MIB = 2 ** 20


def calls_cli(*args, root=None, env=None):
    argv = [sys.executable, "-m", "bench.gpu_vllm_window", "calls", *args]
    if root is not None:
        argv += ["--root", str(root)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_the_call_list_holds_for_this_checkout():
    """Here the folders may be prepared (measured) or not (CI: their recorded sizes); either way each call with the
    checkout's travelling tree stays within 60 MiB, the last call carries the last vLLM part and installs, and the
    window's timeouts with a machine start fit 600 s."""
    proc = calls_cli()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = window.check_calls(REPO)
    assert report["problems"] == []
    assert [c["carry"] for c in report["calls"]] == [[".gpu"], [".vs/p01"], [".vs/p02"], [".vs/p03"]]
    assert all(c["with_tree_mib"] <= 60 for c in report["calls"]) and report["window_s"] <= 600
    for row in report["calls"]:  # the lines the lead issues
        assert f"call {row['call']}: carry={json.dumps(row['carry'])} timeout_s={row['timeout_s']}" in proc.stdout
    assert report["calls"][-1]["command"] == 'bash bench/gpu_vllm_window.sh 4 "$OUT"'


def test_docs_list_the_calls_of_the_code():
    """docs/gpu.md's table of the window's calls is CALLS: carry, timeout and command in order, each carried size the
    recorded one (the check adds the tree: test_the_call_list_holds_for_this_checkout)."""
    import re

    text = (REPO / "docs" / "gpu.md").read_text()
    section = text[text.index("## unsloth + vLLM on CUDA: what ran, with vLLM 0.26 on torch 2.11"):]
    rows = re.findall(r"^\| (\d) \| `([^`]+)` \| ([\d.]+) \| (\d+) \| `([^`]+)` \| [^|]+ \|$", section, re.M)
    assert [(int(n), (carry,), int(timeout), command) for n, carry, _, timeout, command in rows] == [
        (c.number, c.carry, c.timeout_s, c.command) for c in window.CALLS]
    assert [float(mib) for _, _, mib, _, _ in rows] == [round(sum(c.recorded_mib), 1) for c in window.CALLS]


def _sparse(path: Path, mib: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(int(mib * MIB))  # apparent size counts (what is copied); no disk used


def _scratch(tmp_path: Path, tree_mib: float = 2.5) -> Path:
    """A checkout shaped like this one for the check: a tracked tree of `tree_mib`, .gpu and .vs ignored, .gpu/site
    and three parts at the sizes prepared here, each part with join.sh and the stage's MANIFEST."""
    root = tmp_path / "checkout"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    _sparse(root / "tracked.bin", tree_mib)
    (root / ".gitignore").write_text("/.gpu/\n/.vs/\n")
    subprocess.run(["git", "-C", str(root), "add", "tracked.bin", ".gitignore"], check=True)
    _sparse(root / ".gpu" / "site" / "unsloth.so", 46.4)
    manifest = []
    for number, mib in ((1, 56.0), (2, 56.0), (3, 53.4)):
        part = root / ".vs" / f"p{number:02d}"
        _sparse(part / f"vllm.whl.part{number - 1:02d}", mib)
        (part / "join.sh").write_text("#!/bin/bash\n")
        manifest.append(f"P {'0' * 64} vllm.whl.part{number - 1:02d} vllm.whl p{number:02d}")
    manifest.append(f"W {'0' * 64} vllm.whl split")
    for number in (1, 2, 3):
        (root / ".vs" / f"p{number:02d}" / "MANIFEST").write_text("\n".join(manifest) + "\n")
    return root


def test_the_call_list_check_fails_on_each_planted_violation(tmp_path):
    root = _scratch(tmp_path)
    proc = calls_cli("--require", root=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "58.5 MiB with the tree" in proc.stdout  # 56.0 + the 2.5 MiB tree, measured

    def refused(*fragments, require=True):
        proc = calls_cli(*(["--require"] if require else []), root=root)
        assert proc.returncode == 2 and proc.stderr.startswith("error: the call list does not hold: "), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        for fragment in fragments:
            assert fragment in proc.stderr, (fragment, proc.stderr)

    _sparse(root / ".vs" / "p02" / "vllm.whl.part01", 58.0)  # a part too big for the tree beside it
    refused("call 3 carries 58.00 MiB + the tree 2.50 MiB = 60.50 MiB, over 60 MiB")
    _sparse(root / ".vs" / "p02" / "vllm.whl.part01", 56.0)
    _sparse(root / "tracked.bin", 4.5)  # the checkout grew: every call carries it
    refused("call 2 carries 56.00 MiB + the tree 4.50 MiB", "call 3 carries")
    _sparse(root / "tracked.bin", 2.5)
    (root / ".gitignore").write_text("/.gpu/\n")  # .vs would travel with every call
    refused(".vs/p01 is not ignored by git", ".vs/p03 is not ignored by git")
    (root / ".gitignore").write_text("/.gpu/\n/.vs/\n")
    (root / ".vs" / "p04").mkdir()  # a part that no call carries
    refused(".vs/p04 is part of the vLLM stage and no call carries it")
    (root / ".vs" / "p04").rmdir()
    site = root / ".gpu"
    site.rename(tmp_path / "away")
    refused(".gpu is not here: build it with `bash bench/prepare_gpu_site.sh`")
    assert calls_cli(root=root).returncode == 0  # without --require: its recorded size
    (tmp_path / "away").rename(site)
    (site / "site" / "link").symlink_to("/etc/hostname")
    refused(".gpu holds links")
    (site / "site" / "link").unlink()
    assert calls_cli("--require", root=root).returncode == 0


def test_the_check_refuses_a_path_carried_twice_and_a_window_too_long(tmp_path):
    """The call list is a constant of the module; a planted list with one folder in two calls (as itself and
    inside its parent) and one whose timeouts pass the window, through the same check."""
    root = _scratch(tmp_path)
    calls = list(window.CALLS)
    calls[1] = window.Call(2, (".vs",), 20, "the whole stage", (165.0,))
    problems = window.check_calls(root, calls)["problems"]
    assert any(".vs/p02 (call 3) is carried again: call 2 carries .vs" in p for p in problems), problems
    assert any(".vs/p03 (call 4) is carried again" in p for p in problems), problems
    calls = list(window.CALLS)
    calls[1] = window.Call(2, (".vs/p01", ".vs/p01"), 20, "twice in one call", (56.01, 56.01))
    assert any(".vs/p01 (call 2) is carried again: call 2 carries .vs/p01" in p
               for p in window.check_calls(root, calls)["problems"])
    calls = list(window.CALLS)
    calls[-1] = window.Call(4, (".vs/p03",), 520, "longer", (53.5,))
    assert any("take 680 s, over the window's 600 s" in p for p in window.check_calls(root, calls)["problems"])
    assert window.check_calls(root)["problems"] == []


def _parts(tmp_path: Path) -> list[Path]:
    """A small wheel split into two parts over two folders plus a whole one, with a MANIFEST as split.sh writes it."""
    wheel = os.urandom(3000)
    small = os.urandom(500)
    sha = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
    folders = [tmp_path / "p01", tmp_path / "p02"]
    for folder in folders:
        folder.mkdir()
    (folders[0] / "big.whl.part00").write_bytes(wheel[:2000])
    (folders[1] / "big.whl.part01").write_bytes(wheel[2000:])
    (folders[1] / "small.whl").write_bytes(small)
    manifest = (f"P {sha(wheel[:2000])} big.whl.part00 big.whl p01\nP {sha(wheel[2000:])} big.whl.part01 big.whl p02\n"
                f"W {sha(small)} small.whl p02\nW {sha(wheel)} big.whl split\n")
    for folder in folders:
        (folder / "MANIFEST").write_text(manifest)
        (folder / "join.sh").write_text("#!/bin/bash\n")
    return folders


def test_the_parts_are_verified_in_place_and_a_changed_byte_is_refused(tmp_path):
    folders = _parts(tmp_path)
    argv = [sys.executable, "-m", "bench.gpu_vllm_window", "verify", *map(str, folders)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ok  p01/big.whl.part00", "ok  p02/big.whl.part01", "ok  p02/small.whl",
                                        "ok  big.whl rejoined from 2 parts"]
    assert sorted(p.name for p in folders[0].iterdir()) == ["MANIFEST", "big.whl.part00", "join.sh"]  # nothing moved
    data = bytearray((folders[1] / "big.whl.part01").read_bytes())
    data[7] ^= 1
    (folders[1] / "big.whl.part01").write_bytes(bytes(data))
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (proc.returncode == 2 and proc.stderr.startswith("error: the vLLM parts: ")
            and "big.whl.part01" in proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_window_run_settings_fit_an_h100_with_vllm_holding_the_rollout(monkeypatch):
    """The run's own settings (run_argv's --set values) for the Llama-3.2-1B shape, resolved on the h100-80gb profile:
    the unsloth backend with vLLM, the plan fits, and the max_model_len unsloth_zoo will start vLLM with holds
    prompt + completion; plan_facts gives vLLM's planned share as the shared weights plus the vllm term."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.memory_plan import plan
    from lowvram_grpo.settings.resolve import resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shape from KNOWN_SHAPES, not the hub
    argv = window.run_argv(Path("unsloth/Llama-3.2-1B-Instruct"), Path("/nowhere"), dry=False)
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert argv[argv.index("--backend") + 1] == "unsloth" and "model.fast_inference=true" in sets
    config = load_config(window.PRESET, sets)
    resolved = resolve(config, profile("h100-80gb"), "unsloth")
    assert resolved.fast_inference and resolved.generation == "unsloth_vllm" and resolved.load_in_4bit
    facts = window.plan_facts(plan(config, resolved))
    assert facts["vllm_share_gib"] == pytest.approx(facts["terms"]["weights"] + facts["terms"]["vllm"], abs=1e-3)
    assert facts["vllm_max_model_len"] >= config.train.max_prompt_length + config.train.max_completion_length
    assert facts["total_gib"] < facts["card_gib"]


def test_the_report_puts_vllm_share_rollout_speed_and_the_lora_sync_beside_the_plan():
    """summarize() on fixed events: the arithmetic the card's JSON is read by."""
    events = [
        {"event": "plan", "t": 1, "total_gib": 40.0, "terms": {"weights": 1.0, "vllm": 30.0}, "vllm_share_gib": 31.0,
         "kv_cache_gib": 29.5, "vllm_max_model_len": 320},
        {"event": "engine", "t": 50, "seconds": 42.0, "used_before_gib": 2.0, "used_after_gib": 33.0, "total_gib": 80.0,
         "vllm": {"gpu_memory_utilization": 0.4, "kv_cache_gib": 30.0, "max_model_len": 320}},
        {"event": "phase_end", "t": 60, "name": "load", "seconds": 58.0, "peak_allocated_gib": 2.0,
         "peak_reserved_gib": 3.0, "peak_used_gib": 34.0},
        {"event": "step", "t": 100, "step": 1, "seconds": 30.0, "rollout_s": 2.0, "rollout_tokens": 400,
         "lora_sync_s": 0.5, "lora_syncs": 1, "vllm_adapter_load_s": 0.1, "vllm_adapter_loads": 1},
        {"event": "step", "t": 105, "step": 2, "seconds": 5.0, "rollout_s": 1.0, "rollout_tokens": 500,
         "lora_sync_s": 0.3, "lora_syncs": 1, "vllm_adapter_load_s": 0.1, "vllm_adapter_loads": 1},
        {"event": "phase_end", "t": 106, "name": "train", "seconds": 40.0, "peak_allocated_gib": 4.0,
         "peak_reserved_gib": 5.0, "peak_used_gib": 36.0},
        {"event": "generate", "t": 110, "where": "evaluation", "stage": "after", "seconds": 1.5, "sequences": 16,
         "tokens": 1000, "engine": "VLLMEngine", "lora": "/r/adapter", "engine_request": "LoRARequest"},
        {"event": "exit", "t": 111, "code": 0},
    ]
    m = window.summarize(events)
    assert [s["rollout_ms_per_token"] for s in m["steps"]] == [5.0, 2.0]
    assert m["step_times"] == {"first_step_s": 30.0, "steady_step_s_mean": 5.0, "steady_rollout_ms_per_token": 2.0,
                               "lora_sync_s_per_step": 0.5, "steps": 2}
    assert m["peak_gib"] == {"allocated": 4.0, "reserved": 5.0, "used": 36.0}
    assert m["peak_vs_plan"] == {"allocated": 0.1, "reserved": 0.125, "used": 0.9}
    share = m["vllm_share_vs_plan"]
    assert share["engine_share_gib"] == 32.0 and share["engine_share_vs_plan"] == round(32 / 31, 3)
    assert (share["used_by_the_start_gib"] == 31.0 and share["kv_cache_gib"] == 30.0
            and share["planned_kv_cache_gib"] == 29.5)
    assert m["evaluation"]["after"]["ms_per_token"] == 1.5 and m["evaluation"]["after"]["lora"] == ["/r/adapter"]
    assert m["exit_code"] == 0


def test_the_window_script_parses_and_refuses_bad_input(tmp_path):
    assert subprocess.run(["bash", "-n", "bench/gpu_vllm_window.sh"], cwd=REPO).returncode == 0
    for argv, fragment in (([], "name the call"), (["5", str(tmp_path)], "name the call"),
                           (["1"], "name the output folder"),
                           (["all", str(tmp_path)], "on a CPU only, with --dry"), (["1", str(tmp_path), "--fast"],
                                                                                  "unknown option --fast")):
        proc = subprocess.run(["bash", "bench/gpu_vllm_window.sh", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "LOWVRAM_VLLM_STATE": str(tmp_path / "state")})
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and fragment in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_the_module_refuses_bad_input_in_one_line_before_anything_runs(tmp_path):
    (tmp_path / "model").mkdir()
    for argv, fragment in (
            (["run", "--out", str(tmp_path / "w.json"), "--model-dir", str(tmp_path / "model")],
             "has no checkpoint: build it first with python -m bench.gpu_vllm_window build"),
            (["run", "--out", str(tmp_path), "--model-dir", str(tmp_path / "model")],
             "is a directory: name a .json file"),
            (["run", "--out", str(tmp_path / "w.json"), "--model-dir", str(tmp_path), "--dry", "--enforce-eager"],
             "--enforce-eager is for vLLM on the card"),
            (["run", "--out", str(tmp_path / "w.json"), "--model-dir", str(tmp_path), "--budget-s", "5"],
             "must be >= 10"),
            (["calls", "--root", str(tmp_path)], "is not a git checkout"),
            (["verify", str(tmp_path / "model")], "no MANIFEST in")):
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_vllm_window", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert (proc.returncode == 2 and proc.stderr.startswith("error: ")
                and fragment in proc.stderr), (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w.json").exists()


def test_the_last_call_on_a_fresh_machine_says_to_start_again(tmp_path):
    """Call 4 without what call 1 left (the machine was given back between calls): one line, exit 2, nothing run."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "bench/gpu_vllm_window.sh", "4", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "LOWVRAM_VLLM_STATE": str(tmp_path / "state"),
                                           "PYTHON": sys.executable})
    assert proc.returncode == 2 and "issue the calls again from call 1" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: call 4: ") and len(proc.stderr.strip().splitlines()) == 1
    assert not (out / "window.json").exists()


@pytest.mark.slow
def test_the_dry_window_runs_every_call_but_the_cuda_steps(tmp_path):
    """`bash bench/gpu_vllm_window.sh all OUT --dry`: the call list checked, then calls 1-4 with their CUDA steps
    replaced (no nvidia-smi, no install, model.fast_inference=false): the scaled-down Llama checkpoint, and the real
    run on the unsloth backend, observed: its phases, GRPO steps with their rollouts, the held-out answers before
    (base model) and after (the saved adapter as the LoRA request), save_lora / load_lora; at most 8 files per call."""
    out, state = tmp_path / "w", tmp_path / "state"
    env = {**os.environ, "PYTHON": sys.executable, "LOWVRAM_VLLM_STATE": str(state), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "bench/gpu_vllm_window.sh", "all", str(out), "--dry"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "call 4" in (out / "calls.txt").read_text()
    for number in (1, 2, 3, 4):
        assert len(list((out / f"call{number}").iterdir())) <= 8
    assert "dry mode" in (out / "call1" / "nvidia-smi.txt").read_text()
    assert json.loads((out / "call1" / "versions-1.json").read_text())["unsloth"]["version"] == "2026.10.9"
    report = json.loads((out / "call4" / "window.json").read_text())
    assert report["ok"] and report["dry"] and report["missing"] == [] and report["exit_code"] == 0
    assert report["checkpoint"]["shape"] == "Llama-3.2-1B-dry" and report["checkpoint"]["vocab"] == 512
    assert "--backend unsloth" in report["command"] and "model.fast_inference=false" in report["command"]
    assert any("call 3: ends" in line for line in report["calls"])  # the earlier calls' lines, from the machine
    m = report["measured"]
    assert m["resolved"]["backend"] == "unsloth" and m["resolved"]["load_in_4bit"] is True
    assert list(m["phases"]) == ["load", "start", "measure_before", "train", "save", "measure_after", "finish"]
    assert all(p["ok"] and p["seconds"] >= 0 and p["peak_used_gib"] > 0 for p in m["phases"].values())
    assert [s["step"] for s in m["steps"]] == [1, 2]
    for step in m["steps"]:  # 6 completions of 16 new positions per rollout (random weights rarely stop)
        assert step["rollout_calls"] == 1 and step["rollout_sequences"] == 6 and 0 < step["rollout_tokens"] <= 96
        assert step["rollout_ms_per_token"] > 0 and step["seconds"] > step["rollout_s"] > 0
        assert step["lora_syncs"] == 0  # no vLLM: rollouts read the trained model itself
    assert m["step_times"]["first_step_s"] == m["steps"][0]["seconds"] and m["step_times"]["steps"] == 2
    before, after = m["evaluation"]["before"], m["evaluation"]["after"]
    adapter = str(state / "run" / "adapter")
    assert before["lora"] == [] and after["lora"] == [adapter] and before["sequences"] == after["sequences"] == 4
    assert after["engine"] == "TransformersEngine" and after["ms_per_token"] > 0
    assert [e["path"] for e in m["lora"]["save_lora"]] == [adapter] == [e["path"] for e in m["lora"]["load_lora"]]
    assert m["engine"] is None and m["plan"] is None  # no CUDA: no vLLM, and the run plans GPU memory on CUDA only
    run = report["run"]
    assert run["status"] == "complete" and run["steps"] == 2 and run["adapter"] and len(run["trl_step_time_s"]) == 2
