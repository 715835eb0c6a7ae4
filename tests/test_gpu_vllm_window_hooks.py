"""What the lent card's window (bench/gpu_vllm_window.py) observes of unsloth + vLLM, read from the pinned GPU set's
source (nothing imported: unsloth's import on a CPU keeps vLLM's CUDA build from importing, so the observer cannot
be run here): the functions it wraps exist with the arguments it reads, unsloth looks them up when it calls them
(a wrapper installed before the load is the one called), vLLM's LoRA manager is unsloth_zoo's class, TRL's rollouts
call `LLM.generate`, and every config field engine_facts reads is a field of the pinned vLLM.

Runs in the GPU install set (requirements.txt: CI's GPU-set stage, LOWVRAM_GRPO_GPU_SET=1, no skips there); skips
elsewhere. The same names in vLLM 0.26.0 were read from its wheel (docs/gpu.md)."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from conftest import require_gpu_set

pytestmark = pytest.mark.slow
PINS = require_gpu_set()  # conftest: skips outside the GPU install set, fails there under LOWVRAM_GRPO_GPU_SET=1


def tree(package: str, relative: str) -> ast.Module:
    """The AST of `relative` inside the installed top-level `package`, found through its distribution's files: no
    code of it runs, and it is found also in a process where unsloth's import has blocked `import vllm` (find_spec
    then answers None: an xdist worker that ran an unsloth test first)."""
    import importlib.metadata

    return ast.parse(Path(importlib.metadata.distribution(package).locate_file(package), relative).read_text())


def functions(node) -> dict:
    return {n.name: n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def classes(node) -> dict:
    return {n.name: n for n in ast.walk(node) if isinstance(n, ast.ClassDef)}


def imports_inside_functions(module: ast.Module, source: str, name: str) -> tuple[int, int]:
    """(imports of `name` from `source` inside a function body, at module level)."""
    inside = {id(n) for f in functions(module).values() for n in ast.walk(f)}
    found = [n for n in ast.walk(module) if isinstance(n, ast.ImportFrom) and n.module == source
             and any(a.name == name for a in n.names)]
    return sum(id(n) in inside for n in found), sum(id(n) not in inside for n in found)


def test_unsloth_looks_up_load_vllm_and_load_lora_when_it_calls_them():
    """FastLanguageModel.from_pretrained imports load_vllm inside its body, and patch_peft_fast_inference binds
    `model.load_lora = functools.partial(load_lora, model)` after importing it there: the observer's wrappers, put on
    unsloth_zoo.vllm_utils before the model loads, are the functions unsloth calls."""
    llama = tree("unsloth", "models/llama.py")
    assert imports_inside_functions(llama, "unsloth_zoo.vllm_utils", "load_vllm") == (1, 0)
    utils = tree("unsloth", "models/_utils.py")
    inside, module_level = imports_inside_functions(utils, "unsloth_zoo.vllm_utils", "load_lora")
    assert inside >= 1 and module_level == 0
    patch = functions(utils)["patch_peft_fast_inference"]
    binds = [n for n in ast.walk(patch) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "model.load_lora"]
    assert [ast.unparse(n.value) for n in binds] == ["functools.partial(load_lora, model)"]
    for name in ("load_vllm", "load_lora"):  # no module of unsloth's binds them at its import
        for path in ("models/llama.py", "models/_utils.py", "models/loader.py", "models/vision.py", "models/rl.py"):
            assert imports_inside_functions(tree("unsloth", path), "unsloth_zoo.vllm_utils", name)[1] == 0, (path, name)


def test_the_observed_functions_take_the_arguments_the_observer_reads():
    zoo = functions(tree("unsloth_zoo", "vllm_utils.py"))
    load_vllm = [a.arg for a in zoo["load_vllm"].args.args]
    for keyword in ("config", "gpu_memory_utilization", "max_seq_length", "max_lora_rank", "use_bitsandbytes",
                    "enforce_eager", "float8_kv_cache", "unsloth_vllm_standby"):
        assert keyword in load_vllm, keyword
    assert [a.arg for a in zoo["load_lora"].args.args][:3] == ["model", "save_directory", "load_tensors"]
    manager = classes(tree("unsloth_zoo", "vllm_lora_worker_manager.py"))["WorkerLoRAManager"]
    assert "_load_adapter" in functions(manager)
    # vLLM's LoRA manager is unsloth_zoo's class once unsloth patches it (what the observer wraps)
    source = ast.unparse(tree("unsloth_zoo", "vllm_utils.py"))
    assert "vllm.lora.worker_manager.WorkerLoRAManager = PatchedWorkerLoRAManager" in source
    llm = classes(tree("vllm", "entrypoints/llm.py"))["LLM"]
    assert {"generate", "chat"} <= set(functions(llm))
    assert "self.llm_engine = " in ast.unparse(functions(llm)["__init__"])
    engine = classes(tree("vllm", "v1/engine/llm_engine.py"))["LLMEngine"]
    assert "self.vllm_config = vllm_config" in ast.unparse(functions(engine)["__init__"])
    outputs = classes(tree("vllm", "outputs.py"))
    assert "token_ids" in ast.unparse(outputs["CompletionOutput"]) and "self.outputs = outputs" in ast.unparse(
        outputs["RequestOutput"])
    calls = [ast.unparse(n.func) for n in ast.walk(tree("trl", "generation/vllm_generation.py"))
             if isinstance(n, ast.Call)]
    assert "self.llm.generate" in calls  # TRL's rollouts: the call the observer times


@pytest.mark.parametrize("relative, cls, fields", [
    ("config/cache.py", "CacheConfig", ("gpu_memory_utilization", "num_gpu_blocks", "block_size")),
    ("config/model.py", "ModelConfig", ("max_model_len", "quantization", "enforce_eager")),
    ("config/scheduler.py", "SchedulerConfig", ("max_num_seqs",)),
    ("config/compilation.py", "CompilationConfig", ("mode", "cudagraph_mode")),
])
def test_engine_facts_reads_fields_of_the_pinned_vllm(relative, cls, fields):
    node = classes(tree("vllm", relative))[cls]
    annotated = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert set(fields) <= annotated, set(fields) - annotated
