"""The checkpoint cadence (resolve.choose_save_steps, step_time.py): a checkpoint at least every ~15 minutes of the
estimated GRPO time on every preset and card, so a session that ends without SIGTERM's grace (a Colab teardown)
loses at most that; train.save_steps null (auto) decides it, an explicit value is kept with a note when longer."""
import dataclasses

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import profile
from lowvram_grpo.settings.resolve import CHECKPOINT_EVERY_S, resolve, span_text, without_vllm

PRESETS = sorted(p.stem for p in (REPO / "presets").glob("*.yaml"))
CARDS = ("t4", "rtx3090", "rtx4090")


def _cards(preset):
    config = load_config(preset)
    return CARDS if config.requires_cuda else (*CARDS, "cpu")


@pytest.mark.parametrize("preset, card", [(p, c) for p in PRESETS for c in _cards(p)])
def test_every_preset_checkpoints_at_least_every_15_minutes_of_its_estimate_on_every_card(preset, card):
    config = load_config(preset)
    resolved = resolve(config, profile(card))
    assert resolved.step_seconds is not None and resolved.step_seconds > 0  # every preset's model has a shape
    span = min(resolved.save_steps, config.train.max_steps) * resolved.step_seconds
    assert span <= CHECKPOINT_EVERY_S, (resolved.save_steps, resolved.step_seconds)
    assert not [n for n in resolved.notes if n.startswith("train.save_steps=")]  # no preset needs the warning
    if config.requires_cuda:  # the GPU presets leave it to the card (their runs are hours long)
        assert config.train.save_steps is None
        assert resolved.save_steps < config.train.max_steps
        assert any(n.startswith(f"train.save_steps auto -> {resolved.save_steps}: ") for n in resolved.notes)


def test_auto_is_as_many_steps_as_fit_and_slower_cards_checkpoint_sooner():
    config = load_config("llama8b_4bit")
    by_card = {card: resolve(config, profile(card)) for card in CARDS}
    for resolved in by_card.values():
        assert resolved.save_steps == int(CHECKPOINT_EVERY_S // resolved.step_seconds)  # the most that fit
    assert by_card["t4"].step_seconds > by_card["rtx3090"].step_seconds > by_card["rtx4090"].step_seconds
    assert by_card["t4"].save_steps < by_card["rtx3090"].save_steps < by_card["rtx4090"].save_steps
    short = resolve(load_config("llama8b_4bit", ["train.max_steps=3"]), profile("t4"))
    assert short.save_steps == 3  # never past the run


def test_an_explicit_save_steps_is_kept_and_a_long_one_says_what_a_stop_would_lose():
    t4 = profile("t4")
    auto = resolve(load_config("llama8b_4bit"), t4)
    long = resolve(load_config("llama8b_4bit", ["train.save_steps=250"]), t4)
    assert long.save_steps == 250 and long.step_seconds == auto.step_seconds
    (note,) = [n for n in long.notes if n.startswith("train.save_steps=")]
    hours = 250 * auto.step_seconds / 3600
    assert note.startswith(f"train.save_steps=250 is ~{hours:.1f} h of GRPO between checkpoints at "
                           f"~{auto.step_seconds:.0f} s a step (estimated for Tesla T4) "
                           "(no checkpoint before the last step)")
    assert note.endswith(f"train.save_steps={auto.save_steps} (or null, auto) checkpoints every ~15 minutes")
    short = resolve(load_config("llama8b_4bit", [f"train.save_steps={auto.save_steps}"]), t4)
    assert short.save_steps == auto.save_steps and not [n for n in short.notes if n.startswith("train.save_steps")]


def test_grpo_config_saves_at_the_decided_cadence(tmp_path):
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    for overrides in ([], ["train.save_steps=7"]):
        resolved = resolve(load_config("llama8b_4bit", overrides), profile("t4"))
        assert grpo_config_kwargs(resolved, tmp_path)["save_steps"] == resolved.save_steps
    assert grpo_config_kwargs(resolved, tmp_path)["save_steps"] == 7


def test_a_run_that_lost_unsloths_vllm_is_re_decided_for_transformers_generation():
    """unsloth came back without a vllm_engine (without_vllm): steps generate with transformers, slower, so the
    cadence is decided again (one note, the new one)."""
    resolved = resolve(load_config("llama8b_4bit"), profile("rtx4090"))
    lost = without_vllm(resolved, "unsloth loaded no vllm_engine")
    assert lost.generation == "transformers" and lost.step_seconds > resolved.step_seconds
    assert lost.save_steps < resolved.save_steps
    assert [n for n in lost.notes if n.startswith("train.save_steps")] == \
        [f"train.save_steps auto -> {lost.save_steps}: a checkpoint every "
         f"~{span_text(lost.save_steps * lost.step_seconds)} "
         f"at ~{lost.step_seconds:.0f} s a GRPO step, a conservative estimate for NVIDIA GeForce RTX 4090 "
         "(step_time.py), "
         "not measured"]


def test_a_card_not_in_the_table_is_planned_as_the_slowest_and_a_model_without_shape_saves_every_10_steps(tmp_path):
    present = dataclasses.replace(profile("rtx4090"), name="present", gpu_name="NVIDIA RTX PRO 6000")
    unknown = resolve(load_config("llama8b_4bit"), present)
    assert unknown.step_seconds > resolve(load_config("llama8b_4bit"), profile("t4")).step_seconds
    assert "NVIDIA RTX PRO 6000 (not in step_time.CARDS: planned as the slowest there)" in " ".join(unknown.notes)
    folder = tmp_path / "no-config"
    folder.mkdir()
    no_shape = resolve(load_config("smollm2_cpu", [f"model.name={folder}", "train.save_steps=null"]), profile("cpu"))
    assert no_shape.save_steps == 10 and no_shape.step_seconds is None
    assert f"train.save_steps auto -> 10: no step-time estimate for {folder}" in " ".join(no_shape.notes)


@pytest.mark.slow
def test_dry_run_says_which_save_steps_was_chosen_and_why():
    proc = run_cli("--preset", "llama8b_4bit", "--dry-run", "--gpu", "t4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = resolve(load_config("llama8b_4bit"), profile("t4"))
    assert (f"note: train.save_steps auto -> {resolved.save_steps}: a checkpoint every "
            f"~{span_text(resolved.save_steps * resolved.step_seconds)} at "
            f"~{resolved.step_seconds:.0f} s a GRPO step, a conservative estimate for Tesla T4 "
            "(step_time.py)") in proc.stdout
    assert f"checkpoint every {resolved.save_steps} GRPO step(s)" in proc.stdout
    warned = run_cli("--preset", "llama8b_4bit", "--dry-run", "--gpu", "t4", "--set", "train.save_steps=250")
    assert warned.returncode == 0 and "note: train.save_steps=250 is ~" in warned.stdout
