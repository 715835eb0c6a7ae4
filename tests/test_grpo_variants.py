"""The field's GRPO variants as `train` settings: GSPO's sequence-level ratio, every loss TRL 1.15 implements,
DAPO's clip-higher, truncated-completion masking, high-entropy tokens, and DAPO's dynamic sampling (ours:
trl_compat.DynamicSampling over TRL's rollout step). Fast tests check the settings against the installed TRL and
what reaches GRPOConfig; the slow ones train real tiny runs through the CLI and run the dynamic-sampling hook on
a real trainer's rollouts."""
from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest

from conftest import run_cli
from lowvram_grpo.settings.config import TRL_LOSS_TYPES, load_config
from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.settings.hardware import profile
from lowvram_grpo.settings.resolve import ResolveError, resolve


# ----------------------------------------------------------------------------- fast: against the installed TRL
def test_the_loss_types_are_the_ones_the_installed_trl_implements():
    """TRL_LOSS_TYPES equals both what GRPOConfig's own help lists and the branches of GRPOTrainer's loss."""
    from trl import GRPOConfig, GRPOTrainer

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert set(re.findall(r"'(\w+)'", listed)) == set(TRL_LOSS_TYPES)
    source = inspect.getsource(GRPOTrainer._compute_loss)
    branches = set(re.findall(r'self\.loss_type == "(\w+)"', source))
    for group in re.findall(r"self\.loss_type in \[([^\]]*)\]", source):
        branches |= set(re.findall(r'"(\w+)"', group))
    assert branches == set(TRL_LOSS_TYPES)
    assert 'raise ValueError(f"Unknown loss type' in source  # anything else fails inside TRL, mid-run


def test_every_variant_reaches_grpo_config(tmp_path):
    from lowvram_grpo.training.grpo import grpo_args

    for loss in TRL_LOSS_TYPES:
        config = load_config("tiny", [f"train.loss_type={loss}", "train.importance_sampling_level=sequence",
                                      "train.epsilon_high=0.28", "train.top_entropy_quantile=0.2",
                                      "train.mask_truncated_completions=true"])
        args = grpo_args(resolve(config, profile("cpu")), tmp_path)
        assert (args.loss_type, args.importance_sampling_level, args.epsilon_high, args.top_entropy_quantile,
                args.mask_truncated_completions) == (loss, "sequence", 0.28, 0.2, True)
    default = grpo_args(resolve(load_config("tiny"), profile("cpu")), tmp_path)
    assert (default.loss_type, default.importance_sampling_level, default.epsilon_high,
            default.top_entropy_quantile) == \
        ("grpo", "token", None, 1.0)  # the presets' behaviour is unchanged


