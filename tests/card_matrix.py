"""Every GPU preset on every card profile, executed without the card: one process per card (tests/virtual_card.py puts
the card in place), each preset a cell run through the real code as far as a CPU allows.

    python tests/card_matrix.py                 # the table (runs every card: a few minutes)
    python tests/card_matrix.py --write         # put it into docs/gpu.md between the markers
    python tests/card_matrix.py --card t4       # one card's cells as JSON lines (what the table is made from)

Run with the GPU install set (requirements.txt: unsloth, unsloth_zoo, vLLM 0.31) and gcc. A cell's stages, in order:
1. dry-run: `python -m lowvram_grpo.run --preset P --dry-run --gpu C` (its own process): exit 0 with the plan, or 2
   with one `error:` line (then the cell is "refused" and stops);
2. install and resolve: the install set `driver_fit.fit_install` picks for the card's host driver (a set whose torch
   has no kernels for the card is a crash there: SET_KERNELS), and `resolve(load_config(P), planning_hardware(config,
   C))`, as the dry-run decides;
3. engine: unsloth's GPU loader `FastLanguageModel.from_pretrained(**from_pretrained_kwargs(resolved, stand-in))` with
   the preset's settings (fast_inference on), through unsloth_zoo's real `load_vllm` to vLLM's `LLM(...)`, where the
   stand-in engine builds vLLM 0.31's real engine config (`EngineArgs(...).create_engine_config()`: dtype validation,
   cache config with the KV dtype, max_model_len, LoRA, quantization) and asks vLLM's attention selector for the
   backend of the model's attention layers (the real model's head size and heads) on the card's capability and KV dtype;
   then stops: "the engine's allocation on the card" is where a CPU cannot go on;
4. load: the same `from_pretrained` with fast_inference off (with it on, unsloth rebuilds the model from the engine's
   weights, which the stand-in engine does not hold): the model class unsloth picks and what it returns as tokenizer;
5. peft: `FastLanguageModel.get_peft_model(model, **get_peft_model_kwargs(resolved))` (the preset's target modules);
6. tokenize: the first prompt the way the package tokenizes it: `data.prompt_tokens` (prompt filtering) and
   `unsloth_backend.token_prompts` (vLLM's token prompts) on the chat template's text, through what the loader returned.
Any exception in 3-6 is a crash of that cell (named by its stage); the table says which.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DOC = REPO / "docs" / "gpu.md"
BEGIN = "<!-- card matrix: python tests/card_matrix.py --write -->"
END = "<!-- end of card matrix -->"
STAGES = ("dry-run", "install", "resolve", "engine", "load", "peft", "tokenize")
STOP = "the engine's allocation on the card"


NO_TORCHVISION = ("not run: vLLM's module for this vision-language model imports torchvision, which this install "
                  "of the GPU set lacks (.ci/run removes the CUDA build of it: it breaks `import peft` on a CPU torch)")


NO_TORCHVISION_LOAD = ("unsloth's GPU loader goes for the model's vision processor (AutoProcessor) and refuses without "
                       "torchvision, which this install of the GPU set lacks")


def _vision_without_torchvision(real_config: dict) -> bool:
    import importlib.util

    return "vision_config" in real_config and importlib.util.find_spec("torchvision") is None


# Cells beyond the presets as written: "preset:key=value" runs the preset with that --set (one override).
VARIANTS = ("qwen1_5b_4bit:model.kv_cache_dtype=fp8",)  # an fp8 KV cache asked for, on every card (issue 65, 3.)


# The compute capabilities each pinned install set's torch 2.13 build carries kernels for (torch.cuda.get_arch_list()
# of the CUDA 13.0, 12.9 and 12.6 builds: PyTorch's RELEASE.md compatibility matrix; the 12.8+ builds dropped
# Maxwell, Pascal and Volta). Keyed by driver_fit's set names; a CPU set runs nothing on the card.
SET_KERNELS = {"cuda13": ((7, 5), (12, 1)), "cuda12": ((7, 5), (12, 0)), "cuda126": ((5, 0), (9, 0))}


def install_stage(card: str) -> dict:
    """The install set driver_fit picks for the card's host driver (and the card, where driver_fit reads it), and
    whether that set's torch has kernels for the card: a set without them fails at the first CUDA op."""
    import dataclasses

    from lowvram_grpo.settings import driver_fit
    from tests.virtual_card import CARDS

    vc = CARDS[card]
    extra = ({"compute_capability": vc.capability}
             if "compute_capability" in {f.name for f in dataclasses.fields(driver_fit.Driver)} else {})
    fit = driver_fit.fit_install(driver_fit.Driver(vc.driver_version, vc.driver_cuda, **extra))
    kernels = SET_KERNELS.get(fit.name)
    out = {"set": fit.name, "driver": f"{vc.driver_version} (CUDA {vc.driver_cuda})"}
    if kernels is not None and not kernels[0] <= vc.capability <= kernels[1]:
        low, high = (f"sm{major}{minor}" for major, minor in kernels)
        out["no_kernels"] = (f"driver_fit gives {fit.name} for driver {vc.driver_version} (CUDA {vc.driver_cuda}), "
                             f"whose torch has kernels for {low}-{high}, not the card's {vc.sm}")
    return out


