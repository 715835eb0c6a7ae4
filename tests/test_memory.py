"""The memory plan (lowvram_grpo.settings.memory_plan, with model_shapes, memory_plan_terms, memory_fit and oom): its
arithmetic, the published figures it is checked against, its suggestions, the CLI's --dry-run / --vram /
--auto-fit / --export, the OOM report, and the CUDA path's wiring at its boundary (the arguments built for GPU
libraries; nothing here ran on a GPU)."""
import ast
import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli
from lowvram_grpo.settings.config import list_presets, load_config
from lowvram_grpo.settings.hardware import ANY_GPU, profile
from lowvram_grpo.core.errors import PlanError
from lowvram_grpo.settings.memory_plan import format_plan, plan
from lowvram_grpo.settings.memory_fit import apply_suggestions
from lowvram_grpo.settings.memory_terms import GIB, logits_bytes_held_whole
from lowvram_grpo.settings.model_shapes import model_shape, shape_from_config_json
from lowvram_grpo.run.oom import oom_message
from lowvram_grpo.settings.resolve import resolve

GPU_PRESETS = ["llama8b_4bit", "qwen3b_4bit", "qwen1_5b_4bit"]


def plan_of(config, hardware, backend="auto"):
    """The memory plan of `config` resolved on `hardware` (memory_plan.plan takes the config beside its settings)."""
    return plan(config, resolve(config, hardware, backend))


def planned(config, card=None, backend="auto"):
    """The plan of `config` on a bf16 card of `card` GiB (None: the smallest that fits), as a run resolves it."""
    return plan_of(config, dataclasses.replace(ANY_GPU, total_gib=card), backend)


# --------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("name, billions", [
    ("meta-llama/meta-Llama-3.1-8B-Instruct", 8.03), ("unsloth/Llama-3.2-3B-Instruct", 3.21),
    ("Qwen/Qwen2.5-3B-Instruct", 3.09), ("Qwen/Qwen2.5-1.5B-Instruct", 1.54), ("Qwen/Qwen2.5-0.5B-Instruct", 0.49),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", 0.135), ("unsloth/meta-Llama-3.1-8B-Instruct-bnb-4bit", 8.03),
])
def test_known_shapes_give_the_published_parameter_counts(name, billions):
    assert model_shape(name).params / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.slow
def test_the_tiny_shape_is_the_built_model_and_counts_its_parameters(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    shape = shape_from_config_json(tiny_model_dir / "config.json")
    assert (dataclasses.replace(shape, name="builtin:tiny", source="")
            == dataclasses.replace(model_shape("builtin:tiny"), source=""))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model_shape("builtin:tiny").params == sum(p.numel() for p in model.parameters())


def test_a_local_checkpoint_is_planned_from_its_config_json(tiny_model_dir):
    local = planned(load_config("tiny", [f"model.name={tiny_model_dir}"]))
    builtin = planned(load_config("tiny"))
    assert {k: t.bytes for k, t in local.terms.items()} == {k: t.bytes for k, t in builtin.terms.items()}


@pytest.mark.slow
def test_the_merged_copy_for_sampling_is_counted_where_the_loop_merges(tiny_model_dir):
    """decode.merge_lora=true on a card: the plan counts the merged copy as the targeted base weights the built
    model's LoRA layers hold, at the compute dtype's bytes; the plan without the merge has no such term."""
    import torch
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    asked = ["decode.loop=lowvram", "memory.load_in_4bit=false"]
    config = load_config("tiny", [*asked, "decode.merge_lora=true"])
    merged = planned(config, card=16, backend="hf")
    unmerged = planned(load_config("tiny", [*asked, "decode.merge_lora=false"]), card=16, backend="hf")
    assert "merged" not in unmerged.terms
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                           PeftLoraConfig(r=config.lora.r, lora_alpha=config.lora.alpha,
                                          target_modules=list(config.lora.target_modules)))
    held = sum(m.get_base_layer().weight.numel() for m in model.modules() if isinstance(m, LoraLayer))
    assert merged.terms["merged"].bytes == held * merged.resolved.compute_bytes
    assert merged.total_bytes - unmerged.total_bytes == merged.terms["merged"].bytes
    assert "merged LoRA copy" in format_plan(merged)


@pytest.mark.slow
def test_the_int8_base_is_counted_instead_of_the_merged_copy(tiny_model_dir):
    """decode.weights=int8 (a CPU): the plan counts what fused_decode.build_int8_base packs, 1 byte for each weight of
    every decoder projection (targeted or not) and the LM head of the built model, and no merged copy."""
    import torch
    from transformers import AutoModelForCausalLM

    cpu = profile("cpu")
    int8 = plan_of(load_config("tiny", ["decode.weights=int8"]), cpu, "hf")
    bf16 = plan_of(load_config("tiny", []), cpu, "hf")
    assert "merged" in bf16.terms and "merged" not in int8.terms
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    packed = sum(m.weight.numel() for layer in model.model.layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear)) + model.get_output_embeddings().weight.numel()
    assert int8.terms["int8"].bytes == packed
    assert "int8 base for sampled tokens" in format_plan(int8)


def test_an_unknown_model_says_how_to_give_its_shape():
    with pytest.raises(PlanError, match="config.json"):
        planned(load_config("llama8b_4bit", ["model.name=someone/Mystery-7B"]))


# --------------------------------------------------------------------------- arithmetic

def _total(preset, *overrides, card=None):
    return planned(load_config(preset, list(overrides)), card).total_bytes