@pytest.mark.parametrize("setting, fragment", [
    ("train.loss_type=ppo",
     "train.loss_type must be one of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo; got 'ppo'"),
    ("train.importance_sampling_level=batch",
     "train.importance_sampling_level must be one of token, sequence; got 'batch'"),
    ("train.epsilon_high=0", "train.epsilon_high must be > 0 (DAPO: 0.28) or null"),
    ("train.top_entropy_quantile=0", "train.top_entropy_quantile must be in (0, 1]"),
    ("train.dynamic_sampling_max_draws=0", "train.dynamic_sampling_max_draws must be >= 1"),
])
def test_bad_values_name_the_allowed_ones(setting, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config("tiny", [setting])


def test_dynamic_sampling_is_refused_where_it_cannot_run():
    config = load_config("tiny", ["train.dynamic_sampling=true"])
    gpu = dataclasses.replace(profile("rtx4090"), unsloth_installed=True)
    with pytest.raises(ResolveError, match="train.dynamic_sampling runs on the hf backend.*--backend hf"):
        resolve(config, gpu)  # auto picks unsloth there
    assert resolve(config, gpu, "hf").backend == "hf"
    with pytest.raises(ResolveError, match="re-draws whole groups in one process; this run has 2 processes"):
        resolve(config, profile("cpu"), "hf", num_processes=2)


def test_the_effective_settings_line_names_the_variants():
    from lowvram_grpo.training.grpo import describe_effective

    settings = {"loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28,
                "importance_sampling_level": "sequence",
                "mask_truncated_completions": True, "top_entropy_quantile": 0.2, "dynamic_sampling_max_draws": 3,
                "scale_rewards": "group", "num_generations": 4, "generation_batch_size": 8, "use_vllm": False,
                "bf16": False, "fp16": False, "vllm_importance_sampling_correction": False,
                "vllm_importance_sampling_mode": "sequence_mask"}
    line = describe_effective({"trainer": "GRPOTrainer", "settings": settings, "changed": {}})
    assert "vllm_importance_sampling_correction" not in line  # neither vLLM nor a correction: nothing to say
    corrected = describe_effective({"trainer": "GRPOTrainer", "changed": {},
                                    "settings": {**settings, "vllm_importance_sampling_correction": True}})
    assert "vllm_importance_sampling_correction=True (sequence_mask)" in corrected  # our loop's correction is named
    from_loss = describe_effective({"trainer": "GRPOTrainer", "changed": {}, "settings": {
        **settings, "vllm_importance_sampling_correction": True, "is_ratio_from_loss": True}})
    assert "vllm_importance_sampling_correction=True (sequence_mask, trainer log-probs from the loss)" in from_loss
    assert line.startswith("GRPO as the trainer runs it: trainer=GRPOTrainer loss_type=dapo ")
    for part in ("epsilon_high=0.28", "importance_sampling_level=sequence", "mask_truncated_completions=True",
                 "top_entropy_quantile=0.2", "dynamic_sampling=on(max_draws=3)"):
        assert part in line
    assert "dynamic_sampling=off" in describe_effective(
        {"trainer": "GRPOTrainer", "settings": {**settings, "dynamic_sampling_max_draws": 0}, "changed": {}})
    assert "dynamic_sampling=on(max_draws=3, by correctness) " in describe_effective(
        {"trainer": "GRPOTrainer", "settings": {**settings, "dynamic_sampling_reward": "correctness"}, "changed": {}})


# ----------------------------------------------------------------------------- slow: real runs
GSPO_SETTINGS = ["train.importance_sampling_level=sequence", "train.loss_type=dr_grpo", "train.epsilon_high=0.28",
                 "train.top_entropy_quantile=0.5", "train.mask_truncated_completions=true"]
# A reward of the user's kind that a random tiny model earns about one time in five (its text length), so some
# groups score all 0 (no signal) and others do not: dynamic sampling has groups to drop and groups to find.
SOMETIMES = "def sometimes(prompts, completions, **kwargs):\n" \
            "    return [1.0 if len(c[-1]['content']) % 5 == 0 else 0.0 for c in completions]\n"


@pytest.mark.slow
def test_gspo_dr_grpo_clip_higher_and_entropy_tokens_train_through_the_cli(tmp_path):
    out = tmp_path / "run"
    sets = [part for s in GSPO_SETTINGS for part in ("--set", s)]
    proc = run_cli("--preset", "tiny", "--max-steps", "2", "--set", "eval.enabled=false", *sets,
                   "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("GRPO as the trainer runs it: "))
    for part in ("loss_type=dr_grpo", "importance_sampling_level=sequence", "epsilon_high=0.28",
                 "top_entropy_quantile=0.5", "mask_truncated_completions=True", "dynamic_sampling=off"):
        assert part in line, line
    summary = json.loads((out / "summary.json").read_text())
    used = summary["grpo_settings"]["settings"]
    assert (used["loss_type"], used["importance_sampling_level"], used["epsilon_high"]) == ("dr_grpo", "sequence", 0.28)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(isinstance(r["loss"], float) for r in rows)


@pytest.mark.slow
def test_dynamic_sampling_trains_through_the_cli_and_logs_its_cost(tmp_path):
    (tmp_path / "sometimes.py").write_text(SOMETIMES)
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "3", "--set", "eval.enabled=false",
                   "--set", "train.dynamic_sampling=true", "--set", "train.per_device_train_batch_size=12",
                   "--set", f"rewards.module={tmp_path / 'sometimes.py'}",
                   "--set", "rewards.names=[sometimes]", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamic_sampling=on(max_draws=3)" in next(l for l in proc.stdout.splitlines()
                                                      if l.startswith("GRPO as the trainer runs it: "))
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    groups = 12 // 4
    for row in rows:
        extra, dropped = row["dynamic_sampling/extra_rollouts"], row["dynamic_sampling/zero_signal_groups_dropped"]
        kept, draws = row["dynamic_sampling/zero_signal_groups_kept"], row["dynamic_sampling/draws"]
        assert 0 <= draws <= 3 and 0 <= dropped + kept <= groups
        assert extra % 4 == 0 and extra <= draws * groups * 4  # whole groups of num_generations, at most the bound
        assert (draws == 0) == (extra == 0)
        assert kept == 0 or draws == 3 or extra < draws * groups * 4  # kept only when the bound or the data ran out
    assert sum(r["dynamic_sampling/zero_signal_groups_dropped"] + r["dynamic_sampling/zero_signal_groups_kept"]
               for r in rows) > 0, "the reward left some group without signal: there was something to drop"
    assert sum(r["dynamic_sampling/zero_signal_groups_dropped"] for r in rows) > 0


def spread(prompts, completions, **kwargs):
    """A second reward with spread in every group: the weighted total always has signal, so only judging by the
    scripted reward alone (train.dynamic_sampling_reward) finds the middle group without it."""
    return [0.1 * (i % 3) for i in range(len(completions))]


@pytest.mark.slow
@pytest.mark.parametrize("by", [None, "correctness"])
def test_the_hook_replaces_groups_without_signal_in_the_batch_trl_trains_on(by, tmp_path, tiny_model_dir):
    """On a real trainer and real rollouts: a generation batch of 3 groups whose middle group scores all 0 comes back
    with that group replaced by a newly drawn one with signal, in TRL's layout (every tensor 12 rows, re-padded, the
    kept groups' rows as TRL made them, num_items_in_batch recounted), and the cost logged. By the weighted total
    (TRL's test), and by one reward alone (DAPO's accuracy filter) while another reward spreads every group."""
    import torch

    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.training.grpo import build_trainer

    calls = []

    def scripted(prompts, completions, **kwargs):
        """The first rollout: groups 0 and 2 have spread, group 1 all 0; later ones: every group has spread."""
        calls.append(len(completions))
        if len(calls) == 1:
            return [float(i % 2) if i // 4 != 1 else 0.0 for i in range(len(completions))]
        return [float(i % 2) for i in range(len(completions))]

    sets = ["train.dynamic_sampling=true", "train.per_device_train_batch_size=12"]
    if by is None:
        config, funcs = load_config("tiny", [*sets, "rewards.names=[xmlcount]"]), [scripted]
    else:
        config = load_config("tiny", [*sets, "rewards.names=[xmlcount, correctness]", "rewards.weights=[1, 1]",
                                      f"train.dynamic_sampling_reward={by}"])
        funcs = [spread, scripted]
    handle = load_model(resolve(config, detect(), "hf"))
    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q[:40], config.data.system_prompt), tmp_path,
                            reward_funcs=funcs)
    assert trainer.dynamic_sampling_draws == 3 and trainer.dynamic_sampling_reward == by
    trainer.model.train()
    rows = [trainer.train_dataset[i] for i in range(3)]
    inputs = [row for row in rows for _ in range(4)]
    captured = []
    base = trainer._merged_batch

    def keep_parts(parts, chosen):
        captured.append((parts, chosen))
        return base(parts, chosen)

    trainer._merged_batch = keep_parts
    batch = trainer._generate_and_score_completions(inputs)
    assert calls == [12, 4]  # one extra group of 4 completions for the one slot without signal
    [(parts, chosen)] = captured
    assert chosen == [(0, 0), (1, 0), (0, 2)]
    from lowvram_grpo.training.trl_compat import BASE_LOGPS
    # the parts' keys, and the base's log-probs the adapter check (outermost, after the merge) scores every step
    assert set(batch) == set(parts[0]) | {BASE_LOGPS} and BASE_LOGPS not in parts[0]
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            assert value.size(0) == 12, key
    pad = trainer.processing_class.pad_token_id
    for slot, (part, group) in enumerate(chosen):
        rows_here, rows_there = slice(slot * 4, slot * 4 + 4), slice(group * 4, group * 4 + 4)
        source = parts[part]
        width = source["completion_ids"].size(1)
        assert torch.equal(batch["completion_ids"][rows_here, :width], source["completion_ids"][rows_there])
        assert (batch["completion_ids"][rows_here, width:] == pad).all()
        assert (batch["completion_mask"][rows_here, width:] == 0).all()
        prompt_width = source["prompt_ids"].size(1)
        assert torch.equal(batch["prompt_ids"][rows_here, -prompt_width:], source["prompt_ids"][rows_there])
        assert torch.equal(batch["advantages"][rows_here], source["advantages"][rows_there])
    assert batch["advantages"][4:8].abs().sum() > 0  # the new group has signal
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/extra_rollouts"] == [4.0] and metrics["dynamic_sampling/draws"] == [1.0]
    assert metrics["dynamic_sampling/zero_signal_groups_dropped"] == [1.0]
    assert metrics["dynamic_sampling/zero_signal_groups_kept"] == [0.0]


