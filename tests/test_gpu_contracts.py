"""The CUDA path's calls into unsloth, unsloth_zoo, vLLM and TRL, checked against the source of the
wheels requirements.txt pins (no GPU, nothing installed or imported: tests/pinned_wheels.py).

No machine this project is built on has a GPU, so the unsloth 4-bit + vLLM branch has never run. What
can be checked without one is that every keyword we pass is a parameter the pinned release really
has: an explicit named parameter or dataclass/msgspec field, not one its `**kwargs` would swallow (a
renamed keyword would vanish there silently; unsloth's GRPOConfig even drops unknown keys on purpose,
unsloth/models/rl_config_compat.py). The keywords come from our own builders (`from_pretrained_kwargs`,
`get_peft_model_kwargs`, `EXPORTS`, `vllm_sampling_kwargs`, `vllm_generate_kwargs`, `load_lora_kwargs`,
`token_prompts`, `training.grpo_config_kwargs`), built for every GPU preset on every CUDA hardware
profile; how many arguments go positionally is read from our call sites (the AST of
lowvram_grpo/model/unsloth_backend.py), so a call site that stops using its builder fails here too.

TrainingArguments (GRPOConfig's base) is read from the transformers wheel at requirements.txt's pin
(downloaded like the others, ~12 MB); a cross-check compares the fields found that way with the
installed trl/transformers when those are at the same pins.

First run downloads ~367 MB (vllm's wheel is 320 MB) into LOWVRAM_GRPO_WHEEL_CACHE (default
~/.cache/lowvram_grpo/wheels) from the index pip is configured with; later runs read the cache. Without
the index (and no cached wheels) the module skips, and fails in CI (LOWVRAM_GRPO_CI=1, set by .ci/run, or
CI=true); a pin the index does not have fails.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pinned_wheels import (Found, PinnedWheels, RegistryUnreachable, WheelNotFound, check_keywords, fetch,
                           read_pins, registry_required)

from lowvram_grpo.training import grpo as training
from lowvram_grpo.model import unsloth_backend
from lowvram_grpo.model.handle import SamplingParams
from lowvram_grpo.settings.config import list_presets, load_config
from lowvram_grpo.settings.hardware import PROFILES
from lowvram_grpo.settings.resolve import ResolveError, resolve

pytestmark = [pytest.mark.slow, pytest.mark.network]  # pytest.ini: the fast tier is -m "not slow"

PACKAGES = ("unsloth", "unsloth_zoo", "vllm", "trl", "transformers")
BACKEND = Path(unsloth_backend.__file__)
TRAINING = Path(training.__file__)
GPU_PRESETS = [name for name in list_presets() if load_config(name).requires_cuda]
CUDA_PROFILES = [name for name, hardware in PROFILES.items() if hardware.cuda]


@pytest.fixture(scope="module")
def wheels() -> PinnedWheels:
    try:
        return PinnedWheels.fetch(PACKAGES)
    except RegistryUnreachable as exc:
        unreachable(f"the package index is unreachable, so the pinned GPU wheels cannot be fetched: {exc}")


def unreachable(reason: str):
    """Skip, or in CI fail: there a green run must have checked the pins against the wheels."""
    if registry_required():
        pytest.fail(f"{reason} (in CI this fails rather than skips)", pytrace=False)
    pytest.skip(reason)


def resolved_all(backend: str):
    """(label, Resolved) for every GPU preset on every CUDA profile where resolve() accepts it."""
    out = []
    for preset in GPU_PRESETS:
        config = load_config(preset)
        for profile in CUDA_PROFILES:
            try:
                out.append((f"{preset} on {profile} ({backend})", resolve(config, PROFILES[profile], backend)))
            except ResolveError:
                continue
    return out


def each_resolved(backends, check) -> str:
    """Runs `check(resolved) -> problems` for every resolved combination; the problems, each once, with
    the combinations it holds for (empty if none)."""
    seen: dict[str, list[str]] = {}
    for backend in backends:
        for label, resolved in resolved_all(backend):
            for problem in check(resolved):
                seen.setdefault(problem, []).append(label)
    return "\n".join(f"{problem}\n    for {len(labels)} preset/card combination(s): {', '.join(labels[:4])}"
                     f"{', ...' if len(labels) > 4 else ''}" for problem, labels in seen.items())


def test_there_is_something_to_check():
    assert GPU_PRESETS and CUDA_PROFILES
    for backend in ("unsloth", "hf"):
        labels = [label for label, _ in resolved_all(backend)]
        for preset in GPU_PRESETS:  # every GPU preset resolves on at least one card
            assert any(label.startswith(f"{preset} on ") for label in labels), (preset, backend)
    assert any(r.fast_inference for _, r in resolved_all("unsloth"))  # the vLLM branch is among them


# --------------------------------------------------------------------------- our call sites (AST of our code)

def _our_calls(path: Path, function: str | None = None) -> list[ast.Call]:
    tree = ast.parse(path.read_text(), filename=str(path))
    scopes = [n for n in ast.walk(tree)
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function] \
        if function else [tree]
    return [n for scope in scopes for n in ast.walk(scope) if isinstance(n, ast.Call)]


def call_sites(path: Path, builder: str) -> list[ast.Call]:
    """Every call in `path` that takes `**builder(...)`, or `**name` where `name = builder(...)` in the same
    function."""
    def is_builder(node) -> bool:
        return isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == builder

    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for scope in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        names = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and is_builder(n.value)
                 for t in n.targets if isinstance(t, ast.Name)}  # `kwargs = builder(...)` in this function
        found += [c for c in ast.walk(scope) if isinstance(c, ast.Call) for k in c.keywords
                  if k.arg is None and (is_builder(k.value) or (isinstance(k.value, ast.Name) and k.value.id in names))]
    found = list({id(c): c for c in found}.values())  # a nested function's call is walked from its parents too
    assert found, f"{path.name}: no call takes **{builder}(...)"
    return found


def call_site(path: Path, builder: str) -> ast.Call:
    """The one call in `path` that takes the output of `builder`."""
    found = call_sites(path, builder)
    assert len(found) == 1, (f"{path.name}: expected one call taking **{builder}(...), "
                             f"found {[ast.unparse(c) for c in found]}")
    return found[0]


def test_our_call_sites_use_the_builders():
    """What the checks below assume about our calls, read from our code (so a change there shows up here)."""
    expected = {  # builder: (what the call's target ends with, how many arguments go positionally)
        "from_pretrained_kwargs": ("FastLanguageModel.from_pretrained", 0),
        "get_peft_model_kwargs": ("FastLanguageModel.get_peft_model", 1),  # the model
        "vllm_sampling_kwargs": ("VLLMSamplingParams", 0),
        "vllm_generate_kwargs": (".fast_generate", 1),  # the prompts
        "load_lora_kwargs": (".load_lora", 0),  # the model is bound by unsloth's functools.partial
    }
    for builder, (func, positional) in expected.items():
        call = call_site(BACKEND, builder)
        assert ast.unparse(call.func).endswith(func) and len(call.args) == positional, ast.unparse(call)
    assert {ast.unparse(c.func) for c in call_sites(TRAINING, "grpo_config_kwargs")} == {"grpo_config"}  # each site
    # ... and grpo_config hands all of them to GRPOConfig (then puts back the bf16 unsloth's CPU fallback drops)
    (wrapper,) = [n for n in ast.walk(ast.parse(TRAINING.read_text())) if isinstance(n, ast.FunctionDef)
                  and n.name == "grpo_config"]
    assert [ast.unparse(c) for c in ast.walk(wrapper) if isinstance(c, ast.Call)
            and ast.unparse(c.func) == "GRPOConfig"] == ["GRPOConfig(**asked)"]
    # vLLM's prompts are our token_prompts(...) (TokensPrompt dicts)
    assert ast.unparse(call_site(BACKEND, "vllm_generate_kwargs").args[0]).startswith("token_prompts(")
    # export(): saver(str(directory), tokenizer, **kwargs) with (method, kwargs) = EXPORTS[kind]
    savers = [c for c in _our_calls(BACKEND, "export") if any(k.arg is None for k in c.keywords)]
    assert [(ast.unparse(c.func), len(c.args)) for c in savers] == [("saver", 2)]
    # our `from vllm import SamplingParams as VLLMSamplingParams`
    imports = [n for n in ast.walk(ast.parse(BACKEND.read_text()))
               if isinstance(n, ast.ImportFrom) and n.module == "vllm"]
    assert any((a.name, a.asname) == ("SamplingParams", "VLLMSamplingParams") for n in imports for a in n.names)


# --------------------------------------------------------------------------- the pins and the fetching

def test_pins_come_from_requirements_txt(wheels):
    pins = read_pins(REPO / "requirements.txt")
    for name in PACKAGES:
        wheel = wheels[name]
        assert wheel.version == pins[name.replace("_", "-")]
        assert wheel.path.name.lower().startswith(f"{name}-{wheel.version}-".lower()), wheel.path.name
    assert "manylinux" in wheels["vllm"].path.name and wheels["vllm"].path.name.endswith("x86_64.whl")


def test_a_version_the_registry_lacks_fails_and_an_unreachable_registry_skips(tmp_path, wheels):
    """An index that does not answer is RegistryUnreachable (an explicit index is asked alone, not pip's
    configured ones); a version the configured index lacks is WheelNotFound."""
    with pytest.raises(RegistryUnreachable):
        fetch("trl", read_pins()["trl"], cache=tmp_path, index_url="http://127.0.0.1:9/simple")
    try:
        fetch("unsloth", "0.0.0.999", cache=tmp_path)
    except RegistryUnreachable:  # a cached run, offline: nothing to learn here
        unreachable("registry unreachable")
    except WheelNotFound as exc:
        assert "unsloth==0.0.0.999" in str(exc)
    else:
        pytest.fail("fetching unsloth==0.0.0.999 did not fail")


def _fake_wheel(folder: Path, name: str, version: str) -> Path:
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def test_fetch_uses_the_index_pip_is_configured_with(tmp_path, monkeypatch):
    """pip's configuration (here its environment: PIP_NO_INDEX + PIP_FIND_LINKS, a local folder) is where the
    wheels come from, not a hard-wired PyPI (`pip --isolated` ignored it: failed before). No network."""
    links = tmp_path / "links"
    links.mkdir()
    _fake_wheel(links, "lowvram_grpo_fake_pin", "1.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    got = fetch("lowvram_grpo_fake_pin", "1.0", cache=tmp_path / "cache")
    assert got.name == "lowvram_grpo_fake_pin-1.0-py3-none-any.whl" and got.parent == tmp_path / "cache"
    with pytest.raises(WheelNotFound, match="lowvram_grpo_fake_pin==2.0"):  # the index answered: not there
        fetch("lowvram_grpo_fake_pin", "2.0", cache=tmp_path / "cache")


def test_an_unreachable_index_fails_in_ci(monkeypatch):
    """.ci/run sets LOWVRAM_GRPO_CI=1: there the registry is required (a skip would pass CI unchecked)."""
    for env in ({"LOWVRAM_GRPO_CI": "1"}, {"CI": "true"}):
        monkeypatch.delenv("CI", raising=False)
        monkeypatch.delenv("LOWVRAM_GRPO_CI", raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(pytest.fail.Exception, match="fails rather than skips"):
            unreachable("the package index is unreachable")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("LOWVRAM_GRPO_CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        unreachable("the package index is unreachable")


# --------------------------------------------------------------------------- the checker itself

def test_the_checker_reports_a_misspelled_keyword(wheels):
    """A keyword swallowed by **kwargs is reported, named with the call and where it came from."""
    target = wheels.find("unsloth", "unsloth/models/loader.py", "FastLanguageModel.from_pretrained")
    label, resolved = resolved_all("unsloth")[0]
    kwargs = unsloth_backend.from_pretrained_kwargs(resolved, "some/model")
    assert check_keywords("FastLanguageModel.from_pretrained", target, kwargs, origin="test") == []
    kwargs["fast_inferance"] = kwargs.pop("fast_inference")
    problems = check_keywords("FastLanguageModel.from_pretrained", target, kwargs, origin="a test dict")
    assert len(problems) == 1, problems
    for part in (f"FastLanguageModel.from_pretrained (unsloth {wheels['unsloth'].version}, unsloth/models/loader.py) "
                 "has no parameter 'fast_inferance'", "its **kwargs would swallow it",
                 "did it become 'fast_inference'", "we pass it from a test dict"):
        assert part in problems[0], problems[0]
    # a dataclass's fields, and a required parameter not given
    config = wheels.find("trl", "trl/__init__.py", "GRPOConfig")
    problems = check_keywords("GRPOConfig", config, {"output_dir": "x", "max_prompt_lenght": 1}, origin="t",
                              accepted=wheels.fields(config))
    assert len(problems) == 1 and "'max_prompt_lenght'" in problems[0]
    load_lora = wheels.find("unsloth_zoo", "unsloth_zoo/vllm_utils.py", "load_lora")
    problems = check_keywords("load_lora", load_lora, {"load_tensors": False}, origin="t", positional=1)
    assert problems and "requires 'save_directory'" in problems[0]


def test_the_fields_read_from_the_wheels_match_the_installed_classes(wheels):
    """The AST reader against Python's own dataclasses, on the two packages installed here at the same pins
    (trl, transformers): GRPOConfig's init fields, inherited ones included. In a fresh interpreter, so no
    unsloth patch of trl (other tests import unsloth) is in the way."""
    code = ("import dataclasses, json, trl, transformers\n"
            "from trl.trainer.grpo_config import GRPOConfig\n"
            "print(json.dumps([trl.__version__, transformers.__version__, "
            "sorted(f.name for f in dataclasses.fields(GRPOConfig) if f.init)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trl_version, transformers_version, installed = json.loads(proc.stdout.strip().splitlines()[-1])
    if (trl_version, transformers_version) != (wheels["trl"].version, wheels["transformers"].version):
        pytest.skip(f"installed trl {trl_version} / transformers {transformers_version} are not the pinned ones")
    found = wheels.fields(wheels.find("trl", "trl/__init__.py", "GRPOConfig"))
    assert sorted(found) == installed


# --------------------------------------------------------------------------- unsloth

def test_from_pretrained_takes_our_keywords(wheels):
    """FastLanguageModel.from_pretrained (the class we call; FastModel has another from_pretrained)."""
    target = wheels.find("unsloth", "unsloth/models/loader.py", "FastLanguageModel.from_pretrained")
    # the dtypes its `assert dtype is None or dtype == torch.float16 or ...` allows
    asserts = [n for n in ast.walk(target.node) if isinstance(n, ast.Assert) and "dtype is None" in ast.unparse(n.test)]
    assert asserts, f"{target.where}: the dtype assert is gone"
    allowed = {a.attr for n in asserts for a in ast.walk(n.test)
               if isinstance(a, ast.Attribute) and ast.unparse(a.value) == "torch"}
    def check(resolved):
        kwargs = unsloth_backend.from_pretrained_kwargs(resolved, "some/model")
        problems = check_keywords("FastLanguageModel.from_pretrained", target, kwargs,
                                  origin="unsloth_backend.from_pretrained_kwargs")
        dtype = kwargs.get("dtype")
        if dtype is not None and str(dtype).replace("torch.", "") not in allowed:
            problems.append(f"dtype={dtype} is not one {target.where} accepts ({sorted(allowed)})")
        return problems

    problems = each_resolved(["unsloth"], check)
    assert not problems, problems


def test_get_peft_model_takes_our_keywords(wheels):
    """FastLanguageModel.get_peft_model is (model, *args, **kwargs) and forwards them to
    FastLlamaModel.get_peft_model, whose named parameters are what counts."""
    outer = wheels.find("unsloth", "unsloth/models/loader.py", "FastLanguageModel.get_peft_model")
    forwards = [n for n in ast.walk(outer.node) if isinstance(n, ast.Call)
                and any(isinstance(a, ast.Starred) for a in n.args) and any(k.arg is None for k in n.keywords)]
    assert "FastLlamaModel.get_peft_model" in [ast.unparse(n.func) for n in forwards], \
        f"{outer.where}: FastLanguageModel.get_peft_model no longer forwards to FastLlamaModel.get_peft_model"
    target = wheels.find("unsloth", "unsloth/models/loader.py", "FastLlamaModel.get_peft_model")
    positional = len(call_site(BACKEND, "get_peft_model_kwargs").args)
    problems = each_resolved(["unsloth"], lambda resolved: check_keywords(
        "FastLlamaModel.get_peft_model (via FastLanguageModel.get_peft_model)", target,
        unsloth_backend.get_peft_model_kwargs(resolved), origin="unsloth_backend.get_peft_model_kwargs",
        positional=positional))
    assert not problems, problems


def test_patch_fast_rl_and_fast_language_model_are_top_level(wheels):
    """`import unsloth; unsloth.PatchFastRL("GRPO", unsloth.FastLanguageModel)` (unsloth_backend.prepare)."""
    patch = wheels.find("unsloth", "unsloth/__init__.py", "PatchFastRL")
    ours = [c for c in _our_calls(BACKEND, "prepare") if ast.unparse(c.func) == "patch"]
    assert [ast.unparse(a) for c in ours for a in c.args] == ["'GRPO'", "unsloth.FastLanguageModel"], \
        [ast.unparse(c) for c in ours]
    params = patch.params
    assert len(params.named) >= 2 and not params.required, f"{patch.where}: PatchFastRL{params}"
    assert wheels.find("unsloth", "unsloth/__init__.py", "FastLanguageModel").member == "unsloth/models/loader.py"


def _assignments(found: Found, attribute: str) -> list[ast.Assign]:
    """`<x>.<attribute> = ...` statements inside a definition."""
    return [n for n in ast.walk(found.node) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Attribute) and t.attr == attribute]


def _calls(found: Found, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(found.node) if isinstance(n, ast.Call) and ast.unparse(n.func) == name]


def test_savers_are_attached_and_take_our_keywords(wheels):
    """EXPORTS: model.<method>(str(directory), tokenizer, **kwargs) on the PEFT model from get_peft_model.
    unsloth/save.py's patch_saving_functions binds the method (`_bind_saving_method(func, model, name)`,
    a types.MethodType); FastLlamaModel.get_peft_model -> patch_peft_model -> patch_saving_functions(model)."""
    peft = wheels.find("unsloth", "unsloth/models/loader.py", "FastLlamaModel.get_peft_model")
    assert _calls(peft, "FastLlamaModel.patch_peft_model"), \
        f"{peft.where}: get_peft_model no longer calls patch_peft_model"
    patch_peft = wheels.find("unsloth", "unsloth/models/loader.py", "FastLlamaModel.patch_peft_model")
    assert _calls(patch_peft, "patch_saving_functions"), f"{patch_peft.where}: no patch_saving_functions(model)"
    binder = wheels.find("unsloth", "unsloth/save.py", "patch_saving_functions")
    quants = [n for n in ast.walk(wheels["unsloth"].tree("unsloth/save.py")) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "ALLOWED_QUANTS" for t in n.targets)]
    allowed_quants = {k.value for n in quants for k in n.value.keys if isinstance(k, ast.Constant)}
    positional = 1 + len([c for c in _our_calls(BACKEND, "export") if any(k.arg is None for k in c.keywords)][0].args)
    problems = []
    for kind, (method, kwargs) in unsloth_backend.EXPORTS.items():
        bound = [a.value for a in _assignments(binder, method)
                 if isinstance(a.value, ast.Call) and ast.unparse(a.value.func) == "_bind_saving_method"]
        if not bound:
            problems.append(f"{binder.where}: patch_saving_functions attaches no model.{method} (EXPORTS[{kind!r}])")
            continue
        for func_name in sorted({ast.unparse(b.args[0]) for b in bound}):
            target = wheels.find("unsloth", "unsloth/save.py", func_name)
            problems += check_keywords(f"model.{method} = {func_name}", target, kwargs,
                                       origin=f"unsloth_backend.EXPORTS[{kind!r}]", positional=positional)
        if "quantization_method" in kwargs and kwargs["quantization_method"] not in allowed_quants:
            problems.append(f"EXPORTS[{kind!r}]: quantization_method={kwargs['quantization_method']!r} is not in "
                            f"unsloth/save.py's ALLOWED_QUANTS")
    assert allowed_quants, "unsloth/save.py: ALLOWED_QUANTS not found"
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- vLLM through unsloth

def test_fast_generate_is_the_vllm_engines_generate(wheels):
    """unsloth sets `model.fast_generate = model.vllm_engine.generate` when it loads vLLM
    (FastLlamaModel.from_pretrained, unsloth/models/llama.py), and get_peft_model's patch_peft_fast_inference
    copies it (and attaches load_lora) onto the PEFT model we hold (unsloth/models/_utils.py)."""
    loader = wheels.find("unsloth", "unsloth/models/loader.py", "FastLlamaModel.from_pretrained")
    assert "model.vllm_engine.generate" in [ast.unparse(a.value) for a in _assignments(loader, "fast_generate")], \
        loader.where
    assert "llm" in [ast.unparse(a.value) for a in _assignments(loader, "vllm_engine")], loader.where
    copy = wheels.find("unsloth", "unsloth/models/llama.py", "patch_peft_fast_inference")
    assert "model.model.fast_generate" in [ast.unparse(a.value) for a in _assignments(copy, "fast_generate")], \
        copy.where
    partials = [ast.unparse(a.value) for a in _assignments(copy, "load_lora")]
    assert "functools.partial(load_lora, model)" in partials, (copy.where, partials)
    imported = [n for n in ast.walk(copy.node)
                if isinstance(n, ast.ImportFrom) and any(a.name == "load_lora" for a in n.names)]
    assert [n.module for n in imported] == ["unsloth_zoo.vllm_utils"], copy.where
    peft = wheels.find("unsloth", "unsloth/models/loader.py", "FastLlamaModel.patch_peft_model")
    assert _calls(peft, "patch_peft_fast_inference"), peft.where


def test_vllm_generate_takes_our_keywords(wheels, tiny_model_dir):
    """model.fast_generate(token_prompts(...), **vllm_generate_kwargs(...)) is vllm's LLM.generate(self, prompts, ...),
    and our prompts are TokensPrompt dicts (vllm/inputs/llm.py)."""
    from transformers import AutoTokenizer

    target = wheels.find("vllm", "vllm/__init__.py", "LLM.generate")
    assert target.member == "vllm/entrypoints/llm.py", target.where
    positional = 1 + len(call_site(BACKEND, "vllm_generate_kwargs").args)  # self, prompts
    sampling = object()  # the SamplingParams instance is passed through as it is
    for lora in (None, object()):
        kwargs = unsloth_backend.vllm_generate_kwargs(sampling, lora)
        problems = check_keywords("LLM.generate (model.fast_generate)", target, kwargs,
                                  origin="unsloth_backend.vllm_generate_kwargs", positional=positional)
        assert not problems, "\n".join(problems)
        assert kwargs.get("lora_request") is lora  # the adapter really reaches vLLM
    prompt = wheels.find("vllm", "vllm/inputs/__init__.py", "TokensPrompt")
    fields = wheels.fields(prompt)
    required = {name for name in fields for n in prompt.node.body
                if isinstance(n, ast.AnnAssign) and n.target.id == name
                and "NotRequired" not in ast.unparse(n.annotation)}
    assert "prompt_token_ids" in required, prompt.where
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = unsloth_backend.token_prompts(tokenizer, ["What is 7 * 8?", "hi"])
    for item in prompts:
        assert set(item) <= set(fields), f"{prompt.where}: TokensPrompt has no {sorted(set(item) - set(fields))}"
        assert required <= set(item), f"TokensPrompt requires {sorted(required - set(item))}"
        assert all(isinstance(t, int) for t in item["prompt_token_ids"]) and item["prompt_token_ids"]


def test_vllm_sampling_params_take_our_keywords(wheels):
    """vllm.SamplingParams(**vllm_sampling_kwargs(params)): a msgspec Struct whose fields are its __init__'s."""
    target = wheels.find("vllm", "vllm/__init__.py", "SamplingParams")
    assert target.member == "vllm/sampling_params.py", target.where
    assert "msgspec.Struct" in wheels.base_names(target)
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in target.node.body), target.where
    fields = wheels.fields(target)
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_p=1.0, max_tokens=8, seed=3)):
        kwargs = unsloth_backend.vllm_sampling_kwargs(params)
        problems = check_keywords("vllm.SamplingParams", target, kwargs, origin="unsloth_backend.vllm_sampling_kwargs",
                                  accepted=fields)
        assert not problems, "\n".join(problems)