@pytest.mark.parametrize("setting, values", [
    ("train.num_generations", [2, 4, 6, 8]),
    ("train.max_completion_length", [128, 256, 512, 768]),
    ("lora.r", [8, 16, 32, 64]),
    ("train.max_prompt_length", [64, 128, 256]),
])
@pytest.mark.parametrize("preset", ["llama8b_4bit", "qwen1_5b_4bit"])
def test_the_plan_grows_with_each_size(preset, setting, values):
    def overrides(v):
        extra = [f"train.per_device_train_batch_size={v}"] if setting == "train.num_generations" else []
        return [f"{setting}={v}", "model.max_seq_length=2048", *extra]

    # on a fixed card, so that vLLM's share stays put and only the training terms move
    totals = [_total(preset, *overrides(v), card=80) for v in values]
    assert totals == sorted(totals) and len(set(totals)) == len(totals), totals


def test_the_plan_grows_with_model_size():
    names = ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-3B-Instruct",
             "meta-llama/meta-Llama-3.1-8B-Instruct"]
    for key in ("weights", "lora", "activations"):
        sizes = [planned(load_config("qwen3b_4bit", [f"model.name={n}"])).terms[key].bytes for n in names]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), (key, sizes)
    minimum = [planned(load_config("qwen3b_4bit", [f"model.name={n}"])).min_vram_gb for n in names]
    assert minimum == sorted(minimum)


def test_memory_settings_shrink_their_terms():
    base = planned(load_config("llama8b_4bit"), 24)
    sixteen_bit = planned(load_config("llama8b_4bit", ["memory.load_in_4bit=false"]), 24)
    assert sixteen_bit.terms["weights"].bytes == pytest.approx(8.03e9 * 2, rel=0.01)
    assert base.terms["weights"].gib == pytest.approx(5.3, abs=0.2)  # NF4 linear layers + 16-bit embeddings
    fp32_adam = planned(load_config("llama8b_4bit", ["train.optim=adamw_torch"]), 24)
    assert fp32_adam.terms["optimizer"].bytes == 4 * base.terms["optimizer"].bytes  # 8 vs 2 bytes/param
    no_ckpt = planned(load_config("llama8b_4bit", ['memory.gradient_checkpointing="false"']), 24)
    ckpt = planned(load_config("llama8b_4bit", ['memory.gradient_checkpointing="true"']), 24)
    assert (no_ckpt.terms["activations"].bytes > 10 * ckpt.terms["activations"].bytes
            > 10 * base.terms["activations"].bytes)
    # 'unsloth' offloads only on the unsloth backend; on hf it is plain checkpointing
    assert (planned(load_config("llama8b_4bit"), 24, backend="hf").terms["activations"].bytes
            == ckpt.terms["activations"].bytes)


def test_vllm_takes_its_share_of_the_card_and_training_gets_the_rest():
    config = load_config("llama8b_4bit")
    p = planned(config, 16)
    assert p.terms["vllm"].bytes + p.terms["weights"].bytes == pytest.approx(0.6 * 16 * GIB, abs=1)
    assert planned(load_config("llama8b_4bit", ["memory.gpu_memory_utilization=0.8"]), 16).total_bytes > p.total_bytes
    without = planned(load_config("llama8b_4bit", ["model.fast_inference=false"]), 16)
    assert "vllm" not in without.terms and without.total_bytes < p.total_bytes
    # too small a share: the KV cache cannot hold one generation batch, so it does not fit
    starved = planned(load_config("llama8b_4bit", ["memory.gpu_memory_utilization=0.25"]), 24)
    assert starved.total_gb < 24 and starved.fits is False


def test_logits_are_counted_as_trl_computes_them():
    """TRL 1.15 scores the logits in [4096 x 32768] fp32 tiles; held whole (older TRL) they are the
    figure Unsloth published for 'TRL + FA2': 78.3 GB for Llama-3.1-8B, 8 generations x 20K tokens."""
    shape = model_shape("meta-llama/meta-Llama-3.1-8B-Instruct")
    assert logits_bytes_held_whole(shape, 8, 20_000) / 1e9 == pytest.approx(78.3, rel=0.06)
    tiles = planned(load_config("llama8b_4bit"), backend="hf").terms["logits"]
    assert tiles.bytes == 2 * 4096 * 32768 * 4 and "2.20 GiB" in tiles.detail


def test_logits_on_the_unsloth_backend_are_counted_in_unsloths_own_chunks():
    """On the unsloth backend unsloth replaces TRL's per-token log-probs with its fused LM head: chunks of
    unsloth_zoo's fused_linear_rows (a power of two near rows x hidden / vocab, >= 512 x 151936 logits' worth,
    <= 4096 rows, <= 2 GiB) x the whole vocabulary in fp32, not TRL's [4096 x 32768] tiles
    (tests/test_gpu_wheels.py runs unsloth_zoo's own fused_linear_rows against ours)."""
    from lowvram_grpo.settings.unsloth_sizing import fused_linear_rows

    llama = planned(load_config("llama8b_4bit"))  # 6 sequences x 768 completion tokens, vocab 128256
    assert llama.backend == "unsloth"
    assert fused_linear_rows(6 * 768, 4096, 128256) == 512
    assert llama.terms["logits"].bytes == 2 * 512 * 128256 * 4
    assert "2 chunks of 512 x 128256 x 4 B (unsloth_zoo fused_linear_rows)" in llama.terms["logits"].detail
    qwen = planned(load_config("qwen1_5b_4bit"))  # vocab 151936: 512 rows at least
    assert qwen.terms["logits"].bytes == 2 * 512 * 151936 * 4
    assert fused_linear_rows(64 * 4096, 4096, 32768) == 4096  # many rows: capped at 4096
    assert fused_linear_rows(64 * 4096, 4096, 262144) == 2048  # a 2 GiB chunk of a 262144 vocabulary


