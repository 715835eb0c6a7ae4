"""Benchmark: lowvram_grpo's GRPO step against plain TRL, on the real SmolLM2-135M-Instruct, on CPU.

    python -m bench.vs_trl                      # all variants, writes bench/results/vs_trl.json
    python -m bench.vs_trl --steps 4 --variants ours,trl

Each variant runs in its own fresh Python process (so peak RSS is that variant's alone), on the same
model, prompts, seed and GRPO settings (G completions x L tokens, LoRA r=16 on all seven projections):

- `ours`:    lowvram_grpo's path (`backends.load_model` + `training.build_trainer`, hf backend) with the
             `smollm2_cpu` preset's memory settings.
- `trl`:     plain TRL `GRPOTrainer` + PEFT LoRA, fp32, `adamw_torch`, TRL's defaults otherwise
             (gradient checkpointing on). The one addition: TRL 1.15's log-prob kernel is Triton-only,
             so it cannot run on a CPU at all without our PyTorch twin (`trl_compat.install_logprob_fallback`).
- `trl_nogc`: the same plain TRL with gradient checkpointing off (see the README: with it on, TRL's
             train-mode sampling on a CPU decodes without the KV cache's context).
- `trl_bf16`: plain TRL as a user gets it who passes the model's name: transformers 5 loads the checkpoint in its
             own dtype (SmolLM2's: bf16), GRPOConfig's own bf16=True autocast, adamw_torch.
- `trl_fp32`: plain TRL all in float32: weights float32 and bf16=False (no autocast), adamw_torch: on a CPU
             without native bf16, where bf16 is emulated, what a user switches to.
- `trl_fp32_nogc`: `trl_fp32` with gradient checkpointing off: a backward without the recomputation, for more
             memory (TRL 1.15 turns checkpointing off around its generate, so sampling keeps its KV cache either way).
- `trl_8bit`: `trl_fp32_nogc` with our optimizer (paged 8-bit AdamW): the same optimizer on both sides.
- `ours_adamw`, `ours_nogc`: `ours` with train.optim=adamw_torch / memory.gradient_checkpointing=false: what our
             8-bit optimizer and our gradient checkpointing cost or save in the training half.

The headline (`fastest_plain_trl`, `ratios_vs_fastest_plain_trl`) is taken against the fastest `trl*` variant of
the same invocation. `--rounds 2` runs the variants in the order given, then reversed; each round's figures are
kept under the variant's `rounds` (with its position and order), the variant's figures the median over them.
- `unsloth`: lowvram_grpo's path on the unsloth backend (unsloth's CPU backend here).
- `ours_int8`: `ours` with decode.weights=int8 (rollouts from the int8 base + the adapter unmerged, the
             importance-sampling correction per token).
- `ours_unmerged`: `ours` with decode.merge_lora=false (the fused layers read the bf16 base weights in place and
             add the adapter unmerged: no merged copy).
- `ours_forward`: `ours` with train.is_logprobs=forward: the correction's trainer log-probs from TRL's extra no-grad
             forward of the rollout batch, as before trl_compat.RatioFromLoss took them from the loss's forward.

Where the importance-sampling correction runs, the record also keeps the sampler/trainer gap TRL logs
(`sampling/sampling_logp_difference/mean` and `/max`, averaged and maxed over the counted steps).

Per step it records wall seconds and where they go: generation, reward scoring, log-prob forwards
without grad (old/reference policy), the training forward, backward, and the optimizer's step. Reports the median over
steps after the first (warm-up) and the process's peak RSS (`ru_maxrss`), and the ratios ours/TRL.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import bench_variants, peak_rss_mb, ratios, variant_parser

PARTS = ("generate", "rewards", "logps_nograd", "forward", "backward", "optimizer")
VARIANT_SETS = {"ours_int8": ["decode.weights=int8"],  # a variant's own overrides (before the user's --set)
                "ours_unmerged": ["decode.merge_lora=false"], "ours_forward": ["train.is_logprobs=forward"],
                "ours_adamw": ["train.optim=adamw_torch"], "ours_nogc": ["memory.gradient_checkpointing=false"]}
# plain TRL's variants: (weights' dtype: None = as transformers loads the checkpoint, GRPOConfig's bf16 autocast,
# optimizer, gradient checkpointing). bf16=True and gradient checkpointing on are GRPOConfig's own defaults.
PLAIN_TRL_VARIANTS = {
    "trl": ("float32", True, "adamw_torch", True),
    "trl_nogc": ("float32", True, "adamw_torch", False),
    "trl_bf16": (None, True, "adamw_torch", True),
    "trl_fp32": ("float32", False, "adamw_torch", True),
    "trl_fp32_nogc": ("float32", False, "adamw_torch", False),
    "trl_8bit": ("float32", False, "paged_adamw_8bit", False),
}
GAP_MEAN, GAP_MAX = "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"  # TRL 1.15


def bench_overrides(args, extra: list[str] = ()) -> list[str]:
    """The run both sides share: base model (no priming), G completions x L tokens, fixed seed;
    `extra` (a bench's own settings) before the user's `--set`s, so those still win."""
    return [
        f"train.num_generations={args.generations}",
        "train.per_device_train_batch_size=null",  # one prompt x G completions per step (the compared shape)
        f"train.max_completion_length={args.tokens}",
        f"train.max_steps={args.steps}",
        "train.logging_steps=1",
        "train.save_steps=100000",
        "prime.steps=0",
        "eval.enabled=false",
        *extra,
    ] + list(args.set or [])


# --------------------------------------------------------------------------- timing instrumentation


class StepClock:
    """Wall time per optimizer step, and per part (wrapped trainer methods) within each step."""

    def __init__(self):
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._started = 0.0
        self.peak_growth_mb = {part: 0.0 for part in PARTS}  # how much each part raised the peak RSS
        self._open: set[str] = set()  # the parts whose outermost call is running
        self.optimizer_began: float | None = None  # the optimizer step's start (instrument's callback)

    def begin(self):
        self._current = {part: 0.0 for part in PARTS}
        self._started = time.perf_counter()

    def end(self):
        if self._current is not None:
            self._current["step"] = time.perf_counter() - self._started
            self.steps.append(self._current)
            self._current = None

    def wrap(self, obj, name: str, part_for_call):
        """Time `obj.name` as the part `part_for_call()` names; a call nested in a call of the same part (TRL's
        vLLM branch of `_generate_single_turn` calls it again through trl_compat.ModelSampler when the
        importance-sampling correction is on) is inside the outer one's time and is not counted again."""
        original = getattr(obj, name)

        def timed(*a, **kw):
            part = part_for_call()
            if part in self._open:
                return original(*a, **kw)
            t0, peak0 = time.perf_counter(), peak_rss_mb()
            self._open.add(part)
            try:
                return original(*a, **kw)
            finally:
                self._open.discard(part)
                self.peak_growth_mb[part] += peak_rss_mb() - peak0
                if self._current is not None:
                    self._current[part] += time.perf_counter() - t0

        setattr(obj, name, timed)


def instrument(trainer) -> StepClock:
    import torch
    from transformers import TrainerCallback

    clock = StepClock()

    class Hook(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            clock.begin()

        def on_step_end(self, *a, **kw):
            clock.end()

        def on_pre_optimizer_step(self, *a, **kw):  # the optimizer's step: between these two events
            clock.optimizer_began = time.perf_counter()

        def on_optimizer_step(self, *a, **kw):
            if clock._current is not None and clock.optimizer_began is not None:
                clock._current["optimizer"] += time.perf_counter() - clock.optimizer_began
            clock.optimizer_began = None

    trainer.add_callback(Hook())
    clock.wrap(trainer, "_generate_single_turn", lambda: "generate")
    clock.wrap(trainer, "_calculate_rewards", lambda: "rewards")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies",
               lambda: "forward" if torch.is_grad_enabled() else "logps_nograd")
    clock.wrap(trainer.accelerator, "backward", lambda: "backward")
    return clock


def keep_first_completion(trainer) -> list[str]:
    """Record the decoded first completion of every generation call (to check the samples make sense)."""
    samples: list[str] = []
    original = trainer._generate_single_turn

    def recorded(*a, **kw):
        result = original(*a, **kw)
        samples.append(trainer.processing_class.decode(result[0][0], skip_special_tokens=True)[:200])
        return result

    trainer._generate_single_turn = recorded
    return samples


# --------------------------------------------------------------------------- the variants (child side)


def prompt_rows(config):
    from lowvram_grpo.task.data import load_questions, to_prompt_rows

    train_questions, _ = load_questions(config.data)
    return to_prompt_rows(train_questions, config.data.system_prompt)


def build_ours(config, backend: str):
    from lowvram_grpo.model.backends import load_model, prepare_backend
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve

    prepare_backend(backend)  # unsloth first, before trl/transformers
    from lowvram_grpo.training.grpo import build_trainer

    handle = load_model(resolve(config, detect(), backend))
    out = Path(tempfile.mkdtemp(prefix=f"bench-{backend}-"))
    return build_trainer(handle, prompt_rows(config), out)


# What a user of TRL's docs copies from a run's config into GRPOConfig: the same values as ours, taken from
# the one builder (training.grpo_config_kwargs). Everything else is TRL's default, but for the bench's plumbing.
SHARED_WITH_PLAIN_TRL = ("learning_rate", "num_generations", "max_completion_length", "temperature", "beta",
                         "max_steps", "seed", "use_cpu")
PLAIN_TRL = dict(logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)


def plain_trl_args(config, output_dir: str, gradient_checkpointing: bool = True, optim: str = "adamw_torch",
                   bf16: bool = True):
    """Plain TRL's GRPOConfig: SHARED_WITH_PLAIN_TRL from our builder, `optim` (AdamW in fp32 state by default),
    GRPOConfig's bf16 autocast (its default) unless `bf16` is False, one prompt's group per step."""
    from trl import GRPOConfig

    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    ours = grpo_config_kwargs(resolve(config, detect(), "hf"), Path(output_dir))
    return GRPOConfig(output_dir=output_dir, per_device_train_batch_size=config.train.num_generations,
                      gradient_checkpointing=gradient_checkpointing, **{k: ours[k] for k in SHARED_WITH_PLAIN_TRL},
                      optim=optim, bf16=bf16, **PLAIN_TRL)


def build_plain_trl(config, variant: str = "trl"):
    """What a user writes from TRL's docs: GRPOTrainer + a PEFT LoRA config, with the variant's weights' dtype,
    autocast, optimizer and gradient checkpointing (PLAIN_TRL_VARIANTS)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from lowvram_grpo.training.trl_compat import install_logprob_fallback
    from lowvram_grpo.model.builtin_models import resolve_model_path
    from lowvram_grpo.task.rewards import REWARDS

    install_logprob_fallback()  # without it TRL 1.15 has no CPU log-prob path at all
    path = resolve_model_path(config.model.name)
    weights, bf16, optim, gradient_checkpointing = PLAIN_TRL_VARIANTS[variant]
    loaded = {} if weights is None else {"dtype": getattr(torch, weights)}  # None: transformers 5's own ("auto")
    model = AutoModelForCausalLM.from_pretrained(path, **loaded)
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = plain_trl_args(config, tempfile.mkdtemp(prefix="bench-trl-"), gradient_checkpointing, optim, bf16)
    lora = LoraConfig(r=config.lora.r, lora_alpha=config.lora.alpha, target_modules=list(config.lora.target_modules),
                      task_type="CAUSAL_LM")
    torch.manual_seed(config.lora.random_state)
    return GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[REWARDS[name] for name in config.rewards.names],
        args=args,
        train_dataset=Dataset.from_list(prompt_rows(config)),
        peft_config=lora,
    )


def child(variant: str, args) -> dict:
    from lowvram_grpo.settings.config import load_config

    config = load_config(args.preset, bench_overrides(args, VARIANT_SETS.get(variant, [])))
    rss_start = peak_rss_mb()
    if variant in PLAIN_TRL_VARIANTS:
        trainer = build_plain_trl(config, variant)
    else:
        trainer = build_ours(config, "unsloth" if variant == "unsloth" else "hf")
    rss_loaded = peak_rss_mb()
    clock = instrument(trainer)
    samples = keep_first_completion(trainer)
    trainer.train()
    steps = clock.steps[1:] or clock.steps  # the first step warms up allocators and caches
    median = {key: round(statistics.median(s[key] for s in steps), 3) for key in ("step",) + PARTS}
    lengths = [row.get("completions/mean_length") for row in trainer.state.log_history
               if "completions/mean_length" in row]
    gaps = [row for row in trainer.state.log_history[1:] if GAP_MEAN in row]  # the counted steps' (the first warms up)
    return {
        "step_s": median["step"],
        "parts_s": {part: median[part] for part in PARTS},
        "all_steps_s": [round(s["step"], 3) for s in clock.steps],
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_growth_by_part_mb": {part: round(v, 1) for part, v in clock.peak_growth_mb.items()},
        "rss_after_load_mb": round(rss_loaded, 1),
        "rss_at_start_mb": round(rss_start, 1),
        "mean_completion_tokens": round(statistics.mean(lengths), 1) if lengths else None,
        "sample_completions": samples,  # the first completion of each step: is the sampling sane?
        "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
        "optim": str(trainer.args.optim),
        "weights_dtype": str(next(getattr(trainer.model, "get_base_model", lambda: trainer.model)()
                                  .parameters()).dtype).replace("torch.", ""),
        "lora_dtype": next((str(p.dtype).replace("torch.", "") for n, p in trainer.model.named_parameters()
                            if "lora_" in n), None),
        "bf16_autocast": bool(trainer.args.bf16),
        "sampler_gap": {"mean_abs_logp_difference": round(statistics.mean(r[GAP_MEAN] for r in gaps), 4),
                        "max_abs_logp_difference": round(max(r[GAP_MAX] for r in gaps), 3)} if gaps else None,
    }


# --------------------------------------------------------------------------- the parent side


def fastest_plain_trl(results: dict) -> dict:
    """The headline: the fastest plain-TRL variant of this run (by median step time) and every variant's step time
    and peak RSS over its."""
    plain = [name for name in results if name in PLAIN_TRL_VARIANTS]
    if not plain:
        return {}
    fastest = min(plain, key=lambda name: results[name]["step_s"])
    return {"fastest_plain_trl": fastest,
            "ratios_vs_fastest_plain_trl": ratios(results, fastest, ("step_s", "peak_rss_mb"))}


def table(results: dict) -> str:
    plain = [name for name in results if name in PLAIN_TRL_VARIANTS]
    trl = results[min(plain, key=lambda name: results[name]["step_s"])] if plain else None
    lines = ["| variant | s/step (median) | generate | rewards | log-probs (no grad) | train forward | backward "
             "| optimizer | peak RSS MB | time vs fastest TRL | memory vs fastest TRL | sampler gap mean / max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        p = r["parts_s"]
        time_ratio = f"{r['step_s'] / trl['step_s']:.2f}x" if trl else "-"
        mem_ratio = f"{r['peak_rss_mb'] / trl['peak_rss_mb']:.2f}x" if trl else "-"
        gap = r.get("sampler_gap")
        gap = f"{gap['mean_abs_logp_difference']:.4f} / {gap['max_abs_logp_difference']:.3f}" if gap else "-"
        lines.append(f"| {name} | {r['step_s']:.2f} | {p['generate']:.2f} | {p['rewards']:.3f} "
                     f"| {p['logps_nograd']:.2f} "
                     f"| {p['forward']:.2f} | {p['backward']:.2f} | {p.get('optimizer', 0):.3f} "
                     f"| {r['peak_rss_mb']:.0f} "
                     f"| {time_ratio} | {mem_ratio} | {gap} |")
    return "\n".join(lines)


def main() -> int:
    args = variant_parser(__doc__, "ours,ours_int8,ours_unmerged,ours_forward,trl,trl_nogc,unsloth", steps=4,
                          generations=4, out=Path(__file__).resolve().parent / "results" / "vs_trl.json").parse_args()
    return bench_variants("bench.vs_trl", args, child, table, memory=("peak RSS", "peak_rss_mb"), references=("trl",),
                          headline=fastest_plain_trl)


if __name__ == "__main__":
    sys.exit(main())
