"""Supervised priming: a short LoRA fine-tune on worked solutions in the answer format, before GRPO.

Why: GRPO learns only from groups whose completions score differently. A small base model that never
writes the <reasoning>/<answer> format earns 0 from every format and correctness reward, every group
is all-zero, and the advantages (and so the gradients) are zero: the "reward stays 0" trap. A few
dozen supervised steps on formatted examples (as Unsloth's Qwen3 GRPO notebook does) make the format
common but not certain, and the answers sometimes right, so groups have mixed rewards from the first
GRPO step. The run reports base -> primed -> after GRPO, so GRPO's own gain is visible.

The loss is the usual next-token cross-entropy on the completion tokens only (prompt masked), on the
same LoRA parameters GRPO then trains, with a plain AdamW of its own.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from . import host_memory
from .data import Question, prompt_of
from .rewards import xml_formatted


def _batch(tokenizer, prompts: list[str], targets: list[str], max_length: int):
    import torch

    ids, labels = [], []
    for prompt, target in zip(prompts, targets):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        t = tokenizer(target + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        seq = (p + t)[:max_length]
        ids.append(seq)
        labels.append(([-100] * len(p) + t)[:max_length])
    width = max(len(s) for s in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in ids])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
    label_ids = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return input_ids, attention, label_ids


def completion_loss(model, input_ids, attention_mask, labels):
    """Mean next-token cross-entropy over the labelled (completion) tokens, without the full logits.

    The model's own `labels=` loss builds [batch, length, vocab] logits in fp32, plus their softmax and
    gradient: ~1.9 GB of peak for 8 SmolLM2 examples (vocab 49152). Here the backbone's hidden states go
    through the chunked, checkpointed log-probs that GRPO uses (logprobs_fallback), so only one chunk
    of logits is alive at a time. Same maths: log p(target) = z_t - logsumexp(z), in fp32.
    """
    from .logprobs_fallback import torch_chunked_logprobs

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    head = base.get_output_embeddings()
    log_probs = torch_chunked_logprobs(hidden[:, :-1][keep], head.weight, head.bias, targets[keep], temperature=1.0)[0]
    return -log_probs.float().mean()


def prime(handle, questions: list[Question], config, log=print, max_seconds: Optional[float] = None,
          on_step: Optional[Callable[[int, float], None]] = None) -> dict:
    """Run `config.prime.steps` supervised steps on `questions` that have worked solutions (cycling through
    them); with `max_seconds`, no step starts once that much wall time has passed (the prime-only
    baseline's equal-time budget, baseline.py). `on_step(steps_done, seconds_training_so_far)` runs after each step (bench/plateau.py
    saves and measures checkpoints of one priming there; the time it takes is not counted against `max_seconds`
    nor in the returned seconds)."""
    import torch

    settings = config.prime
    examples = [q for q in questions if q.solution and q.answer is not None]
    if not examples:
        log("priming skipped: the training data has no worked solutions with gold answers")
        return {"steps": 0}
    model, tokenizer = handle.model, handle.tokenizer
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    model.train()
    started, losses, outside = time.time(), [], 0.0  # outside: seconds spent in on_step
    from tqdm.auto import tqdm

    if max_seconds is None:
        bar = tqdm(total=settings.steps, desc="priming", unit="step", dynamic_ncols=True)
    else:  # a time budget: the bar counts seconds, not the (open-ended) steps
        bar = tqdm(total=round(max_seconds), desc="priming (time budget)", unit="s", dynamic_ncols=True)
    for step in range(settings.steps):
        if max_seconds is not None and time.time() - started - outside >= max_seconds:
            break
        chunk = [examples[(step * settings.batch_size + i) % len(examples)] for i in range(settings.batch_size)]
        prompts = [handle.apply_chat_template(prompt_of(q, config.data.system_prompt)) for q in chunk]
        targets = [xml_formatted(q.solution, q.answer) for q in chunk]
        input_ids, attention, labels = _batch(tokenizer, prompts, targets, config.model.max_seq_length)
        device = next(model.parameters()).device
        loss = completion_loss(model, input_ids.to(device), attention.to(device), labels.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        host_memory.release()  # freed activations back to the OS: RSS stays flat (host_memory.py)
        bar.update(1 if max_seconds is None else min(round(time.time() - started), bar.total) - bar.n)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", **({} if max_seconds is None else {"steps": len(losses)}))
        if on_step is not None:
            before = time.time()
            on_step(len(losses), before - started - outside)
            model.train()
            outside += time.time() - before
    bar.close()
    return {"steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
            "seconds": round(time.time() - started - outside, 1)}