def test_load_lora_takes_our_keywords_and_builds_a_vllm_lora_request(wheels):
    """model.load_lora(**load_lora_kwargs(path)) is functools.partial(unsloth_zoo.vllm_utils.load_lora, model);
    from a path (load_tensors=False) it builds LoRARequest(str(id), id, save_directory) positionally, which
    must be vLLM's (lora_name, lora_int_id, lora_path) and the same in unsloth_zoo's patched LoRARequest
    (patch_vllm swaps it into vllm.lora.request)."""
    target = wheels.find("unsloth_zoo", "unsloth_zoo/vllm_utils.py", "load_lora")
    assert len(call_site(BACKEND, "load_lora_kwargs").args) == 0
    kwargs = unsloth_backend.load_lora_kwargs(Path("/some/adapter"))
    problems = check_keywords("model.load_lora = functools.partial(load_lora, model)", target, kwargs,
                              origin="unsloth_backend.load_lora_kwargs", positional=1)
    assert not problems, "\n".join(problems)
    assert kwargs.get("load_tensors", False) is False  # vLLM reads the saved adapter from disk
    build = wheels.find("unsloth_zoo", "unsloth_zoo/vllm_utils.py", "_build_lora_request")
    requests = [n for n in ast.walk(build.node) if isinstance(n, ast.Call) and ast.unparse(n.func) == "LoRARequest"]
    imports = [n for n in ast.walk(build.node)
               if isinstance(n, ast.ImportFrom) and any(a.name == "LoRARequest" for a in n.names)]
    assert [n.module for n in imports] == ["vllm.lora.request"], build.where
    vllm_request = wheels.find("vllm", "vllm/lora/request.py", "LoRARequest")
    zoo_request = wheels.find("unsloth_zoo", "unsloth_zoo/vllm_lora_request.py", "LoRARequest")
    vllm_fields, zoo_fields = list(wheels.fields(vllm_request)), list(wheels.fields(zoo_request))
    path_calls = [c for c in requests if not c.keywords]
    assert path_calls, f"{build.where}: no positional LoRARequest(name, id, path) call left"
    for call in requests:
        n = len(call.args)
        assert vllm_fields[:n] == zoo_fields[:n], (vllm_fields[:n], zoo_fields[:n])
        for key in (k.arg for k in call.keywords):
            assert key in zoo_fields, f"{build.where}: LoRARequest({key}=...) is no field of unsloth_zoo's LoRARequest"
    for call in path_calls:
        named = dict(zip(vllm_fields, (ast.unparse(a) for a in call.args)))
        assert named.get("lora_path") == "save_directory", (build.where, named)
        assert set(named) == {"lora_name", "lora_int_id", "lora_path"}, named


