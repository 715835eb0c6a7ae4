"""The GPU install set (requirements.txt), executed as far as a machine without a GPU allows.

CI installs exactly requirements.txt into a venv of its own (torch resolves to the CPU build; the CUDA
builds of torchvision / torchaudio / torchcodec are removed, as they break `import peft` on it) and runs
this module there with LOWVRAM_GRPO_GPU_SET=1 (.ci/run). In any other venv it skips, unless that
variable is set, when it fails: CI cannot pass it by accident.

What runs for real here: every module the package imports (the GPU path's included) and every module
the pinned unsloth_zoo looks up for our settings; vLLM 0.31's general plugins (vllm-bnb-plugin
registers "bitsandbytes"); and, for every GPU preset on every card profile, on the unsloth backend,
the hf backend and the hf backend's own vLLM engine, the objects we hand to the libraries, built from
the exact values our code computes: GRPOConfig, BitsAndBytesConfig, peft's LoraConfig, vLLM's
EngineArgs and the ModelConfig it validates, LoRAConfig, CacheConfig, SamplingParams, LoRARequest.
What stands in: the CUDA device itself (transformers' bf16-GPU check answers yes for a card whose
profile has native bf16; vLLM's sleep mode, which only a CUDA platform accepts, is left out of the
ModelConfig check). unsloth / unsloth_zoo 2026.10.9 import without a GPU (their CPU fallback), and the
RL-patched trainer runs here (tests/test_unsloth_trainer.py); their CUDA-only code on our path is read from the
installed source and, where it is a pure function (the LoRA rank rounding), run.
"""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, installed_version, require_gpu_set

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

GPU_PRESETS = ("llama8b_4bit", "qwen3b_4bit", "qwen1_5b_4bit")


PINS = require_gpu_set()  # conftest: skips outside the GPU install set, fails there under LOWVRAM_GRPO_GPU_SET=1

SITE = Path(importlib.util.find_spec("vllm").origin).parent.parent


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING"})


# --------------------------------------------------------------------------- the set itself

def test_every_pin_of_requirements_txt_is_what_isinstalled_version():
    from packaging.version import Version

    # torch 2.13.0 is the CPU build here (2.13.0+cpu): the local label is where it differs from a card's wheel
    wrong = {name: (version, installed_version(name)) for name, version in PINS.items()
             if installed_version(name) is None or Version(installed_version(name)).public != version}
    assert not wrong, f"pinned vs installed: {wrong}"


# --------------------------------------------------------------------------- imports