def test_the_plan_gives_the_max_model_len_unsloth_starts_vllm_with_and_refuses_one_below_prompt_plus_completion():
    """unsloth_zoo's load_vllm gives vLLM gpu_memory_utilization x the memory free at load, and shrinks
    max_model_len to what its KV-cache estimate in that share holds (unsloth_sizing.vllm_budget, run against
    unsloth_zoo's own code in tests/test_gpu_wheels.py); the plan says the length, and settings whose rollouts it
    would cut do not fit: the suggestions give the whole prompt + completion."""
    from lowvram_grpo.settings.unsloth_sizing import vllm_budget

    p = plan_of(load_config("llama8b_4bit"), profile("t4"))
    assert p.vllm_max_model_len == 1024 and p.short_max_model_len() is None
    assert "max_model_len 1024" in p.terms["vllm"].detail
    budget = vllm_budget(p.shape, 0.6, 14.7 * GIB, 14.7 * GIB, 1024, 32, True)
    assert p.terms["vllm"].bytes == int(budget.share_bytes) - p.terms["weights"].bytes
    long_config = load_config("llama8b_4bit", ["memory.gpu_memory_utilization=0.45", "model.max_seq_length=4096",
                                               "train.max_completion_length=3072"])
    long = plan_of(long_config, profile("t4"))
    assert long.vllm_max_model_len < 3328 and long.fits is False  # a plan whose rollouts vLLM would cut does not fit
    assert (f"and unsloth_zoo would start vLLM with max_model_len {long.vllm_max_model_len}, below prompt + completion "
            "(3328)") in format_plan(long)
    fitted = plan_of(apply_suggestions(long_config, long.suggestions), profile("t4"))
    assert fitted.fits and fitted.vllm_max_model_len >= fitted.rollout_tokens  # the suggestions give the whole length
    unsized = planned(long_config)  # no card: the smallest that fits, and the warning where vLLM's length is short
    assert unsized.short_max_model_len() is None or f"warning: {unsized.short_max_model_len()}" in format_plan(unsized)
    assert planned(load_config("llama8b_4bit", ["model.fast_inference=false"]), 16).vllm_max_model_len is None


def test_the_notebook_settings_fit_the_card_unsloth_names():
    """Unsloth: Llama-3.1-8B GRPO fits in 15 GB (the notebook runs on a 16 GB T4); Qwen2.5-1.5B in 5 GB."""
    llama = planned(load_config("llama8b_4bit"))
    assert 10 <= llama.min_vram_gb <= 15.5
    assert planned(load_config("llama8b_4bit"), 15).fits
    assert 3.5 <= planned(load_config("qwen1_5b_4bit")).min_vram_gb <= 6.5


# --------------------------------------------------------------------------- suggestions

@pytest.mark.parametrize("preset", GPU_PRESETS)
@pytest.mark.parametrize("card", [4, 6, 8, 10, 12])
def test_suggestions_fit_when_replanned(preset, card):
    config = load_config(preset)
    p = planned(config, card)
    if p.fits:
        assert not p.suggestions
        return
    if not p.suggestions:
        assert p.no_fit_reason.startswith("even with")
        return
    fitted = apply_suggestions(config, p.suggestions)
    replanned = planned(fitted, card)
    assert replanned.fits and replanned.total_gb == pytest.approx(p.suggested_total_gb)
    assert all(s.as_override().startswith(s.key + "=") for s in p.suggestions)


def test_suggestions_change_as_little_as_needed():
    p = planned(load_config("llama8b_4bit"), 10)
    assert not p.fits
    changed = {s.key: s.value for s in p.suggestions}
    assert "lora.r" not in changed and "model.fast_inference" not in changed  # not needed at 10 GiB
    assert changed.get("train.per_device_train_batch_size") == changed.get("train.num_generations")


def test_a_card_too_small_for_any_setting_names_the_presets_that_fit():
    p = planned(load_config("llama8b_4bit"), 6)
    assert not p.fits and not p.suggestions
    text = format_plan(p)
    assert "no settings of this preset fit" in text and "--preset qwen1_5b_4bit" in text


def test_the_table_names_the_stack_and_the_total():
    text = format_plan(planned(load_config("llama8b_4bit"), 16))
    for word in ("4-bit", "vLLM", "paged_adamw_8bit", "total", "fits a 16 GiB card"):
        assert word in text


# --------------------------------------------------------------------------- presets

@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_presets_state_the_vram_their_plan_needs(preset):
    config = load_config(preset)
    assert config.requires_cuda and config.memory.load_in_4bit and config.model.fast_inference
    stated = float(re.search(r"plan: ([\d.]+) GiB min", config.description).group(1))
    assert stated == pytest.approx(planned(config).min_vram_gb, abs=0.05)
    text = (REPO / "presets" / f"{preset}.yaml").read_text()
    assert f"at least {stated} GiB" in text  # the header says it too
    for key in ("r", "optim", "num_generations", "max_completion_length", "load_in_4bit",
                "gpu_memory_utilization", "gradient_checkpointing", "fast_inference"):
        line = next(l for l in text.splitlines() if l.strip().startswith(f"{key}:"))
        assert "#" in line, f"{preset}: {key} has no comment saying what it does to memory"


def test_every_preset_can_be_planned():
    for name in list_presets():
        assert planned(load_config(name)).total_gb > 0


# --------------------------------------------------------------------------- out of memory

