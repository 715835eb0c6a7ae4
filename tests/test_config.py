import dataclasses

import pytest

from lowvram_grpo.settings.config import SECTIONS, ConfigError, RunConfig, list_presets, load_config, read_preset


def test_the_presets_are_the_readmes_and_run_where_it_says():
    """The README's preset table lists exactly the shipped presets, and each resolves on the hardware its
    'runs on' column names: a CPU preset on a CPU, a GPU one refused there and resolved on a T4 (before: only
    that three names existed)."""
    import re

    from conftest import REPO
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.resolve import ResolveError, resolve

    text = (REPO / "README.md").read_text()
    table = text[text.index("## Presets"):text.index("\n## ", text.index("## Presets") + 4)]
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", table, re.MULTILINE))
    assert set(rows) == set(list_presets())
    for name, runs_on in rows.items():
        config = load_config(name)
        assert config.requires_cuda == runs_on.strip().startswith("NVIDIA GPU"), name
        if config.requires_cuda:
            with pytest.raises(ResolveError, match="needs an NVIDIA GPU"):
                resolve(config, profile("cpu"))
            assert resolve(config, profile("t4")).device == "cuda"
        else:
            assert resolve(config, profile("cpu")).device == "cpu"


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_validates(name):
    config = load_config(name)
    assert isinstance(config, RunConfig)
    assert config.preset == name
    assert read_preset(name).get("description"), "each preset says what it is for"
    # the resolved config round-trips through YAML
    import yaml

    from lowvram_grpo.settings.config import config_from_dict

    assert config_from_dict(yaml.safe_load(config.to_yaml())) == config


def test_llama8b_preset_matches_the_unsloth_notebook():
    c = load_config("llama8b_4bit")
    assert c.requires_cuda and c.memory.load_in_4bit and c.model.fast_inference
    assert (c.lora.r, c.lora.alpha) == (32, 32)
    assert set(c.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    t = c.train
    assert ((t.optim, t.learning_rate, t.adam_beta1, t.adam_beta2, t.weight_decay)
            == ("paged_adamw_8bit", 5e-6, 0.9, 0.99, 0.1))
    assert ((t.warmup_ratio, t.lr_scheduler_type, t.num_generations, t.max_grad_norm, t.max_steps)
            == (0.1, "cosine", 6, 0.1, 250))
    assert c.memory.gpu_memory_utilization == 0.6
    assert c.rewards.names == ["xmlcount", "soft_format", "strict_format", "int", "correctness"]


def test_every_field_is_documented():
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help text"


def test_overrides_are_parsed_and_typed():
    c = load_config("tiny", ["train.learning_rate=1e-4", "lora.r=4", "rewards.names=[correctness, int]",
                             "rewards.weights=[2, 1]", "memory.load_in_4bit=true", "data.dataset=x.jsonl"])
    assert c.train.learning_rate == 1e-4 and isinstance(c.train.learning_rate, float)
    assert c.lora.r == 4
    assert c.rewards.names == ["correctness", "int"] and c.rewards.weight_list == [2.0, 1.0]
    assert c.memory.load_in_4bit is True
    assert c.data.dataset == "x.jsonl"


@pytest.mark.parametrize("override,fragment", [
    ("train.nope=1", "unknown key 'train.nope'"),
    ("nosection.x=1", "unknown section 'nosection'"),
    ("train.learning_rate=fast", "train.learning_rate must be float"),
    ("lora.r=0", "lora.r must be > 0"),
    ("lora.r=2.5", "lora.r must be int"),
    ("train.num_generations=1", "num_generations must be >= 2"),
    ("train.per_device_train_batch_size=3", "must be divisible by train.num_generations"),
    ("train.max_steps=0", "train.max_steps must be >= 1"),
    ("rewards.weights=[1]", "one weight per name"),
    ("memory.gpu_memory_utilization=1.5", "gpu_memory_utilization must be in"),
    ("train.optim=sgd", "train.optim must be one of"),
    ("model.dtype=int8", "model.dtype must be one of"),
    ("memory.load_in_4bit=maybe", "memory.load_in_4bit must be bool"),
    ("justtext", "--set expects section.key=value"),
    ("train=1", "--set key must be section.key"),
])
def test_bad_values_say_how_to_fix_them(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    assert fragment in str(info.value)


def test_generation_batch_divisible_by_group_size():
    # 4 completions x 3 accumulation steps = 12, divisible by 6: valid
    c = load_config("tiny", ["train.num_generations=6", "train.per_device_train_batch_size=4",
                             "train.gradient_accumulation_steps=3"])
    assert c.train.generation_batch_size == 12
    with pytest.raises(ConfigError, match="divisible"):
        load_config("tiny", ["train.num_generations=6", "train.per_device_train_batch_size=4"])


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny"):
        load_config("nope")


def test_changing_reward_names_carries_the_presets_weights_by_name():
    """smollm2_cpu weighs its five rewards; `--set rewards.names=[...]` alone (the README's reward-file
    example) keeps each named reward's weight and gives a new name 1.0, instead of a length error."""
    preset = load_config("smollm2_cpu").rewards
    by_name = dict(zip(preset.names, preset.weights))
    changed = load_config("smollm2_cpu", ["rewards.names=[correctness, brevity, xmlcount]"]).rewards
    assert changed.weights == [by_name["correctness"], 1.0, by_name["xmlcount"]]
    for order in (["rewards.names=[correctness, int]", "rewards.weights=[1, 2]"],
                  ["rewards.weights=[1, 2]", "rewards.names=[correctness, int]"]):
        assert load_config("smollm2_cpu", order).rewards.weights == [1.0, 2.0]  # weights given: used as given
    with pytest.raises(ConfigError, match="rewards.weights has 3 values for 2 names"):
        load_config("smollm2_cpu", ["rewards.weights=[1, 2, 3]", "rewards.names=[correctness, int]"])


def test_an_unknown_reward_name_is_refused_by_the_runs_check_not_by_building_the_config():
    """Building a config runs no user code (a reward file is imported by checks.before_load, a check of the run)."""
    from lowvram_grpo.settings.checks import before_load

    config = load_config("tiny", ["rewards.names=[bogus]"])
    with pytest.raises(ConfigError, match="unknown reward 'bogus'"):
        before_load(config)


def test_building_a_config_runs_no_user_code(tmp_path):
    """A reward file runs when the run checks it, never when a config is built (auto-fit builds many)."""
    from lowvram_grpo.settings.checks import before_load

    marker = tmp_path / "imported"
    module = tmp_path / "mine.py"
    module.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef mine(prompts, completions, **kw):\n"
                      "    return [0.0] * len(completions)\n")
    config = load_config("tiny", [f"rewards.module={module}", "rewards.names=[mine, correctness]"])
    assert not marker.exists()
    before_load(config)
    assert marker.exists()
