"""The command line, end to end in fresh processes: a real 3-step GRPO run of the tiny model, and
every bad input ending in one `error:` line, exit 2, no traceback, nothing written."""
import json

import torch
from safetensors.torch import load_file

from conftest import run_cli

import pytest  # noqa: E402

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"


def test_tiny_run_writes_the_four_outputs(tiny_run):
    out, _ = tiny_run
    assert (out / "config.yaml").is_file()
    assert "max_steps: 3" in (out / "config.yaml").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all({"step", "reward", "loss"} <= r.keys() for r in rows)
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"].endswith("tiny-llama-v2")
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    for side in ("before", "after"):
        assert {"reward_mean", "accuracy_strict", "accuracy_lenient", "format_rate"} <= summary[side].keys()
    assert summary["steps"] == 3


def test_training_moved_the_lora_b_weights(tiny_run):
    out, _ = tiny_run
    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b_weights = {k: v for k, v in weights.items() if "lora_B" in k}
    assert b_weights, "no lora_B tensors saved"
    # peft initialises every B to zero; GRPO steps must have changed them
    assert all(torch.count_nonzero(v) > 0 for v in b_weights.values())


def test_progress_and_table_are_shown(tiny_run):
    _, proc = tiny_run
    assert "GRPO" in proc.stderr and "3/3" in proc.stderr and "reward=" in proc.stderr and "avg10=" in proc.stderr
    assert "signal=" in proc.stderr and "kl=" in proc.stderr and "loss=" not in proc.stderr  # tiny: beta 0.04
    assert ("held-out metric" in proc.stdout and "reward_mean" in proc.stdout
            and "protocol: greedy decoding" in proc.stdout)


def test_list_presets():
    proc = run_cli("--list-presets")
    assert proc.returncode == 0
    for name in ("tiny", "smollm2_cpu", "llama8b_4bit"):
        assert name in proc.stdout


def test_dry_run_prints_the_resolved_config_and_writes_nothing(tmp_path):
    out = tmp_path / "never"
    proc = run_cli("--preset", "tiny", "--set", "lora.r=4", "--dry-run", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "r: 4" in proc.stdout and "num_generations: 4" in proc.stdout
    assert not out.exists()


def test_the_runs_plan_file_is_what_dry_run_printed(tiny_run):
    """One frozen plan (issue 50): the run writes to plan.txt what `--dry-run` prints for the same settings: the
    config, the settings resolve decided, the memory plan."""
    out, _ = tiny_run
    dry = run_cli("--preset", "tiny", "--max-steps", "3", "--dry-run", "--output-dir", str(out))
    assert dry.returncode == 0, dry.stderr
    assert "\n# resolved for present:" in dry.stdout and "\n#   backend hf on cpu" in dry.stdout  # decided, as comments
    assert (out / "plan.txt").read_text() == dry.stdout
    other = run_cli("--preset", "tiny", "--max-steps", "4", "--dry-run", "--output-dir", str(out))
    assert other.stdout != dry.stdout  # the comparison sees a change of settings


def _bad_inputs(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_columns = tmp_path / "cols.jsonl"
    no_columns.write_text('{"q": "a", "a": "b"}\n' * 40)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return [
        (["--preset", "nope"], "unknown preset"),
        (["--preset", "tiny", "--set", "train.bogus=1"], "unknown key"),
        (["--preset", "tiny", "--set", "train.learning_rate=fast"], "must be float"),
        (["--preset", "tiny", "--set", "lora.r=0"], "lora.r must be > 0"),
        (["--preset", "tiny", "--max-steps", "0"], "--max-steps"),
        (["--preset", "tiny", "--max-steps", "many"], "--max-steps"),
        (["--preset", "tiny", "--dataset", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--preset", "tiny", "--dataset", str(empty)], "is empty"),
        (["--preset", "tiny", "--dataset", str(no_columns)], "has no 'question' column and no TRL 'prompt' column"),
        (["--preset", "tiny", "--output-dir", str(a_file / "sub")], "cannot create output dir"),
        (["--preset", "llama8b_4bit", "--max-steps", "1"], "needs an NVIDIA GPU"),
        (["--preset", "tiny", "--backend", "vllm"], "--backend"),
    ]


def test_bad_input_gives_one_error_line_exit_2_and_writes_nothing(tmp_path):
    failures = []
    for args, fragment in _bad_inputs(tmp_path):
        out = tmp_path / "out-never"
        extra = [] if "--output-dir" in args else ["--output-dir", str(out)]
        proc = run_cli(*args, *extra, timeout=120)
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        error_lines = [l for l in lines if l.startswith("error:")]
        ok = (proc.returncode == 2 and len(error_lines) == 1 and fragment in error_lines[0]
              and "Traceback" not in proc.stderr and not out.exists())
        if not ok:
            failures.append((args, proc.returncode, proc.stderr[-500:]))
    assert failures == []