@pytest.mark.slow
def test_gspo_is_grpos_update_when_each_batch_takes_one_step(tmp_path, tiny_model_dir):
    """What docs/results.md says of the GSPO rows: with one optimizer step per generation batch (every preset here),
    TRL's old log-probs are the current ones detached, the ratio is 1, and the sequence-level loss has the token-level
    loss's value and gradient up to float rounding. On a real trainer and real rollouts: one batch, the loss and the
    LoRA gradients at importance_sampling_level token, then sequence (GSPO)."""
    import torch

    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.training.grpo import build_trainer

    def spread(prompts, completions, **kwargs):
        return [float(i % 3) for i in range(len(completions))]

    config = load_config("tiny", ["train.per_device_train_batch_size=8", "rewards.names=[xmlcount]"])
    handle = load_model(resolve(config, detect(), "hf"))
    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q[:40], config.data.system_prompt), tmp_path,
                            reward_funcs=[spread])
    assert trainer.args.steps_per_generation == 1 and trainer.args.num_iterations == 1
    trainer.model.train()
    rows = [trainer.train_dataset[i] for i in range(2)]
    batch = trainer._generate_and_score_completions([row for row in rows for _ in range(4)])
    assert batch["advantages"].abs().sum() > 0
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop before each compute_loss

    def loss_and_grads(level):
        trainer.importance_sampling_level = level
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach().clone(), [p.grad.detach().clone() for p in params]

    token_loss, token_grads = loss_and_grads("token")
    sequence_loss, sequence_grads = loss_and_grads("sequence")
    assert torch.allclose(token_loss, sequence_loss, rtol=1e-5, atol=1e-7)
    assert sum(g.abs().sum() for g in token_grads) > 0
    for a, b in zip(token_grads, sequence_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