# --------------------------------------------------------------------------- TRL

def test_grpo_config_takes_our_keywords(wheels):
    """Every key of training.grpo_config_kwargs is a field of TRL's GRPOConfig (trl/trainer/grpo_config.py,
    with _BaseConfig and transformers' TrainingArguments). Under unsloth, a key that is not would be
    dropped with a printed line (unsloth/models/rl_config_compat.filter_config_init_kwargs), not refused."""
    config = wheels.find("trl", "trl/__init__.py", "GRPOConfig")
    fields = wheels.fields(config)
    assert "output_dir" in fields and "num_generations" in fields  # inherited and own fields both read
    problems = each_resolved(["unsloth", "hf"], lambda resolved: check_keywords(
        "GRPOConfig", config, training.grpo_config_kwargs(resolved, Path("/tmp/out")),
        origin="training.grpo_config_kwargs", accepted=fields))
    assert not problems, problems


def test_unsloths_patches_of_trls_vllm_generation_match_trl(wheels):
    """unsloth (rl_replacements.vllm_generation_init_patch) rewrites TRL's VLLMGeneration._init_vllm so that
    TRL reuses `model.vllm_engine` instead of starting a second vLLM with a second copy of the weights, and
    sync_weights so it pushes nothing (the weights are shared). It finds both by regex; if either misses,
    it restores all three methods and TRL builds its own engine. Its patterns, applied to TRL's source."""
    patch = wheels.find("unsloth", "unsloth/models/rl_replacements.py", "vllm_generation_init_patch")
    patterns = {}
    for node in ast.walk(patch.node):
        if isinstance(node, ast.FunctionDef) and node.name in ("patch_init_vllm", "patch_sync_weights"):
            compiled = [c for c in ast.walk(node) if isinstance(c, ast.Call) and ast.unparse(c.func) == "re.compile"]
            patterns[node.name] = ast.literal_eval(compiled[0].args[0])
    assert set(patterns) == {"patch_init_vllm", "patch_sync_weights"}, patch.where
    for method, pattern in (("_init_vllm", "patch_init_vllm"), ("sync_weights", "patch_sync_weights")):
        source = wheels.find("trl", "trl/generation/vllm_generation.py", f"VLLMGeneration.{method}").source()
        assert re.compile(patterns[pattern], re.MULTILINE).search(source), \
            f"unsloth's {pattern} regex does not match TRL {wheels['trl'].version}'s VLLMGeneration.{method}"


