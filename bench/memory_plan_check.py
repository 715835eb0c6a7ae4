"""Check the memory plan's non-vLLM terms against the memory real GRPO steps take on the CPU.

    python -m bench.memory_plan_check            # both cases, writes bench/results/memory_plan_check.json
    python -m bench.memory_plan_check --cases wide

Each case runs in a fresh process: the hf backend builds the model and TRL's GRPOTrainer exactly as
`pipeline.run` does, and `trainer.train()` runs 2 GRPO steps under the PyTorch profiler with
`profile_memory=True`. From its allocation events (tensor memory, the CPU twin of
`torch.cuda.max_memory_allocated`) each step gives two peaks: generation + scoring, and the loss
forward + backward over the level left after generation. Also measured: the bytes autograd saves for
backward per token per layer (`saved_tensors_hooks`) against the plan's activation formula, and the
process's RSS growth over the whole run (glibc keeps freed memory, so RSS overstates tensor memory).

Predicted loss + backward, from `lowvram_grpo.settings.memory_plan` at the run's sizes (fp32 on the CPU, 4 bytes):
the plan's LoRA grads (the weights exist before training: half its LoRA term) and activations
(checkpointing off, as in these runs), plus the CPU's log-prob chunks (`logprobs_fallback`: 8M fp32
logits per chunk with exp, softmax and softmax x logits; TRL's GPU kernel uses 4096 x 32768 tiles,
which is what the GPU plan counts). The optimizer state is made in the optimizer step, outside it.

Cases: `tiny` (the tiny preset as it is: every term is a few MB) and `wide` (a random 4-layer Llama
512 wide with a 32768-token vocab, 8 completions x 128 tokens: terms of hundreds of MB). Memory is
measured only here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2 ** 20
CASES = {
    "tiny": {"model": "builtin:tiny", "overrides": ["train.max_steps=2", "eval.enabled=false"]},
    "wide": {"model": "wide", "overrides": ["train.max_steps=2", "eval.enabled=false", "train.num_generations=8",
                                            "train.max_completion_length=128", "lora.r=16", "data.num_train=64"]},
}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def build_wide_model(directory: Path) -> str:
    """A random Llama with a real-sized vocabulary, with the tiny model's tokenizer (ids past its 512
    tokens decode to nothing, so sampled completions run to full length: the largest terms)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lowvram_grpo.model.builtin_models import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    config = LlamaConfig(vocab_size=32768, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def saved_activation_bytes(model, batch: int, seq: int, vocab: int) -> int:
    """Bytes the decoder keeps for backward in one training forward of `batch` x `seq` random tokens:
    every tensor autograd saves, each storage counted once (torch.autograd.graph.saved_tensors_hooks)."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    model.train()
    ids = torch.randint(0, vocab, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.get_base_model().model(input_ids=ids)  # the decoder; the LM head is scored in chunks apart
    return sum(storages.values())


def annotate_phases(trainer) -> None:
    """Mark each GRPO step's two phases in the profiler: generation + scoring, and the whole step
    (whose part after generation is the loss forward + backward)."""
    from torch.profiler import record_function

    generate, train_step = trainer._generate_and_score_completions, trainer.training_step

    def generate_marked(*args, **kwargs):
        with record_function("PHASE_generation"):
            return generate(*args, **kwargs)

    def train_step_marked(*args, **kwargs):
        with record_function("PHASE_step"):
            return train_step(*args, **kwargs)

    trainer._generate_and_score_completions = generate_marked
    trainer.training_step = train_step_marked


def phase_peaks(prof) -> list[dict]:
    """Per step, from the profiler's allocation events (tensor memory, like torch.cuda.max_memory_allocated):
    the generation phase's peak over its start, and the loss + backward peak over the level after generation."""
    import bisect

    events = prof.profiler.kineto_results.events()
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times, levels, level = [], [], 0
    for t, nbytes in allocations:
        level += nbytes
        times.append(t)
        levels.append(level)

    def level_at(t):
        i = bisect.bisect_right(times, t) - 1
        return levels[i] if i >= 0 else 0

    def peak(start, end):
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        return (max(levels[i:j]) if j > i else level_at(start)) - level_at(start)

    spans = {name: sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == name)
             for name in ("PHASE_generation", "PHASE_step")}
    return [{"generation_peak_mib": round(peak(g0, g1) / MIB, 1),
             "loss_backward_peak_mib": round(peak(g1, s1) / MIB, 1)}
            for (g0, g1), (_, s1) in zip(spans["PHASE_generation"], spans["PHASE_step"])]