def gpu_presets() -> list[str]:
    """Every GPU preset (requires_cuda), then VARIANTS."""
    from lowvram_grpo.settings.config import list_presets, load_config

    return [p for p in list_presets() if load_config(p).requires_cuda] + list(VARIANTS)


def split(spec: str) -> tuple[str, list[str]]:
    """("preset", [override]) of a cell's spec "preset" or "preset:key=value"."""
    preset, _, override = spec.partition(":")
    return preset, [override] if override else []


def _one_line(exc: BaseException) -> str:
    """The exception's first line; for a pydantic validation error (vLLM's configs), its header and the reason."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and "validation error" in lines[0]:
        lines = [f"{lines[0]}: {lines[1].split(' [type=')[0]}"]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        for package in ("vllm", "unsloth_zoo", "unsloth", "transformers", "lowvram_grpo", "peft"):
            if f"/{package}/" in frame.filename:
                return f"{package}/{frame.filename.split(f'/{package}/', 1)[1]}:{frame.lineno} {frame.name}"
    last = frames[-1] if frames else None
    return f"{last.filename}:{last.lineno}" if last else "?"


def dry_runs(card: str, presets: list[str]) -> dict:
    """1. Each preset's dry-run on `card`, in processes of their own (started together)."""
    def command(spec):
        preset, overrides = split(spec)
        sets = [arg for o in overrides for arg in ("--set", o)]
        return [sys.executable, "-m", "lowvram_grpo.run", "--preset", preset, *sets, "--dry-run", "--gpu", card]

    procs = {p: subprocess.Popen(command(p),
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in presets}
    out = {}
    for preset, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        out[preset] = {"rc": proc.returncode, "errors": errors, "stderr_lines": len(stderr.splitlines()),
                       "last": (stdout.strip().splitlines() or [""])[-1]}
    return out


class Engine:
    """vllm.LLM's stand-in (virtual_card 7.): the real engine config and attention backend, then EngineBuilt."""

    def __init__(self):
        self.seen: dict = {}
        self.real_config: dict = {}

    def __call__(self, **engine_args):
        import torch
        from vllm import EngineArgs
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend

        from tests.virtual_card import EngineBuilt

        self.seen["args"] = {k: engine_args.get(k) for k in ("dtype", "kv_cache_dtype", "max_model_len", "quantization",
                                                              "enable_lora", "max_lora_rank", "gpu_memory_utilization")}
        config = EngineArgs(**engine_args).create_engine_config()
        model = config.model_config
        self.seen["config"] = {"dtype": str(model.dtype).replace("torch.", ""), "max_model_len": model.max_model_len,
                               "kv_cache_dtype": config.cache_config.cache_dtype,
                               "quantization": model.quantization,
                               "max_lora_rank": config.lora_config.max_lora_rank if config.lora_config else None,
                               "architecture": model.architectures[0] if model.architectures else None}
        text = self.real_config.get("text_config", self.real_config)
        heads = text["num_attention_heads"]
        head_size = text.get("head_dim") or text["hidden_size"] // heads
        kinds = sorted(set(text.get("layer_types") or ["full_attention"]) - {"linear_attention"})
        backends = {}
        with set_current_vllm_config(config):
            for kind in kinds:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(model.dtype)
                try:
                    backend = get_attn_backend(head_size, model.dtype, config.cache_config.cache_dtype,
                                               num_heads=heads, has_sliding_window=kind == "sliding_attention")
                finally:
                    torch.set_default_dtype(previous)
                backends[kind] = backend.get_name()
        self.seen["attention"] = backends
        raise EngineBuilt


def _tokenize(tokenizer, config) -> dict:
    """6. The first prompt through what the loader returned, the way the package tokenizes prompts."""
    from lowvram_grpo.model.unsloth_backend import token_prompts
    from lowvram_grpo.task.data import arithmetic_problems, prompt_of, prompt_tokens

    prompt = prompt_of(arithmetic_problems(1, seed=0)[0], config.data.system_prompt)
    counted = prompt_tokens(tokenizer, prompt)
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    ids = token_prompts(tokenizer, [text])[0]["prompt_token_ids"]
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        raise TypeError(f"token_prompts gave {type(ids).__name__} {str(ids)[:80]}, not a list of token ids")
    if counted != len(ids):
        raise AssertionError(f"data.prompt_tokens counted {counted} tokens where token_prompts gives {len(ids)}: the "
                             "prompt-length filter counts another thing than what vLLM is fed")
    return {"tokens": len(ids)}


def cell(preset: str, card: str, standins: Path, engine: Engine, dry: dict) -> dict:
    """One preset on the card in place (stages 2-6; 1 done by dry_runs)."""
    from lowvram_grpo.model.unsloth_backend import from_pretrained_kwargs, get_peft_model_kwargs
    try:
        from lowvram_grpo.core.errors import ResolveError
    except ImportError:  # before the errors module moved into core (714ef35)
        from lowvram_grpo.run.errors import ResolveError
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import planning_hardware
    from lowvram_grpo.settings.resolve import resolve
    from tests.standin_checkpoints import build, fixture
    from tests.virtual_card import EngineBuilt

    result = {"preset": preset, "card": card, "dry_run": dry, "stages": {}, "outcome": None}
    if dry["rc"] == 2:
        result["outcome"] = "refused"
        result["why"] = dry["errors"][0] if dry["errors"] else "(no error: line)"
        return result
    if dry["rc"] != 0:
        result["outcome"] = "crash"
        result["crash"] = {"stage": "dry-run", "error": f"exit {dry['rc']}", "where": "lowvram_grpo.run"}
        return result
    result["stages"]["dry-run"] = "plan"
    name, overrides = split(preset)
    config = load_config(name, overrides)
    try:
        resolved = resolve(config, planning_hardware(config, card))
    except ResolveError as exc:
        result["outcome"] = "crash"
        result["crash"] = {"stage": "resolve", "error": f"dry-run planned but resolve refused: {exc}",
                           "where": "resolve"}
        return result
    install = install_stage(card)
    if "no_kernels" in install:
        result["outcome"] = "crash"
        result["crash"] = {"stage": "install", "error": install["no_kernels"], "where": "settings/driver_fit.py"}
        return result
    result["stages"]["install"] = install
    result["stages"]["resolve"] = {"dtype": resolved.dtype, "kv_cache_dtype": resolved.kv_cache_dtype,
                                   "fast_inference": resolved.fast_inference, "generation": resolved.generation,
                                   "load_in_4bit": resolved.load_in_4bit}
    folder = build(config.model.name, standins)
    engine.real_config = json.loads((fixture(config.model.name) / "config.json").read_text())
    engine.seen = {}
    saved = dict(os.environ)
    stage = "engine"
    try:
        os.environ.update(resolved.engine_environment)  # as unsloth_backend.load_model does
        os.environ.update(resolved.trainer_environment)
        from unsloth import FastLanguageModel

        if resolved.fast_inference and _vision_without_torchvision(engine.real_config):
            result["stages"]["engine"] = {"stopped_at": NO_TORCHVISION}
        elif resolved.fast_inference:
            try:
                FastLanguageModel.from_pretrained(**from_pretrained_kwargs(resolved, str(folder)))
                raise AssertionError("unsloth's load returned without starting the engine stand-in")
            except EngineBuilt:
                result["stages"]["engine"] = dict(engine.seen, stopped_at=STOP)
        stage = "load"
        kwargs = dict(from_pretrained_kwargs(resolved, str(folder)), fast_inference=False)
        model, tokenizer = FastLanguageModel.from_pretrained(**kwargs)
        result["stages"]["load"] = {"model": type(model).__name__, "tokenizer": type(tokenizer).__name__,
                                    "processor": hasattr(tokenizer, "image_processor")}
        stage = "peft"
        model = FastLanguageModel.get_peft_model(model, **get_peft_model_kwargs(resolved))
        lora = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if hasattr(_, "lora_A")})
        result["stages"]["peft"] = {"lora_modules": lora}
        stage = "tokenize"
        result["stages"]["tokenize"] = _tokenize(tokenizer, config)
        result["outcome"] = "runs"
    except Exception as exc:  # a crash inside unsloth, vLLM or ours: the matrix's finding
        line = _one_line(exc).replace(str(folder), config.model.name)
        if stage == "load" and _vision_without_torchvision(engine.real_config) and "torchvision" in line:
            result["outcome"] = "stopped"
            result["stopped"] = {"stage": stage, "why": NO_TORCHVISION_LOAD, "unsloth": line}
            return result
        result["outcome"] = "crash"
        result["crash"] = {"stage": stage, "error": line, "where": _where(exc),
                           "detail": str(exc).replace(str(folder), config.model.name)[:1500]}
        if stage == "engine" and engine.seen:
            result["stages"]["engine"] = dict(engine.seen)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return result