def test_gpu_presets_name_ids_unsloth_maps_to_pre_quantized_4bit(wheels):
    """Defect 9: the presets use Unsloth's ungated 16-bit ids; with load_in_4bit, unsloth's mapper
    (unsloth/models/mapper.py, FLOAT_TO_INT_MAPPER built from INT_TO_FLOAT_MAPPER) points each at a
    pre-quantized bnb-4bit repo, which is what the preset comments say it downloads."""
    tree = wheels["unsloth"].tree("unsloth/models/mapper.py")
    mapper = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "__INT_TO_FLOAT_MAPPER" for t in node.targets))
    table = ast.literal_eval(mapper)
    for preset in GPU_PRESETS:
        config = load_config(preset)
        if not config.memory.load_in_4bit:
            continue  # a 16-bit preset (gemma3_1b, qwen3_5_0_8b) loads its own id: no pre-quantized repo
        name = config.model.name
        keys = [key for key, values in table.items()
                for group in (values.values() if isinstance(values, dict) else [values])
                if name in group]
        assert keys, f"{preset}: unsloth {wheels['unsloth'].version}'s mapper has no pre-quantized repo for {name}"
        assert all(key.endswith("bnb-4bit") for key in keys), keys
        comment = (REPO / "presets" / f"{preset}.yaml").read_text()
        assert any(key in comment for key in keys), f"{preset}: the comment should name {keys}"