def measure(case: str) -> dict:
    """One case, in this process: build, reset the peak mark, train, read the peaks."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.task.data import drop_long_prompts, load_questions, to_prompt_rows
    from lowvram_grpo.settings.memory_plan import plan
    from lowvram_grpo.settings.memory_terms import activation_bytes_per_token_layer
    from lowvram_grpo.training.grpo import build_trainer

    torch.set_num_threads(1)
    spec = CASES[case]
    work = Path(tempfile.mkdtemp(prefix=f"memcheck-{case}-"))
    model = build_wide_model(work / "model") if spec["model"] == "wide" else spec["model"]
    config = load_config("tiny", [f"model.name={model}", *spec["overrides"]])
    handle = load_model(resolve(config, detect(), "hf"))
    shape = plan(config, handle.resolved).shape
    train_questions, _ = load_questions(config.data)
    rows, _ = drop_long_prompts(to_prompt_rows(train_questions, config.data.system_prompt), handle.tokenizer,
                                config.train.max_prompt_length)
    texts = [handle.apply_chat_template(r["prompt"]) for r in rows]
    longest_prompt = max(len(handle.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    batch, seq = config.train.batch_size, longest_prompt + config.train.max_completion_length
    saved = saved_activation_bytes(handle.model, batch, seq, min(shape.vocab, len(handle.tokenizer)))

    trainer = build_trainer(handle, rows, work / "run")
    annotate_phases(trainer)
    gc.collect()
    before = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train()
    whole = _rss("VmHWM")
    completion = max(r.get("completions/max_length", 0) for r in trainer.state.log_history if "reward" in r)

    # The plan's training terms at the sizes the last step ran with (fp32: 4 bytes/element).
    step_seq = longest_prompt + int(completion)
    sized = load_config("tiny", [f"model.name={model}", *spec["overrides"], f"train.max_prompt_length={longest_prompt}",
                                 f"train.max_completion_length={int(completion)}"])
    terms = plan(sized, resolve(sized, detect(), "hf")).terms
    chunk_rows = max(1, 8 * MIB // shape.vocab)  # logprobs_fallback.CHUNK_ELEMENTS fp32 logits per chunk
    predicted = {
        "lora_grads": terms["lora"].bytes // 2,  # the weights exist before training
        "activations": terms["activations"].bytes,
        "cpu_logprob_chunks": 4 * min(batch * step_seq, chunk_rows) * shape.vocab * 4,  # logits, exp, softmax,
                                                                                        # softmax x logits
    }
    return {
        "case": case, "model": spec["model"], "params": shape.params, "batch": batch,
        "longest_prompt_tokens": longest_prompt, "longest_completion_tokens": int(completion),
        "saved_activations_per_token_layer_kib": round(saved / (batch * seq * shape.layers) / 1024, 2),
        "plan_activations_per_token_layer_kib": round(activation_bytes_per_token_layer(shape, 4) / 1024, 2),
        "steps": phase_peaks(prof),
        "predicted_loss_backward_mib": {k: round(v / MIB, 1) for k, v in predicted.items()},
        "predicted_loss_backward_total_mib": round(sum(predicted.values()) / MIB, 1),
        "rss_before_train_mib": round(before / MIB, 1),
        "rss_growth_whole_run_mib": round((whole - before) / MIB, 1),  # allocator retention included
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="tiny,wide")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one case in this process
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "memory_plan_check.json")
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(args.one)))
        return 0
    results = []
    for case in args.cases.split(","):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "bench.memory_plan_check", "--one", case], capture_output=True,
                              text=True, env=env, cwd=REPO)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        result = json.loads(line[len("RESULT "):])
        results.append(result)
        last = result["steps"][-1]
        print(f"{case}: saved activations {result['saved_activations_per_token_layer_kib']} KiB/token/layer "
              f"(plan {result['plan_activations_per_token_layer_kib']}); last step: generation "
              f"+{last['generation_peak_mib']} MiB, loss+backward +{last['loss_backward_peak_mib']} MiB measured vs "
              f"+{result['predicted_loss_backward_total_mib']} MiB predicted {result['predicted_loss_backward_mib']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
