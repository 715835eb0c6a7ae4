"""host_memory.py: the LM head gets a contiguous input (same samples), malloc_trim hands freed heap pages
back to the OS, the trainer releases after each step, and LOWVRAM_GRPO_HOST_MEMORY=off turns both off.
Speed and the whole job's RSS are measured in bench/host_memory.py, not asserted here."""
import ctypes
import ctypes.util
import os
import sys

import pytest

from lowvram_grpo.core import host_memory
from lowvram_grpo.model.backends import SamplingParams, load_model
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import resolve

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

PROMPTS = [[{"role": "user", "content": "What is 7 * 8?"}],
           [{"role": "user", "content": "A farmer has 3 cows and buys 12 more. How many cows?"}]]


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_lm_head_gets_a_contiguous_input_and_sampling_is_unchanged(monkeypatch, tiny_model_dir):
    """transformers' generate (decode.loop=transformers) passes the LM head a strided view in its prefill; the hook
    makes it contiguous. (Our decode loop asks for the last position's logits only.)"""
    config = load_config("tiny", ["decode.loop=transformers"])
    monkeypatch.setenv("LOWVRAM_GRPO_HOST_MEMORY", "off")
    plain = load_model(resolve(config, detect(), "hf"))
    monkeypatch.delenv("LOWVRAM_GRPO_HOST_MEMORY")
    hooked = load_model(resolve(config, detect(), "hf"))

    contiguous = []
    for handle in (plain, hooked):
        head = handle.model.get_base_model().get_output_embeddings()
        head.register_forward_pre_hook(
            lambda mod, args, h=handle: contiguous.append((h is hooked, args[0].is_contiguous())))
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=3)
    assert plain.fast_generate(PROMPTS, params) == hooked.fast_generate(PROMPTS, params)
    assert any(not ok for is_hooked, ok in contiguous if not is_hooked), "the prefill passes a strided view unhooked"
    assert all(ok for is_hooked, ok in contiguous if is_hooked)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"), reason="glibc only")
def test_release_returns_freed_heap_pages_to_the_os(monkeypatch):
    monkeypatch.delenv("LOWVRAM_GRPO_HOST_MEMORY", raising=False)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 * 1024, 4096  # 256 MB of heap blocks (below glibc's mmap threshold)
    blocks = [libc.malloc(block) for _ in range(count)]
    for address in blocks:
        ctypes.memset(address, 1, block)  # resident
    kept = blocks[15::16]  # every 16th stays alive: the freed runs between them are holes, not the heap's top
    for i, address in enumerate(blocks):
        if i % 16 != 15:
            libc.free(address)
    try:
        before = _rss_mb()
        assert host_memory.release() is True
        after = _rss_mb()
        assert before - after > 150, f"RSS {before:.0f} -> {after:.0f} MB: the ~240 MB of freed holes stayed resident"
    finally:
        for address in kept:
            libc.free(address)


def test_off_turns_both_off(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("LOWVRAM_GRPO_HOST_MEMORY", "off")
    assert host_memory.release() is False
    assert not any(host_memory.enabled(feature) for feature in host_memory.FEATURES)
    monkeypatch.setenv("LOWVRAM_GRPO_HOST_MEMORY", "trim")
    assert host_memory.enabled("trim") and not host_memory.enabled("head")


def test_the_trainer_releases_after_each_step(tmp_path, tiny_model_dir, monkeypatch):
    """A real 2-step GRPO training on the tiny model: host_memory.release runs once at the end of each step,
    after that step's optimizer update (the trainer's global_step already counts it)."""
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.training.grpo import build_trainer

    config = load_config("tiny", ["train.max_steps=2", "eval.enabled=false", "train.save_steps=1000"])
    handle = load_model(resolve(config, detect(), "hf"))
    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q, config.data.system_prompt), tmp_path)
    released_at = []
    real_release = host_memory.release

    def release():
        released_at.append(trainer.state.global_step)
        return real_release()

    monkeypatch.setattr(host_memory, "release", release)
    trainer.train()
    assert trainer.state.global_step == 2
    assert released_at == [1, 2]


_KERNEL_CACHE_PROBE = """
import torch
from lowvram_grpo.model.backends import load_model
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import resolve

load_model(resolve(load_config("tiny"), detect(), "hf"))  # the product's path: the cap is set as the model loads
weight = torch.randn(64, 64, dtype=torch.bfloat16)
for rows in [5] + list(range(6, 30)) + [5]:  # one shape, 24 others, the first again
    (torch.randn(rows, 64, dtype=torch.bfloat16) @ weight).sum()
"""


def _probe_creations(env_update: dict) -> list:
    """oneDNN's primitive creations of the probe's first shape (5x64:64x64), in order: cache_miss or cache_hit."""
    import subprocess

    env = {**os.environ, "ONEDNN_VERBOSE": "2", **env_update}
    env = {k: v for k, v in env.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", _KERNEL_CACHE_PROBE], env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout
    return [line.split(",")[3].split(":")[1] for line in out.splitlines()
            if line.startswith("onednn_verbose") and ",primitive,create:" in line and ",5x64:64x64," in line]


def test_loading_the_model_caps_onednns_kernel_cache(tiny_model_dir):
    """A fresh process that loads a model through load_model keeps 8 oneDNN primitives: the first shape is built
    again after 24 others. With the cap off (LOWVRAM_GRPO_HOST_MEMORY without kernel_cache), or a size the user set,
    oneDNN's own 1024 keep it. Each in its own process: oneDNN reads the size once, at its first primitive."""
    unset = dict.fromkeys(host_memory.KERNEL_CACHE_ENVS)
    capped = _probe_creations({"LOWVRAM_GRPO_HOST_MEMORY": None, **unset})
    if not capped:
        pytest.skip("bf16 matmuls do not run through oneDNN on this CPU (the cap has nothing to act on)")
    assert capped == ["cache_miss", "cache_miss"]
    assert _probe_creations({"LOWVRAM_GRPO_HOST_MEMORY": "head,trim", **unset}) == [
        "cache_miss", "cache_hit"]
    assert _probe_creations({"LOWVRAM_GRPO_HOST_MEMORY": None, **unset, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}) == [
        "cache_miss", "cache_hit"]


def test_limit_kernel_caches_keeps_the_users_value_and_the_switch(monkeypatch):
    monkeypatch.delenv("LOWVRAM_GRPO_HOST_MEMORY", raising=False)
    environ = {}
    assert host_memory.limit_kernel_caches(environ) == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"]
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "8"}
    environ = {"LRU_CACHE_CAPACITY": "256"}
    assert host_memory.limit_kernel_caches(environ) == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "256"}
    monkeypatch.setenv("LOWVRAM_GRPO_HOST_MEMORY", "head,trim")
    environ = {}
    assert host_memory.limit_kernel_caches(environ) == [] and environ == {}