def test_vllm_versions_that_serve_bitsandbytes_in_tree_match_unsloth_zoo(wheels):
    """A 4-bit base with vLLM needs vllm-bnb-plugin only from vLLM 0.28 on; before that, vLLM's own bitsandbytes
    serves it, and unsloth_zoo imports that one "for vLLM <= 0.27.1" (vllm_utils.py and empty_model.py name both
    paths). The lent H100's image could only take vLLM 0.26 (torch 2.11): a check that asked every vLLM for the
    plugin refused the run there before it started. Our boundary, set against the versions unsloth_zoo names."""
    from lowvram_grpo.settings.hardware import vllm_has_in_tree_bitsandbytes

    for member, in_tree in (("unsloth_zoo/vllm_utils.py", "vllm.model_executor.layers.quantization.bitsandbytes"),
                            ("unsloth_zoo/empty_model.py", "vllm.model_executor.model_loader.bitsandbytes_loader")):
        source = wheels["unsloth_zoo"].source(member)
        named = re.search(re.escape(f'"{in_tree}",') + r"\s*#\s*vLLM <= (\d+\.\d+\.\d+)", source)
        assert named, f"unsloth_zoo {wheels['unsloth_zoo'].version}'s {member} no longer names {in_tree}'s vLLM range"
        last = named.group(1)
        major, minor, _ = map(int, last.split("."))
        assert vllm_has_in_tree_bitsandbytes(last) and not vllm_has_in_tree_bitsandbytes(f"{major}.{minor + 1}.0")
    assert not vllm_has_in_tree_bitsandbytes(read_pins()["vllm"])   # the pin (0.31) needs the plugin
