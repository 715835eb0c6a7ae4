"""`lowvram-grpo eval` on CPU, run as users run it (fresh processes): it reproduces a run's own held-out
numbers from its adapter, scores a dataset file the trainer accepts, adds mean@k / pass@k, and takes a
PEFT adapter made elsewhere for the same base model."""
import json
import subprocess
import sys

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"


def eval_cli(*args, timeout=600):
    """`python -m lowvram_grpo.evaluate ARGS` in a fresh process, from the repo root."""
    return subprocess.run([sys.executable, "-m", "lowvram_grpo.evaluate", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_eval_of_a_runs_adapter_reproduces_its_summary(tiny_run):
    out, _ = tiny_run
    proc = eval_cli("--adapter", out / "adapter", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    summary = json.loads((out / "summary.json").read_text())
    base, adapter = result["columns"]
    assert (base["name"], base["adapter"], adapter["name"]) == ("base", None, "adapter")
    for column, stage in ((base, "before"), (adapter, "after")):  # the run's config.yaml: same questions and protocol
        for key in ("strict_correct", "lenient_correct", "reward_mean", "accuracy_strict", "format_rate", "protocol"):
            assert column[key] == pytest.approx(summary[stage][key]), (stage, key)
    assert result["protocol"]["decoding"] == "greedy" and result["n"] == summary["after"]["n"]
    assert {(p["from"], p["to"], p["metric"]) for p in result["paired"]} == {
        ("base", "adapter", "accuracy_strict"), ("base", "adapter", "accuracy_lenient")}


def test_eval_scores_a_dataset_file_through_the_cli_with_the_table(tiny_run, tmp_path):
    out, _ = tiny_run
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"question": f"Ava has {i} apples and buys 2 more. How many now?",
                                        "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}) + "\n" for i in range(7)))
    proc = run_cli("eval", "--adapter", f"trained={out / 'adapter'}", "--dataset", str(data))  # lowvram-grpo eval
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"7 questions from {data}" in proc.stdout and "protocol: greedy decoding" in proc.stdout
    assert "accuracy_strict base -> trained:" in proc.stdout and "paired over the same 7 questions" in proc.stdout
    assert "0.000 [0.00, 0.35]" in proc.stdout  # a Wilson interval for 0 of 7

    limited = eval_cli("--adapter", out / "adapter", "--dataset", data, "--limit", "3", "--json")
    assert limited.returncode == 0, limited.stderr[-3000:]
    assert json.loads(limited.stdout)["n"] == 3


def test_eval_samples_add_mean_and_pass_at_k(tiny_run):
    out, _ = tiny_run
    proc = eval_cli("--adapter", out / "adapter", "--set", "eval.samples=3", "--set", "eval.sample_temperature=1.0",
                    "--limit", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["protocol"]["samples"] == {"k": 3, "temperature": 1.0, "top_p": 0.95, "seed": 3407}
    for column in result["columns"]:
        sampled = column["sampled"]
        assert sampled["k"] == 3 and len(sampled["strict_counts"]) == 2
        assert all(0 <= c <= 3 for c in sampled["strict_counts"] + sampled["lenient_counts"])
        assert sampled["strict_pass_at_k"] >= sampled["strict_mean_at_k"]


def test_eval_takes_a_peft_adapter_made_elsewhere_for_the_same_base(tmp_path, tiny_model_dir):
    """An adapter saved by plain PEFT (another rank and other layers than the preset's) on the built-in tiny
    model: its base is recognised, it loads beside the preset's LoRA, and it changes the answers' numbers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    theirs = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    theirs.save_pretrained(tmp_path / "theirs")
    proc = eval_cli("--preset", "tiny", "--model", "builtin:tiny", "--adapter", tmp_path / "theirs", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    base_column, their_column = json.loads(proc.stdout)["columns"]
    assert their_column["name"] == "theirs"
    assert their_column["reward_mean"] != base_column["reward_mean"] or \
        their_column["mean_completion_tokens"] != base_column["mean_completion_tokens"]
