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

from .data import Question, chat_messages
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


def prime(handle, questions: list[Question], config, log=print) -> dict:
    """Run `config.prime.steps` supervised steps on `questions` that have worked solutions."""
    import torch

    settings = config.prime
    examples = [q for q in questions if q.solution]
    if not examples:
        log("priming skipped: the training data has no worked solutions")
        return {"steps": 0}
    model, tokenizer = handle.model, handle.tokenizer
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    model.train()
    started, losses = time.time(), []
    from tqdm.auto import tqdm

    bar = tqdm(range(settings.steps), desc="priming", unit="step", dynamic_ncols=True)
    for step in bar:
        chunk = [examples[(step * settings.batch_size + i) % len(examples)] for i in range(settings.batch_size)]
        prompts = [handle.apply_chat_template(chat_messages(q.question, config.data.system_prompt)) for q in chunk]
        targets = [xml_formatted(q.solution, q.answer) for q in chunk]
        input_ids, attention, labels = _batch(tokenizer, prompts, targets, config.model.max_seq_length)
        device = next(model.parameters()).device
        out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), labels=labels.to(device))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    return {"steps": settings.steps, "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
            "seconds": round(time.time() - started, 1)}