def test_an_out_of_memory_report_is_one_line_with_what_to_lower(tmp_path):
    config = load_config("llama8b_4bit")
    run = tmp_path / "run"
    message = oom_message(planned(config, 12), config, "training", run / "checkpoint-50", run)
    assert "\n" not in message
    assert message.startswith("CUDA out of memory in a training step; largest planned terms: weights 5.3 GiB")
    assert re.search(r"set [a-z_]+\.[a-z_]+=[\w.]+ \(was ", message)
    assert f"the last checkpoint is kept in {run / 'checkpoint-50'}" in message
    # on a 12 GiB card the plan lowers num_generations: that changes the training, so a new run, not --resume
    assert "train.num_generations=4 (was 6)" in message
    assert "start a new run with --set " in message and "--resume" not in message
    # on a 16 GiB card a smaller vLLM share is enough, and --resume may change it
    message = oom_message(planned(config, 16), config, "training", None, run)
    assert "no checkpoint was written yet" in message
    assert message.endswith(f"then continue with: python -m lowvram_grpo.run --resume {run} "
                            "--set memory.gpu_memory_utilization=0.5")


def test_an_out_of_memory_in_evaluation_advises_a_smaller_eval_batch_that_resume_can_set(tmp_path):
    config = load_config("llama8b_4bit")  # eval.batch_size 16
    message = oom_message(planned(config, 16), config, "evaluation", None, tmp_path, adapter=tmp_path / "adapter")
    assert message.startswith("CUDA out of memory in the held-out evaluation")
    assert "set eval.batch_size=8 (was 16)" in message
    assert f"the trained adapter is saved in {tmp_path / 'adapter'}" in message
    assert message.endswith(f"then continue with: python -m lowvram_grpo.run --resume {tmp_path} "
                            "--set eval.batch_size=8")


def test_an_out_of_memory_while_generating_is_told_apart_from_the_training_step(tmp_path):
    """oom_phase reads the rollout from the traceback's frames. A torch out-of-memory error is raised inside the
    installed TRL's own GRPOTrainer methods (trl_compat.TRL_ROLLOUT_METHODS, each looked up on trl.GRPOTrainer:
    a TRL that renamed one fails here) and inside our engine's rollout_func: 'rollout'. Raised inside TRL's
    loss (the training step) or outside TRL: the phase given. Then through the run's own context manager."""
    import types

    import torch
    import trl

    from lowvram_grpo.training.vllm_rollouts import TRLRollouts
    from lowvram_grpo.core.errors import OutOfMemory
    from lowvram_grpo.run.oom import OOM_PHASES, oom_phase, out_of_memory_reported
    from lowvram_grpo.training.trl_compat import TRL_ROLLOUT_METHODS

    class OutOfMemoryOnUse:
        """A trainer (or batch) whose every use raises, so the error comes from inside TRL's own method."""

        def __getattr__(self, name):
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in) at self.{name}")

        def __getitem__(self, key):
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in) at [{key!r}]")

    def raised_in(method, *args) -> torch.OutOfMemoryError:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            method(*args)
        frames, tb = [], caught.value.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_code)
            tb = tb.tb_next
        assert method.__code__ in frames  # the real function's own frame is in the traceback
        return caught.value

    args = {"_generate_and_score_completions": ([{"prompt": "x"}],), "_generate": (["x"],),
            "_generate_single_turn": ([[1, 2]], None, None, 2)}
    assert set(args) == set(TRL_ROLLOUT_METHODS)
    for name in TRL_ROLLOUT_METHODS:
        assert name in vars(trl.GRPOTrainer), f"trl.GRPOTrainer has no {name} of its own"  # a TRL rename fails here
        method = getattr(trl.GRPOTrainer, name)
        assert method.__module__ == "trl.trainer.grpo_trainer"
        assert oom_phase(raised_in(method, OutOfMemoryOnUse(), *args[name]), "training") == "rollout", name
    rollout = raised_in(TRLRollouts.rollout_func, OutOfMemoryOnUse(), ["x"], OutOfMemoryOnUse())
    assert oom_phase(rollout, "training") == "rollout"
    # the training step's own TRL code (the loss, on a batch) is not a rollout
    in_loss = raised_in(trl.GRPOTrainer._compute_loss, OutOfMemoryOnUse(), None, OutOfMemoryOnUse())
    assert oom_phase(in_loss, "training") == "training"
    try:
        raise torch.OutOfMemoryError("in our own code")
    except torch.OutOfMemoryError as exc:
        assert oom_phase(exc, "training") == "training"

    # what a run prints: the context manager around training names the phase read from the traceback
    config = load_config("tiny")
    run_dir = types.SimpleNamespace(path=tmp_path, latest_checkpoint=lambda: None)
    with pytest.raises(OutOfMemory) as reported:
        with out_of_memory_reported(None, config, run_dir):
            trl.GRPOTrainer._generate(OutOfMemoryOnUse(), ["x"])
    assert OOM_PHASES["rollout"] in str(reported.value)
    with pytest.raises(OutOfMemory) as reported:
        with out_of_memory_reported(None, config, run_dir):
            trl.GRPOTrainer._compute_loss(OutOfMemoryOnUse(), None, OutOfMemoryOnUse())
    assert OOM_PHASES["training"] in str(reported.value) and OOM_PHASES["rollout"] not in str(reported.value)


# --------------------------------------------------------------------------- CLI