def run_card(card: str, presets: list[str], standins: Path) -> list[dict]:
    """All `presets` on `card` in this process (started with virtual_card.process_environment)."""
    from tests.virtual_card import CARDS, install

    dry = dry_runs(card, presets)
    engine = Engine()
    with tempfile.TemporaryDirectory() as toolkit:
        injected = install(CARDS[card], Path(toolkit) / "cuda", engine)
        out = []
        for preset in presets:
            started = time.time()
            result = cell(preset, card, standins, engine, dry[preset])
            result["seconds"] = round(time.time() - started, 1)
            result["injected"] = injected
            out.append(result)
    return out


def run_matrix(cards=None, presets=None, workers: Optional[int] = None) -> list[dict]:
    """Every card's process (at most `workers` at once: default LOWVRAM_GRPO_MATRIX_WORKERS, else 2, one a core of
    CI's machines), each running every preset; the cells in card order."""
    from tests.virtual_card import CARDS, build_stubs, process_environment

    cards = list(cards or CARDS)
    presets = list(presets or gpu_presets())
    workers = workers or int(os.environ.get("LOWVRAM_GRPO_MATRIX_WORKERS", "2"))
    with tempfile.TemporaryDirectory() as tmp:
        stubs = build_stubs(Path(tmp) / "stubs")
        standins = Path(os.environ.get("LOWVRAM_GRPO_STANDINS", Path(tmp) / "standins"))
        env = process_environment(stubs)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        _prebuild(presets, standins)
        results: dict[str, list[dict]] = {}
        running: dict[str, subprocess.Popen] = {}
        queue = list(cards)
        while queue or running:
            while queue and len(running) < workers:
                card = queue.pop(0)
                running[card] = subprocess.Popen(
                    [sys.executable, __file__, "--card", card, "--presets", ",".join(presets), "--standins",
                     str(standins)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for card, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                stdout, stderr = proc.communicate()
                del running[card]
                lines = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("CELL ")]
                if proc.returncode != 0 or len(lines) != len(presets):
                    raise RuntimeError(f"the {card} process ended {proc.returncode} with {len(lines)} of "
                                       f"{len(presets)} "
                                       f"cells:\n{stderr[-4000:]}")
                results[card] = lines
            time.sleep(0.2)
    return [c for card in cards for c in results[card]]


def _prebuild(presets: list[str], standins: Path) -> None:
    """The stand-in checkpoints, built once before the card processes share them."""
    from lowvram_grpo.settings.config import load_config
    from tests.standin_checkpoints import build

    for model in sorted({load_config(split(p)[0]).model.name for p in presets}):
        build(model, standins)


def verdict(result: dict) -> str:
    """A cell in full: runs (what vLLM chose, what the loader returned), refused (the error line) or the crash."""
    if result["outcome"] == "refused":
        return "refused: " + result["why"].removeprefix("error: ")
    if result["outcome"] == "crash":
        crash = result["crash"]
        return f"CRASH at {crash['stage']}: {crash['error']} ({crash['where']})"
    if result["outcome"] == "stopped":
        stop = result["stopped"]
        return f"stopped at {stop['stage']}: {stop['why']} ({stop['unsloth'][:120]})"
    engine = result["stages"].get("engine") or {}
    load = result["stages"]["load"]
    parts = []
    if "config" in engine:
        cfg = engine["config"]
        attention = "/".join(sorted(set(engine["attention"].values())))
        parts.append(f"vLLM {cfg['dtype']}, KV {cfg['kv_cache_dtype']}, {attention}")
    elif engine:
        parts.append("vLLM " + engine["stopped_at"])
    else:
        parts.append("no vLLM (" + result["stages"]["resolve"]["generation"] + ")")
    parts.append(f"{load['model']} + {load['tokenizer']}, {result['stages']['tokenize']['tokens']} prompt tokens")
    return "runs: " + "; ".join(parts)


def _short(result: dict) -> str:
    if result["outcome"] == "runs":
        engine = result["stages"].get("engine") or {}
        if "config" in engine:
            cfg = engine["config"]
            dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(cfg["dtype"], cfg["dtype"])
            return f"runs ({dtype}, KV {cfg['kv_cache_dtype']}, " \
                   f"{'/'.join(sorted(set(engine['attention'].values())))})"
        return "runs (no vLLM)" if not engine else "runs (vLLM not run)"
    if result["outcome"] == "stopped":
        return f"stopped at {result['stopped']['stage']}"
    return "refused" if result["outcome"] == "refused" else f"**CRASH** at {result['crash']['stage']}"


def table(results: list[dict]) -> str:
    """The matrix: presets x cards, each cell short with a note number; the notes say each cell in full."""
    cards = list(dict.fromkeys(r["card"] for r in results))
    presets = list(dict.fromkeys(r["preset"] for r in results))
    cells = {(r["preset"], r["card"]): r for r in results}
    notes: list[str] = []
    lines = ["| preset | " + " | ".join(cards) + " |", "|---|" + "---|" * len(cards)]
    for preset in presets:
        row = []
        for card in cards:
            text = verdict(cells[(preset, card)]).replace("|", "/")
            if text not in notes:
                notes.append(text)
            row.append(f"{_short(cells[(preset, card)])} [{notes.index(text) + 1}]")
        lines.append(f"| `{preset.replace(':', ' ')}` | " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


def write(text: str, doc: Path = DOC) -> None:
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"error: {doc} lacks the markers {BEGIN!r} ... {END!r}: add them where the table goes")
    head, rest = body.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + BEGIN + "\n" + text + END + tail)


def shown(doc: Path = DOC) -> str:
    """The table docs/gpu.md shows between the markers."""
    body = doc.read_text()
    return body.split(BEGIN, 1)[1].split(END, 1)[0].strip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", help="run this card's cells in this process (started with the stand-in driver)")
    parser.add_argument("--presets", help="comma-separated presets (default: every GPU preset)")
    parser.add_argument("--cards", help="comma-separated card profiles for the table (default: every one)")
    parser.add_argument("--standins", help="the stand-in checkpoints' folder")
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(REPO)}")
    parser.add_argument("--json", help="also write every cell's record to this file")
    parser.add_argument("--from-json", help="make the table from the records a --json run wrote (nothing is run)")
    args = parser.parse_args(argv)
    presets = args.presets.split(",") if args.presets else None
    if args.card:
        for result in run_card(args.card, presets or gpu_presets(), Path(args.standins)):
            print("CELL " + json.dumps(result, default=str), flush=True)
        return 0
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run_matrix(cards=args.cards.split(",") if args.cards else None, presets=presets)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    text = table(results)
    if args.write:
        write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