def _third_party_imports() -> list[str]:
    """Every module a `lowvram_grpo` module imports that is neither the standard library nor the package,
    at module level or inside a function, in the order the package's files name them."""
    found: list[str] = []
    for path in sorted((REPO / "lowvram_grpo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "lowvram_grpo" and name not in found:
                    found.append(name)
    return found


def test_every_module_the_package_imports_imports_in_the_gpu_set():
    """The package's own modules (in the order a GPU run loads them: the pipeline first, then each
    backend, training, vLLM engine), then every third-party import named anywhere in the package (a
    `from X import Y` is checked as module X.Y or attribute Y of X). unsloth stops here: it needs CUDA."""
    candidates = [n for n in _third_party_imports() if n.split(".")[0] not in ("unsloth", "unsloth_zoo")]
    candidates += ["bitsandbytes", "accelerate"]  # what transformers loads for a 4-bit base and TRL trains with
    proc = run_python(f"""
        import importlib, pkgutil
        import lowvram_grpo.run.pipeline, lowvram_grpo.run.cli                   # what the CLI imports first
        from lowvram_grpo.model.backends import prepare_backend
        prepare_backend("hf")
        for mod in ("lowvram_grpo.model.hf_backend", "lowvram_grpo.training.grpo", "lowvram_grpo.evaluate.evaluation",
                    "lowvram_grpo.model.vllm", "lowvram_grpo.model.unsloth_backend"):
            importlib.import_module(mod)
        for info in pkgutil.walk_packages(lowvram_grpo.__path__, "lowvram_grpo."):
            if not info.name.endswith("__main__"):  # that one runs the CLI
                importlib.import_module(info.name)
        missing = []
        for name in {candidates!r}:
            try:
                importlib.import_module(name)
            except ImportError:
                module, _, attribute = name.rpartition(".")
                try:
                    if not hasattr(importlib.import_module(module), attribute):
                        missing.append(name)
                except ImportError as exc:
                    missing.append(f"{{name}}: {{exc}}")
        print("MISSING", missing)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MISSING []" in proc.stdout, proc.stdout[-3000:]
    assert {"vllm", "trl", "peft", "transformers"} <= {n.split(".")[0] for n in candidates}


def test_unsloth_imports_on_a_cpu_and_its_rl_module_patches_trls_grpo_trainer():
    """unsloth 2026.10.9 imports without a GPU (its CPU fallback, whose namespace has no PatchFastRL), and its
    RL module, which needs triton (in this set), replaces TRL's GRPOTrainer with the generated class a GPU run
    trains with; backends.unsloth_backend.prepare() does exactly this (tests/test_unsloth_trainer.py trains with it)."""
    proc = run_python("""
        import unsloth, trl
        print("CPU_PATCHFASTRL", hasattr(unsloth, "PatchFastRL"), "STOCK", trl.GRPOTrainer.__name__)
        from lowvram_grpo.model.unsloth_backend import patched_trainer_problem, prepare
        prepare()
        print("PATCHED", trl.GRPOTrainer.__name__, trl.GRPOTrainer.__module__, patched_trainer_problem())
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no GPU found, training on CPU" in proc.stdout
    assert "CPU_PATCHFASTRL False STOCK GRPOTrainer" in proc.stdout
    assert "PATCHED UnslothGRPOTrainer UnslothGRPOTrainer None" in proc.stdout


def _string_tuples(path: Path, marker: str) -> list[tuple[str, ...]]:
    """Tuples of strings in `path`'s source that contain `marker` (the module lookups unsloth_zoo loops over)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                               for e in node.elts):
            values = tuple(e.value for e in node.elts)
            if any(marker in v for v in values):
                out.append(values)
    return out


def test_the_bitsandbytes_modules_unsloth_zoo_looks_up_for_4bit_fast_inference_import():
    """Defect: unsloth_zoo's load_vllm raises "vLLM >= 0.28 moved bitsandbytes out of tree. Install it with
    `pip install vllm-bnb-plugin`" for load_in_4bit with fast_inference (every GPU preset) unless one of
    the modules it tries imports; requirements.txt lacked the plugin."""
    lookups = (_string_tuples(SITE / "unsloth_zoo" / "vllm_utils.py", "bitsandbytes")
               + _string_tuples(SITE / "unsloth_zoo" / "empty_model.py", "bitsandbytes"))
    assert len(lookups) >= 2, lookups
    for paths in lookups:
        assert any(p.startswith("vllm_bnb_plugin.") for p in paths), paths  # the >= 0.28 location is among them
        proc = run_python(f"""
            import importlib
            for path in {paths!r}:
                try:
                    importlib.import_module(path)
                    print("IMPORTED", path)
                    break
                except ImportError:
                    continue
        """)
        assert "IMPORTED vllm_bnb_plugin." in proc.stdout, (paths, proc.stderr[-2000:])


def test_vllm_knows_bitsandbytes_only_through_the_plugin():
    proc = run_python("""
        from vllm.model_executor.layers import quantization
        before = "bitsandbytes" in quantization.QUANTIZATION_METHODS
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        print("BEFORE", before, "AFTER", "bitsandbytes" in quantization.QUANTIZATION_METHODS)
    """)
    assert "BEFORE False AFTER True" in proc.stdout, proc.stderr[-2000:]


# --------------------------------------------------------------------------- every preset on every card

@pytest.fixture(scope="module")
def combos():
    """(preset, profile, path, resolved) for every GPU preset on every CUDA card profile, on the unsloth
    backend, the hf backend and the hf backend's own vLLM engine; paths a card refuses are listed as such."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.core.errors import ResolveError
    from lowvram_grpo.settings.hardware import PROFILES
    from lowvram_grpo.settings.resolve import resolve

    out, refused = [], []
    for preset in GPU_PRESETS:
        for name, hardware in PROFILES.items():
            if not hardware.cuda:
                continue
            for path, backend, overrides in (("unsloth", "unsloth", []), ("hf", "hf", []),
                                             ("hf+vllm", "hf", ["model.generation=vllm"])):
                try:
                    out.append((preset, name, path, resolve(load_config(preset, overrides), hardware, backend)))
                except ResolveError as exc:
                    refused.append((preset, name, path, str(exc)))
    return out, refused


def test_only_the_v100_refuses_a_path(combos):
    _, refused = combos
    assert {(name, path) for _, name, path, _ in refused} == {("v100-16gb", "hf+vllm")}
    assert all("compute capability >= 7.5" in why for *_, why in refused)


@pytest.fixture
def bf16_capable_card(monkeypatch):
    """transformers' bf16 check asks the device; the profiles planned for have native bf16 where resolve says bf16."""
    import transformers.training_args as training_args

    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)


def test_grpo_config_is_built_from_our_values_on_every_card(combos, tmp_path, bf16_capable_card):
    from trl import GRPOConfig

    from lowvram_grpo.training.grpo import grpo_config_kwargs

    for preset, name, path, resolved in combos[0]:
        args = GRPOConfig(**grpo_config_kwargs(resolved, tmp_path))
        assert (args.bf16, args.fp16) == (resolved.bf16, resolved.fp16), (preset, name, path)
        assert args.optim.value == resolved.optim == "paged_adamw_8bit" and not args.use_cpu
        assert args.use_vllm == (resolved.generation == "unsloth_vllm"), (preset, name, path)


def test_bitsandbytes_and_lora_configs_of_the_hf_backend(combos):
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from lowvram_grpo.model.hf_backend import quantization_kwargs

    for preset, name, path, resolved in combos[0]:
        if path == "unsloth":
            continue
        bnb = BitsAndBytesConfig(**quantization_kwargs(resolved))
        assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4"
        assert bnb.bnb_4bit_compute_dtype == getattr(torch, resolved.dtype)
        lora = LoraConfig(**resolved.plan.model.lora_kwargs())
        model = resolved.plan.model
        assert lora.r == model.lora_r and set(lora.target_modules) == set(model.lora_target_modules)


def _model_dir(tmp_path: Path, shape, name: str) -> Path:
    """A config.json of the preset's architecture with its shape (the weights are not needed to validate)."""
    from transformers import LlamaConfig, Qwen2Config

    folder = tmp_path / re.sub(r"\W", "_", name)
    if not folder.is_dir():
        cls, context = (Qwen2Config, 32768) if "qwen" in name.lower() else (LlamaConfig, 131072)
        cls(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate, vocab_size=shape.vocab,
            tie_word_embeddings=shape.tied_embeddings, max_position_embeddings=context).save_pretrained(folder)
    return folder


def test_the_hf_backends_vllm_engine_arguments_validate_in_vllm(combos, tmp_path):
    """EngineArgs from exactly what LocalVLLMEngine passes to LLM(...), and the configs it builds without a device."""
    from vllm.config import CacheConfig, LoRAConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm import SamplingParams as VLLMSamplingParams

    from lowvram_grpo.model.handle import SamplingParams
    from lowvram_grpo.model.vllm import engine_kwargs, eval_sampling_kwargs, rollout_sampling_kwargs, settings_for
    checked = 0
    for preset, name, path, resolved in combos[0]:
        if path != "hf+vllm":
            continue
        run = resolved.plan
        shape = run.model.facts.require_shape()  # the run's shape, derived once
        settings = settings_for(resolved, shape, str(_model_dir(tmp_path, shape, run.model.name)))
        kwargs = engine_kwargs(settings)
        assert kwargs["quantization"] == "bitsandbytes" and kwargs["enable_sleep_mode"]
        kwargs.pop("enable_sleep_mode")  # only a CUDA platform accepts it
        engine_args = EngineArgs(**kwargs)
        model = engine_args.create_model_config()
        assert (model.quantization, model.max_model_len, model.logprobs_mode) == (
            "bitsandbytes", run.model.max_seq_length, "processed_logprobs"), (preset, name)
        LoRAConfig(max_lora_rank=kwargs["max_lora_rank"], max_loras=kwargs["max_loras"])
        cache = CacheConfig(gpu_memory_utilization=kwargs["gpu_memory_utilization"],
                            kv_cache_memory_bytes=kwargs["kv_cache_memory_bytes"])
        assert 0 < cache.gpu_memory_utilization <= 0.95 and cache.kv_cache_memory_bytes == settings.kv_cache_bytes
        t = run.train
        VLLMSamplingParams(**rollout_sampling_kwargs(t.num_generations, temperature=t.grpo.temperature,
                                                     top_p=t.grpo.top_p, top_k=None, min_p=None,
                                                     max_tokens=t.max_completion_length, stop_token_ids=[2], seed=7))
        ev = run.eval
        VLLMSamplingParams(**eval_sampling_kwargs(SamplingParams(ev.temperature, ev.top_p, t.max_completion_length,
                                                                 ev.seed), [2]))
        LoRARequest(lora_name="policy-v1", lora_int_id=1, lora_path=str(tmp_path))
        checked += 1
    assert checked == len(GPU_PRESETS) * 9  # every card but the V100


def test_the_lora_rank_vllm_refuses_is_rounded_up_before_it_gets_there(combos):
    """Defect: r=24 reached LoRAConfig(max_lora_rank=24), which vLLM 0.31 refuses."""
    from pydantic import ValidationError
    from vllm.config import LoRAConfig

    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.resolve import VLLM_LORA_RANKS, resolve

    with pytest.raises(ValidationError):
        LoRAConfig(max_lora_rank=24)
    import typing

    import vllm.config.lora

    assert tuple(typing.get_args(vllm.config.lora.MaxLoRARanks)) == VLLM_LORA_RANKS
    r24 = resolve(load_config("qwen1_5b_4bit", ["lora.r=24", "lora.alpha=24", "model.generation=vllm"]),
                  profile("rtx4090"), "hf")
    LoRAConfig(max_lora_rank=r24.vllm_max_lora_rank)


# --------------------------------------------------------------------------- unsloth, read from its source

def _function_source(path: Path, name: str) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(path.read_text(), node)
    raise AssertionError(f"{name} not in {path}")


def test_our_lora_rank_rounding_is_unsloth_zoos_run_on_the_installed_vllm():
    """unsloth_zoo's get_lora_supported_ranks / determine_max_lora_rank, executed from its source."""
    from lowvram_grpo.settings.resolve import vllm_lora_rank

    source = SITE / "unsloth_zoo" / "vllm_utils.py"
    namespace = {"re": re, "inspect": __import__("inspect")}
    for name in ("get_lora_supported_ranks", "determine_max_lora_rank"):
        exec(_function_source(source, name), namespace)
    for r in range(1, 513):
        assert vllm_lora_rank(r) == namespace["determine_max_lora_rank"](r), r


def test_the_dtype_we_pass_unsloth_passes_its_assert_and_is_not_changed(combos):
    """unsloth's from_pretrained asserts float16/bfloat16/float32 and turns bfloat16 into float16 where the
    card lacks it: we pass bf16 only where native, so the dtype unsloth loads is the one we resolved."""
    import torch

    from lowvram_grpo.model.unsloth_backend import from_pretrained_kwargs

    source = (SITE / "unsloth" / "models" / "loader.py").read_text()
    assert "assert dtype in (torch.float16, torch.bfloat16, torch.float32)" in source
    assert "elif dtype == torch.bfloat16 and not SUPPORTS_BFLOAT16 and not xpu_keeps_explicit_bf16():" in source
    for preset, name, path, resolved in combos[0]:
        if path != "unsloth":
            continue
        kwargs = from_pretrained_kwargs(resolved, resolved.plan.model.name)
        assert kwargs["dtype"] in (torch.float16, torch.bfloat16, torch.float32)
        assert kwargs["dtype"] != torch.bfloat16 or resolved.hardware.bf16_native, (preset, name)
        if resolved.fast_inference:
            assert kwargs["max_lora_rank"] == resolved.vllm_max_lora_rank


def test_unsloths_grpo_patch_turns_trls_importance_sampling_off_and_the_line_it_replaces_exists():
    """Why resolve.choose_is_correction sets it explicitly: unsloth's GRPOConfig defaults
    vllm_importance_sampling_correction to False and its trainer patch disables TRL's correction block, whose line must
    exist in TRL 1.15 for the patch to apply at all."""
    rl = (SITE / "unsloth" / "models" / "rl.py").read_text()
    assert '"vllm_importance_sampling_correction": False,' in rl
    replacements = (SITE / "unsloth" / "models" / "rl_replacements.py").read_text()
    line = "if self.use_vllm and self.vllm_importance_sampling_correction:"
    assert f'string_to_find = "{line}"' in replacements
    assert f'replacement_string = "if False and {line[3:]}"' in replacements
    assert line in (SITE / "trl" / "trainer" / "grpo_trainer.py").read_text()