@pytest.mark.slow
def test_dry_run_prints_the_plan_with_a_total():
    proc = run_cli("--preset", "llama8b_4bit", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "preset: llama8b_4bit" in proc.stdout  # the resolved config
    for word in ("4-bit", "vLLM", "paged_adamw_8bit", "total", "needs a card of at least"):
        assert word in proc.stdout


@pytest.mark.slow
def test_vram_6_says_it_does_not_fit_and_what_to_change():
    proc = run_cli("--preset", "llama8b_4bit", "--dry-run", "--vram", "6")
    assert proc.returncode == 0, proc.stderr
    assert "does NOT fit a 6 GiB card" in proc.stdout and "--preset qwen1_5b_4bit" in proc.stdout


@pytest.mark.slow
def test_vram_10_proposes_settings_and_auto_fit_applies_them():
    # a 16-bit KV cache: auto would pick fp8 here (model.kv_cache_dtype), which leaves little to propose
    proc = run_cli("--preset", "llama8b_4bit", "--dry-run", "--vram", "10", "--set", "model.kv_cache_dtype=bfloat16")
    assert "to fit, change:" in proc.stdout and "--set train.num_generations=4" in proc.stdout
    fitted = run_cli("--preset", "llama8b_4bit", "--dry-run", "--vram", "10", "--auto-fit", "--set",
                     "model.kv_cache_dtype=bfloat16")
    assert fitted.returncode == 0, fitted.stderr
    assert "auto-fit for a 10 GiB card: set " in fitted.stdout and "fits a 10 GiB card" in fitted.stdout
    resolved = yaml.safe_load(fitted.stdout[fitted.stdout.index("preset:"):fitted.stdout.index("# resolved for")])
    assert resolved["train"]["num_generations"] == 4 and resolved["memory"]["vram_gb"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (["--auto-fit"], "--auto-fit needs a card size"),
    (["--auto-fit", "--vram", "6"], "no settings of preset llama8b_4bit fit a 6 GiB card"),
    (["--vram", "zero"], "--vram"),
])
def test_auto_fit_that_cannot_work_is_one_error_line(args, fragment, tmp_path):
    proc = run_cli("--preset", "llama8b_4bit", "--dry-run", *args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and fragment in proc.stderr


@pytest.mark.slow
def test_unknown_model_dry_run_says_the_plan_cannot_be_made():
    proc = run_cli("--preset", "llama8b_4bit", "--set", "model.name=someone/Mystery-7B", "--dry-run")
    assert proc.returncode == 0
    assert ("GPU memory plan: cannot plan for someone/Mystery-7B: its config.json is not in the local hub cache"
            in proc.stdout)


@pytest.mark.slow
def test_gpu_preset_without_cuda_stops_before_the_heavy_imports(tmp_path):
    code = ("import sys; from lowvram_grpo.run.cli import main; "
            f"rc = main(['--preset', 'llama8b_4bit', '--max-steps', '1', '--output-dir', {str(tmp_path / 'out')!r}]); "
            "heavy = [m for m in ('transformers', 'trl', 'peft', 'unsloth', 'vllm') if m in sys.modules]; "
            "print('RC', rc, 'HEAVY', heavy)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "RC 2 HEAVY []" in proc.stdout, proc.stdout + proc.stderr
    assert (proc.stderr.strip().count("\n") == 0 and "needs an NVIDIA GPU" in proc.stderr
            and "Traceback" not in proc.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gguf_export_on_the_hf_backend_is_refused_before_anything_is_written(tmp_path):
    proc = run_cli("--preset", "tiny", "--backend", "hf", "--export", "gguf", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2 and "--export gguf needs the unsloth backend" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- export (hf backend, for real)

@pytest.mark.slow
def test_merged16_export_on_the_hf_backend_equals_the_adapted_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from lowvram_grpo.model.backends import export_model, load_model
    from lowvram_grpo.settings.hardware import detect

    handle = load_model(resolve(load_config("tiny"), detect(), "hf"))
    torch.manual_seed(0)
    for name, weight in handle.model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give the adapter something to merge
            weight.data.normal_(0, 0.5)
    adapter = handle.save_lora(tmp_path / "adapter")
    out = export_model(handle, adapter, tmp_path / "export-merged16", "merged16")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16 and not hasattr(merged, "peft_config")
    ids = torch.tensor([[1, 5, 9, 20, 33, 40]])
    with torch.no_grad():
        adapted = handle.model(ids).logits
        with handle.model.disable_adapter():
            base = handle.model(ids).logits
        exported = merged(ids).logits.float()
    assert (exported - adapted).abs().max() < 0.05 < (adapted - base).abs().max()


# --------------------------------------------------------------------------- the CUDA path at its boundary

def test_grpo_config_for_the_gpu_preset_uses_vllm_and_paged_8bit_adamw(tmp_path):
    """What the CUDA branch hands TRL, built here without a GPU (not a claim that it ran on one)."""
    from lowvram_grpo.training.grpo import grpo_args, grpo_config_kwargs

    args = grpo_args(resolve(load_config("llama8b_4bit"), profile("t4")), tmp_path)  # fp16: constructible on a CPU
    assert args.use_vllm and args.vllm_mode == "colocate" and args.vllm_gpu_memory_utilization == 0.6
    assert args.vllm_max_model_length == 1024  # never the model's own 128K context
    assert args.optim == "paged_adamw_8bit" and args.gradient_checkpointing and not args.use_cpu
    assert (args.bf16, args.fp16) == (False, True)
    assert (args.num_generations, args.per_device_train_batch_size, args.max_completion_length) == (6, 6, 768)
    # transformers refuses bf16=True without a GPU, so on an Ampere card only the arguments are checked
    kwargs = grpo_config_kwargs(resolve(load_config("llama8b_4bit"), profile("rtx4090")), tmp_path)
    assert (kwargs["bf16"], kwargs["fp16"]) == (True, False)


@pytest.mark.parametrize("hw, dtype", [("t4", "float16"), ("v100-16gb", "float16"), ("rtx3060-12gb", "bfloat16"),
                                       ("a100-40gb", "bfloat16")])
def test_unsloth_load_arguments_for_the_gpu_preset(hw, dtype):
    """The dtype is passed to unsloth explicitly: on a T4 it loads fp16 and GRPOConfig says fp16 too."""
    import torch

    from lowvram_grpo.model.unsloth_backend import from_pretrained_kwargs, get_peft_model_kwargs

    resolved = resolve(load_config("llama8b_4bit"), profile(hw))
    load = from_pretrained_kwargs(resolved, resolved.plan.model.name)
    fast = hw != "v100-16gb"  # vllm 0.31's CUDA 13 build has no kernels for sm70
    assert load == dict(model_name=resolved.plan.model.name, max_seq_length=1024, dtype=getattr(torch, dtype),
                        load_in_4bit=True, fast_inference=fast, max_lora_rank=32, gpu_memory_utilization=0.6,
                        float8_kv_cache=False, use_gradient_checkpointing="unsloth")
    # model.kv_cache_dtype auto: fp8 only where an attention backend serves it (issue 65): the 12 GB card's plan is
    # short of a 16-bit cache, but sm86 with FlashInfer off has none, so it keeps 16-bit and says why
    assert not resolved.kv_cache_reason.startswith("auto -> fp8")
    if hw == "rtx3060-12gb":
        assert "fp8 KV has no attention backend on sm86" in resolved.kv_cache_reason
    peft = get_peft_model_kwargs(resolved)
    assert (peft["r"], peft["lora_alpha"], peft["use_gradient_checkpointing"]) == (32, 32, "unsloth")


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_the_exports_call_unsloths_gpu_savers_as_they_are_defined():
    """unsloth's CUDA savers cannot be imported without a GPU (Triton), so their source is read:
    the methods it binds, and that our keyword arguments are among their parameters."""
    from lowvram_grpo.model.unsloth_backend import EXPORTS

    source = (Path(importlib.util.find_spec("unsloth").origin).parent / "save.py").read_text()
    functions = {f.name: f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)}
    implementations = {"save_pretrained_merged": "unsloth_generic_save_pretrained_merged",
                       "save_pretrained_gguf": "unsloth_save_pretrained_gguf"}
    for kind, (method, kwargs) in EXPORTS.items():
        assert f"model.{method} = _bind_saving_method(" in source
        params = [a.arg for a in functions[implementations[method]].args.args]
        assert params[1:3] == ["save_directory", "tokenizer"] and set(kwargs) <= set(params), (kind, params)
    assert '"q4_k_m"' in ast.get_docstring(functions["unsloth_save_pretrained_gguf"]) or "q4_k_m" in source


def test_the_hf_backends_own_vllm_engine_is_planned_as_the_engine_asks_vllm():
    """model.generation=vllm on a GPU: a second engine with its own copy of the weights, a LoRA slot, its own
    CUDA context and exactly the KV cache it asks for (kv_cache_memory_bytes, max(G, eval batch) sequences),
    beside the whole trainer. Defect: the plan counted gpu_memory_utilization x the card (0.5 x 22 GiB) for
    vLLM while the engine asked for ~0.3 GiB of KV cache, which vLLM then used instead, and counted G
    sequences where the engine asks for max(G, eval batch)."""
    from lowvram_grpo.model.vllm import settings_for
    from lowvram_grpo.settings.memory_terms import (KV_BLOCK_TOKENS, VLLM_PROCESS_BYTES, engine_kv_cache_bytes,
                                                    engine_sequences, engine_share_bytes)

    config = load_config("qwen1_5b_4bit", ["model.generation=vllm", "model.fast_inference=false"])
    with_vllm = planned(config, 22, backend="hf")
    without = planned(load_config("qwen1_5b_4bit", ["model.fast_inference=false"]), 22, backend="hf")
    assert "vllm" not in without.terms
    shape, resolved = with_vllm.shape, with_vllm.resolved
    engine = settings_for(resolved, shape, config.model.name)
    assert engine.max_num_seqs == engine_sequences(config) == max(6, config.eval.batch_size) == 16
    tokens = -(-config.model.max_seq_length // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    assert (engine.kv_cache_bytes == engine_kv_cache_bytes(shape, config, 2)
            == 2 * 28 * 256 * 2 * 16 * tokens)  # 0.33 GiB
    term = with_vllm.terms["vllm"]
    assert term.bytes == engine_share_bytes(shape, resolved) + VLLM_PROCESS_BYTES and "its own weights" in term.label
    assert term.gib == pytest.approx(2.53, abs=0.01)  # was 0.5 x 22 + 0.6 = 11.6 GiB
    assert with_vllm.total_gb == pytest.approx(without.total_gb + term.gib)
    # vLLM refuses to start unless gpu_memory_utilization x the card is free: the engine passes its own share
    assert engine.gpu_memory_utilization == pytest.approx(
        -(-engine_share_bytes(shape, resolved) * 100 // (22 * GIB)) / 100)
    small = planned(config, 4, backend="hf")
    assert not small.fits and any(s.key == "model.generation" for s in small.suggestions)


# --------------------------------------------------------------------------- issue 41: free memory, the KV batch,
# UNSLOTH_VLLM_STANDBY, priming

def test_the_plan_is_made_on_the_free_memory_as_unsloth_sizes_vllm():
    """unsloth_zoo's load_vllm gives vLLM gpu_memory_utilization x the memory FREE at load; training gets the rest
    of the free memory. Defect: the plan took the card's total, overstating the margin by (1 - util) x (total - free)
    on a card others hold some of (a display). A T4 as detect() records it with 0.6 GiB held elsewhere."""
    from lowvram_grpo.settings.unsloth_sizing import vllm_budget

    config = load_config("llama8b_4bit")
    empty = plan_of(config, profile("t4"))
    shared_hw = dataclasses.replace(profile("t4"), name="present", free_gib=14.1)
    shared = plan_of(config, shared_hw)
    assert shared.vram_gb == 14.7 and shared.free_gb == pytest.approx(14.1)
    assert shared.terms["vllm"].bytes + shared.terms["weights"].bytes == pytest.approx(0.6 * 14.1 * GIB, abs=1)
    spare = lambda p: p.free_gb - p.total_gb  # noqa: E731
    assert spare(empty) - spare(shared) == pytest.approx((1 - 0.6) * (14.7 - 14.1))
    budget = vllm_budget(shared.shape, 0.6, 14.1 * GIB, 14.7 * GIB, 1024, 32, True)  # unsloth reads free and total
    assert shared.terms["vllm"].bytes == int(budget.share_bytes) - shared.terms["weights"].bytes
    assert shared.vllm_max_model_len == budget.max_model_len
    text = format_plan(shared)
    assert "14.1 GiB free when detected (0.6 GiB held by others" in text and "of the 14.1 GiB free to spare" in text
    assert "t4 profile), planned as all free" in format_plan(empty)  # a profile says it assumes free == total
    # a plan that its total would hold but its free memory does not, does not fit (without vLLM: a fixed total)
    no_vllm = load_config("llama8b_4bit", ["model.fast_inference=false"])
    whole = plan_of(no_vllm, profile("t4"))
    tight = plan_of(no_vllm, dataclasses.replace(shared_hw, free_gib=whole.total_gb - 0.1))
    assert whole.fits and tight.total_gb == whole.total_gb and tight.fits is False
    assert f"does NOT fit a 14.7 GiB card ({whole.total_gb - 0.1:.1f} GiB free)" in format_plan(tight)
    # memory.vram_gb keeps its meaning: a card of that size, nothing else on it
    override = plan_of(load_config("llama8b_4bit", ["memory.vram_gb=14"]), shared_hw)
    assert (override.vram_gb == override.free_gb == 14
            and "14 GiB (memory.vram_gb), planned as all free" in format_plan(override))


def test_a_detected_card_records_its_free_memory_and_vram_overrides_drop_it():
    from lowvram_grpo.settings.hardware import Hardware, with_memory

    assert "free_gib" in {f.name for f in dataclasses.fields(Hardware)} and profile("t4").free_gib is None
    present = dataclasses.replace(profile("t4"), name="present", free_gib=14.1)
    assert "14.7 GiB, 14.1 free" in present.describe()
    assert with_memory(present, 12).free_gib is None  # --vram: a card of that size, all free


def test_the_kv_cache_is_checked_against_the_larger_of_the_rollout_and_evaluation_batches():
    """The held-out evaluation generates eval.batch_size (16) sequences at once through the same engine as the
    rollouts (6). Defect: the check counted the rollout batch only; at gpu_memory_utilization 0.45 on a T4 the
    KV cache (0.80 GiB) holds 6 x 1024 tokens (0.75 GiB) but not 16 (2.00 GiB), and the plan said nothing. vLLM's
    scheduler then generates the answers in waves (slower, no more memory): a warning with the batch that fits,
    while a rollout batch the cache cannot hold still makes the plan not fit."""
    per_token = 2 * 32 * 1024 * 2  # K and V x layers x kv_dim x 2 bytes (Llama-3.1-8B)
    notebook = plan_of(load_config("llama8b_4bit"), profile("t4"))
    assert (notebook.kv_sequences, notebook.kv_decided_by) == (16, "evaluation")
    assert notebook.kv_largest_bytes == 16 * 1024 * per_token <= notebook.kv_cache_bytes
    assert notebook.kv_needed_bytes == 6 * 1024 * per_token and notebook.evaluation_kv_short() is None
    assert ("vLLM's KV cache 3.01 GiB holds the evaluation batch: 16 sequences x 1024 tokens = 2.00 GiB (the larger "
            "batch decides: rollout 6 sequences, evaluation 16 (eval.batch_size))") in format_plan(notebook)
    small_eval = plan_of(load_config("llama8b_4bit", ["eval.batch_size=4"]), profile("t4"))
    assert (small_eval.kv_sequences, small_eval.kv_decided_by) == (6, "rollout")
    off = plan_of(load_config("llama8b_4bit", ["eval.enabled=false"]), profile("t4"))
    assert off.kv_decided_by == "rollout" and "evaluation off" in format_plan(off)
    starved = plan_of(load_config("llama8b_4bit", ["memory.gpu_memory_utilization=0.45"]), profile("t4"))
    assert 6 * 1024 * per_token <= starved.kv_cache_bytes < 16 * 1024 * per_token and starved.fits
    text = format_plan(starved)
    assert "GiB does NOT hold the evaluation batch: 16 sequences x 1024 tokens = 2.00 GiB" in text
    assert ("warning: vLLM's KV cache (0.80 GiB) holds 6 of an evaluation batch's 16 sequences at full length "
            "(2.00 GiB): "
            "the held-out answers are generated in waves") in text and "--set eval.batch_size=6" in text
    fixed = plan_of(load_config("llama8b_4bit", ["memory.gpu_memory_utilization=0.45", "eval.batch_size=6"]),
                    profile("t4"))
    assert fixed.evaluation_kv_short() is None
    rollout_short = plan_of(load_config("llama8b_4bit", ["memory.gpu_memory_utilization=0.4"]), profile("t4"))
    assert rollout_short.fits is False and "GiB a rollout batch (6 sequences) needs" in format_plan(rollout_short)


def test_unsloth_vllm_standby_is_refused_in_one_line(monkeypatch):
    """UNSLOTH_VLLM_STANDBY=1 makes unsloth_zoo's load_vllm replace gpu_memory_utilization with its standby share
    (0.8 x 0.95 = 0.76 on a T4) and start vLLM with sleep mode, outside the plan. Defect: the plan ignored it.
    The variable is read once, by hardware.py (detect / planning_hardware); the plan refuses it."""
    from lowvram_grpo.core.errors import ResolveError
    from lowvram_grpo.settings.hardware import planning_hardware, unsloth_vllm_standby
    from lowvram_grpo.settings.memory_terms import standby_utilization

    assert standby_utilization(14.7) == pytest.approx(0.76) and standby_utilization(23.6) == pytest.approx(0.78375)
    assert unsloth_vllm_standby({"UNSLOTH_VLLM_STANDBY": "0"}) is None and unsloth_vllm_standby({}) is None
    config = load_config("llama8b_4bit")
    monkeypatch.setenv("UNSLOTH_VLLM_STANDBY", "1")
    hardware = planning_hardware(config, "t4")
    assert hardware.vllm_standby == "1"
    with pytest.raises(ResolveError) as refused:
        plan_of(config, hardware)
    message = str(refused.value)
    assert "\n" not in message and "from 0.6 to 0.76" in message and "unset UNSLOTH_VLLM_STANDBY" in message
    no_vllm = load_config("llama8b_4bit", ["model.fast_inference=false"])
    assert plan_of(no_vllm, planning_hardware(no_vllm, "t4")).total_gb > 0  # no unsloth vLLM: nothing to refuse
    monkeypatch.setenv("UNSLOTH_VLLM_STANDBY", "0")
    assert plan_of(config, planning_hardware(config, "t4")).fits


@pytest.mark.slow
def test_unsloth_vllm_standby_stops_the_dry_run_with_one_error_line():
    proc = run_cli("--preset", "llama8b_4bit", "--dry-run", "--gpu", "t4", env={"UNSLOTH_VLLM_STANDBY": "1"})
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "UNSLOTH_VLLM_STANDBY=1" in errors[0], proc.stderr


def test_the_standby_share_is_unsloth_zoos_own():
    """The standby tiers as the pinned unsloth_zoo writes them (load_vllm, vLLM >= 0.11 branch), read as text."""
    spec = importlib.util.find_spec("unsloth_zoo")
    if spec is None:
        pytest.skip("unsloth_zoo is not installed (the GPU install set)")
    from lowvram_grpo.settings.memory_terms import STANDBY_TIERS, STANDBY_VLLM_FACTOR

    text = (Path(spec.origin).parent / "vllm_utils.py").read_text()
    branch = text[text.index("vLLM >= 0.11.0 uses more VRAM") - 1500:text.index("vLLM >= 0.11.0 uses more VRAM")]
    tiers = [(float(a), float(b)) for a, b in
             re.findall(r"if\s+ten_percent >= ([\d.]+): standby_target_gpu_util = ([\d.]+)", branch)]
    last = float(re.findall(r"else: standby_target_gpu_util = ([\d.]+)", branch)[-1])
    assert tuple(tiers[-5:]) + ((0.0, last),) == STANDBY_TIERS
    assert f"standby_target_gpu_util *= {STANDBY_VLLM_FACTOR}" in text


def test_priming_is_planned_with_its_own_optimizer_and_batch():
    """Priming (prime.steps > 0) runs before GRPO with vLLM loaded, a torch AdamW of its own (fp32 state, 8 bytes
    per LoRA parameter) and prime.batch_size examples of up to model.max_seq_length tokens. Defect: outside the
    plan; a T4 run with prime.batch_size=64 was planned to fit."""
    from lowvram_grpo.settings.memory_terms import activation_bytes_per_token_layer, lora_param_count

    base = plan_of(load_config("llama8b_4bit", ["prime.steps=30"]), profile("t4"))
    peak, shape = base.priming, base.shape
    lora = lora_param_count(shape, base.resolved.plan.model)
    assert peak.parts["AdamW fp32 state"] == 8 * lora == 4 * base.terms["optimizer"].bytes
    tokens = 8 * 1024
    assert (peak.parts["activations 8 x 1024 tokens"]
            == tokens * shape.hidden * 2 + tokens * activation_bytes_per_token_layer(shape, 2))
    assert peak.parts["vLLM"] == base.terms["vllm"].bytes and peak.parts["weights"] == base.terms["weights"].bytes
    assert base.terms["activations"].bytes < peak.parts["activations 8 x 1024 tokens"]
    assert base.fits and peak.fits and "priming (prime.steps=30): 12.26 GiB" in format_plan(base)
    big_config = load_config("llama8b_4bit", ["prime.steps=30", "prime.batch_size=64"])
    big = plan_of(big_config, profile("t4"))
    assert big.total_gb == pytest.approx(base.total_gb) and big.priming.fits is False and big.fits is False
    assert "priming's peak (22.5 GiB: prime.batch_size=64) is above the 14.7 GiB free" in format_plan(big)
    assert [s.key for s in big.suggestions] == ["prime.batch_size"]
    assert plan_of(apply_suggestions(big_config, big.suggestions), profile("t4")).fits
    # without priming it is one line of what it would cost, never a reason not to fit
    off = plan_of(load_config("llama8b_4bit", ["prime.batch_size=64"]), profile("t4"))
    assert off.fits and off.priming_fits is None and "priming: off (prime.steps=0)" in format_plan(off)
    assert planned(load_config("llama8b_4bit", ["prime.steps=30", "prime.batch_size=64"])).min_vram_gb > 20
