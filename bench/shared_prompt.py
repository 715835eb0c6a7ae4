"""Benchmark: the group's prompt once (train.shared_prompt) in the default job's training forward/backward and prefill.

    flock /tmp/lowvram-cpu.lock python -m bench.shared_prompt     # writes bench/results/shared_prompt-<cpu>.json
    python -m bench.shared_prompt --repeats 2 --out X.json

The default preset's model and one GRPO step's micro-batch (bench/decode_step.rollout_batch: its first train questions
as chat prompts, 8 completions a prompt, 16 rows, left-padded), completions of random tokens whose lengths are drawn
uniformly in [--min-tokens, max_completion_length] (seed 0; the values do not change the time, the lengths do). On
the trainer a run builds (gradient checkpointing as the preset says), each run once untimed first, then alternated,
best and median of `--repeats`:

- `per_row`: TRL 1.15's own GRPOTrainer._get_per_token_logps_and_entropies (every row [prompt, completion]), then the
  backward of a weighted sum of the log-probs: the loss's forward and backward today.
- `shared`: the same through trl_compat.SharedPrompt (each distinct prompt once; its log-probs checked against
  per_row's).
- `prompt_rows`: TRL's per-row computation of the prompts alone (each row its prompt and one completion token): the
  prompt's share of per_row.
- prefill: the decode loop's prefill (no grad, transformers' layers) of the 16 rows against the 2 distinct prompts
  with their cache copied to the rows.

The report: each figure's seconds, the tokens computed, the prompt's share of the training forward/backward and the
seconds a GRPO step saves (the loss's forward/backward once a step: one micro-step of the whole generation batch).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.harness import REPO, command_line, machine, write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2_cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest completion drawn (default 16)")
    parser.add_argument("--set", action="append", default=[], help="extra KEY=VALUE settings")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    import trl

    from bench.decode_step import rollout_batch
    from lowvram_grpo.model.decoding import shared_rows
    from lowvram_grpo.model.fused_decode import prompt_positions
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.training.grpo import build_trainer

    config = load_config(args.preset, ["train.shared_prompt=on", "eval.enabled=false", *args.set])
    resolved, handle, encoded = rollout_batch(config, detect())
    train_q, _ = load_questions(config.data)
    out_dir = Path("/tmp") / f"bench_shared_prompt_{int(time.time())}"
    trainer = build_trainer(handle, to_prompt_rows(train_q[:8], config.data.system_prompt), out_dir)
    model = trainer.model
    if resolved.gradient_checkpointing != "false":  # as transformers' Trainer.train turns it on for the run
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    prompt_ids, prompt_mask = encoded["input_ids"].cpu(), encoded["attention_mask"].cpu()
    rows, prompt_len = prompt_ids.shape
    width = config.train.max_completion_length
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_tokens, width + 1, (rows,), generator=generator)
    completion = torch.randint(3, handle.tokenizer.vocab_size - 1, (rows, width), generator=generator)
    completion_mask = (torch.arange(width) < lengths[:, None]).long()
    ids = torch.cat([prompt_ids, completion], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    weights = torch.randn(rows, width, generator=generator)

    def step(shared: bool, batch_ids, batch_mask, keep: int):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        if shared:
            logps, _, _ = trainer._get_per_token_logps_and_entropies(model, batch_ids, batch_mask, keep,
                                                                     compute_entropy=True)
        else:
            trls = trl.GRPOTrainer._get_per_token_logps_and_entropies
            logps, _, _ = trls(trainer, model, batch_ids, batch_mask, keep, compute_entropy=True)
        (logps.float() * weights[:, :keep]).sum().backward()
        return time.perf_counter() - started, logps.detach().float()

    first, group = shared_rows(prompt_ids, prompt_mask)
    positions = prompt_positions(prompt_mask)
    inner = model.get_base_model()

    def prefill(shared: bool):
        from transformers import DynamicCache

        cache = DynamicCache(config=inner.config)
        started = time.perf_counter()
        with torch.no_grad():
            if shared:
                out = inner(input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
                            position_ids=positions[first], past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache.reorder_cache(group)
                logits = out.logits[:, -1][group]
            else:
                logits = inner(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
                               past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return time.perf_counter() - started, logits

    times = {"per_row": [], "shared": [], "prompt_rows": [], "prefill_per_row": [], "prefill_shared": []}
    gap = logit_gap = 0.0
    prompt_one = torch.cat([prompt_ids, completion[:, :1]], dim=1), torch.cat([prompt_mask, completion_mask[:, :1]], 1)
    step(False, ids, mask, width)  # untimed: the kernels' first-call setup (oneDNN primitives) out of both figures
    step(True, ids, mask, width)
    prefill(False)
    prefill(True)
    for repeat in range(args.repeats):
        print(f"[bench] repeat {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
        seconds, theirs = step(False, ids, mask, width)
        times["per_row"].append(seconds)
        seconds, ours = step(True, ids, mask, width)
        times["shared"].append(seconds)
        gap = max(gap, (ours - theirs).abs().max().item())
        times["prompt_rows"].append(step(False, *prompt_one, 1)[0])
        seconds, theirs = prefill(False)
        times["prefill_per_row"].append(seconds)
        seconds, ours = prefill(True)
        times["prefill_shared"].append(seconds)
        logit_gap = max(logit_gap, (ours - theirs).abs().max().item())
    best = {key: round(min(values), 3) for key, values in times.items()}
    median = {key: round(statistics.median(values), 3) for key, values in times.items()}
    per_row_tokens = int(mask.sum())
    packed_tokens = int(prompt_mask[first].sum()) + int(lengths.sum())  # each prompt once; a segment a completion
    saved = median["per_row"] - median["shared"] + median["prefill_per_row"] - median["prefill_shared"]
    report = {
        "command": command_line("bench.shared_prompt"),
        "machine": machine(),
        "preset": args.preset,
        "settings": args.set,
        "dtype": resolved.dtype,
        "gradient_checkpointing": resolved.gradient_checkpointing,
        "rows": rows, "distinct_prompts": len(first), "prompt_tokens_padded": prompt_len,
        "prompt_tokens": [int(n) for n in prompt_mask[first].sum(dim=1)],
        "completion_tokens": [int(n) for n in lengths],
        "tokens_per_row_path": per_row_tokens, "tokens_shared_path": packed_tokens,
        "seconds_best": best, "seconds_median": median, "seconds_all": {k: [round(v, 3) for v in vs]
                                                                        for k, vs in times.items()},
        "prompt_share_of_train_forward_backward": round(median["prompt_rows"] / median["per_row"], 3),
        "shared_over_per_row": round(median["shared"] / median["per_row"], 3),
        "prefill_shared_over_per_row": round(median["prefill_shared"] / median["prefill_per_row"], 3),
        "seconds_saved_per_step": round(saved, 3),
        "max_logprob_gap": gap, "max_prefill_logit_gap": logit_gap,
    }
    cpu = (report["machine"]["cpu"] or "cpu").lower()
    name = "-".join(part for part in cpu.replace("(r)", "").replace("(tm)", "").split()[:3] if part.isalnum())
    out = args.out or REPO / "bench" / "results" / f"shared_prompt-{name or 'cpu'}.json"
    write_report(out, report)
    print(f"wrote {out}\n" + "\n".join(f"{k}: {v}" for k, v in report.items() if k not in ("seconds_all",)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
