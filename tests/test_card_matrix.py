"""Every GPU preset on every card profile, executed without the card (tests/card_matrix.py, tests/virtual_card.py):
each cell passes, or the package refuses that preset on that card with one `error:` line (exit 2), never a crash
inside unsloth, vLLM or ours; docs/gpu.md shows the matrix the code makes. Runs in CI's GPU-set stage
(LOWVRAM_GRPO_GPU_SET=1 LOWVRAM_GRPO_NO_SKIPS=1); the matrix itself once per session (a process per card).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import require_gpu_set

PINS = require_gpu_set()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import card_matrix, standin_checkpoints, virtual_card  # noqa: E402


@pytest.fixture(scope="module")
def matrix():
    return card_matrix.run_matrix()


def test_virtual_cards_are_the_package_profiles():
    """A virtual card for every GPU profile resolve knows, with what the card reports."""
    from lowvram_grpo.settings.hardware import PROFILES

    assert set(virtual_card.CARDS) == {name for name, hw in PROFILES.items() if hw.cuda}
    for name, card in virtual_card.CARDS.items():
        assert card.capability == PROFILES[name].compute_capability and card.total_gib == PROFILES[name].total_gib
        assert card.sm_count > 0 and card.driver_cuda.split(".")[0] in ("12", "13")
        assert card.bf16 == PROFILES[name].bf16_native
        assert card.fp8 == (card.capability >= (8, 9))


def _undefined(library: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}


def _defined(library: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if len(line.split()) == 3}


def test_stand_in_driver_serves_every_entry_vllm_extensions_link():
    """The stubs define every symbol vLLM 0.31's compiled extensions take from the driver and from a CUDA torch:
    with them, the real extensions load (and a symbol a new vLLM asks for fails here, named)."""
    import importlib.util

    torch_lib = Path(importlib.util.find_spec("torch").origin).parent / "lib"
    vllm_dir = Path(importlib.util.find_spec("vllm").origin).parent
    with tempfile.TemporaryDirectory() as tmp:
        stubs = virtual_card.build_stubs(Path(tmp))
        provided = set()
        for library in [*torch_lib.glob("lib*.so*"), *stubs.glob("lib*.so*"), virtual_card.cuda_runtime_dir()
                        / "libcudart.so.13"]:
            provided |= _defined(library)
        extensions = [p for p in vllm_dir.glob("*.so") if "libcuda.so.1" in subprocess.run(
            ["objdump", "-p", str(p)], capture_output=True, text=True).stdout]
        assert extensions, "no vLLM extension links libcuda.so.1: the stand-in driver would not be needed"
        for extension in extensions:
            wanted = {s for s in _undefined(extension) if s.startswith(("cu", "torch_", "aoti_torch_cuda", "cublas"))}
            assert not wanted - provided, f"{extension.name} needs {sorted(wanted - provided)} from the stand-ins"
        env = virtual_card.process_environment(stubs)
        loaded = subprocess.run([sys.executable, "-c", "import torch, vllm._C_stable_libtorch, vllm.cumem_allocator"],
                                env=env, capture_output=True, text=True, timeout=300)
        assert loaded.returncode == 0, loaded.stderr[-2000:]


def test_standins_keep_the_real_architecture():
    """Each stand-in is its fixture's real config scaled in width and depth only."""
    for folder in sorted(p for p in standin_checkpoints.FIXTURES.iterdir() if p.is_dir()):
        real = json.loads((folder / "config.json").read_text())
        small = standin_checkpoints.scaled_config(real)
        assert small["architectures"] == real["architectures"]
        text, small_text = real.get("text_config", real), small.get("text_config", small)
        for key in ("model_type", "vocab_size", "sliding_window", "rope_theta", "rope_scaling",
                    "max_position_embeddings"):
            assert small_text.get(key) == text.get(key), (folder.name, key)
        assert small.get("tie_word_embeddings", small_text.get("tie_word_embeddings")) == real.get(
            "tie_word_embeddings", text.get("tie_word_embeddings")), folder.name
        if text.get("layer_types"):
            assert set(small_text["layer_types"]) == set(text["layer_types"]), folder.name
            assert text["layer_types"][:len(small_text["layer_types"])] == small_text["layer_types"]
        assert ("vision_config" in small) == ("vision_config" in real)
        assert small_text["hidden_size"] < text["hidden_size"]


def test_fixtures_are_the_models_the_plan_knows():
    """The committed config.json of each GPU preset's model gives the shape model_shapes records for that model
    (KNOWN_SHAPES, each number's source in SHAPE_SOURCES): the fixtures are the real configs, not guesses."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.model_shapes import KNOWN_SHAPES, _known_key, shape_from_config

    compared = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied_embeddings", "dim_per_head",
                "context", "family", "layer_types", "sliding_window", "linear_attention", "extra_params")
    for spec in card_matrix.gpu_presets():
        name = load_config(card_matrix.split(spec)[0]).model.name
        real = json.loads((standin_checkpoints.fixture(name) / "config.json").read_text())
        shape, known = shape_from_config(real, name), KNOWN_SHAPES[_known_key(name)]
        for field in compared:
            assert getattr(shape, field) == getattr(known, field), (name, field, getattr(shape, field))
    assert (standin_checkpoints.FIXTURES / "SOURCES.md").exists()


def test_every_preset_on_every_card_runs_or_is_refused(matrix):
    """The acceptance: each cell runs through the engine config, the load, LoRA and the first tokenization, or the
    dry-run refuses it with one `error:` line and exit 2; no crash inside unsloth, vLLM or ours."""
    cells = {(c["preset"], c["card"]) for c in matrix}
    assert cells == {(p, card) for p in card_matrix.gpu_presets() for card in virtual_card.CARDS}
    for cell in matrix:
        assert cell["injected"] == list(virtual_card.INJECTED), cell["injected"]
        dry = cell["dry_run"]
        assert dry["rc"] in (0, 2), (cell["preset"], cell["card"], dry)
        if dry["rc"] == 2:
            assert len(dry["errors"]) == 1 and dry["stderr_lines"] == 1, (cell["preset"], cell["card"], dry)
    crashes = [f"{c['preset']} on {c['card']}: {card_matrix.verdict(c)}" for c in matrix if c["outcome"] == "crash"]
    assert not crashes, "\n".join(crashes)
    for cell in matrix:  # the one stop by name before the end: a vision-language model's processor without torchvision
        if cell["outcome"] == "stopped":
            assert cell["stopped"]["why"] == card_matrix.NO_TORCHVISION_LOAD and not _has_torchvision(), cell
    assert {c["outcome"] for c in matrix} <= {"runs", "refused", "stopped"}


def _has_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def test_docs_show_the_matrix(matrix):
    """docs/gpu.md's card matrix is the one the code makes: python tests/card_matrix.py --write."""
    assert card_matrix.shown() == card_matrix.table(matrix), "docs/gpu.md's card matrix differs: " \
        "python tests/card_matrix.py --write"
