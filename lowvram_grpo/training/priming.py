"""Supervised priming: a short LoRA fine-tune on worked solutions in the answer format, before GRPO.

Why: GRPO learns only from groups whose completions score differently. A small base model that never
writes the <reasoning>/<answer> format earns 0 from every format and correctness reward, every group
is all-zero, and the advantages (and so the gradients) are zero: the "reward stays 0" trap. A few
dozen supervised steps on formatted examples (as Unsloth's Qwen3 GRPO notebook does) make the format
common but not certain, and the answers sometimes right, so groups have mixed rewards from the first
GRPO step. The run reports base -> primed -> after GRPO, so GRPO's own gain is visible.

The loss is the usual next-token cross-entropy on the completion tokens only (prompt masked), on the
same LoRA parameters GRPO then trains, with a plain AdamW of its own.

A run with tools primes on the prompts GRPO sees (rendered with the tools' schemas). When the built-in
`calculator` is among them, a worked example becomes a transcript that uses it (`tool_transcript`): one
assistant turn calling the calculator once per calculation the solution does (GSM8K's `<<48/2=24>>`
annotations, or the built-in problems' `a + b = c`), the results as tool messages, then the formatted
answer. Both assistant turns are trained; the tool results and the prompt are masked, as TRL masks them.

In a run (`checkpoints`: its RunDir) priming writes prime-checkpoint-N every `prime.save_steps` steps, at
its last step, and when a signal stops it (stops.py: the stop comes between two steps); `resume_from`
continues from one. A checkpoint holds the trainable weights, the optimizer, the RNG states, and the losses
and seconds so far, so a priming stopped and continued ends with the same adapter as an unbroken one.
"""
from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Callable, Optional

from tqdm.auto import tqdm

from lowvram_grpo.report.run_dir import PRIME_STATE
from lowvram_grpo.core import host_memory, stops
from lowvram_grpo.core.errors import RunDirError
from lowvram_grpo.settings.plans import PrimePlan
from lowvram_grpo.task.data import Question, prompt_of
from lowvram_grpo.task.rewards import formatted
from lowvram_grpo.task.tools import calculator
from lowvram_grpo.task.user_code import of as user_code_of

_ANNOTATION = re.compile(r"<<([^=<>]+)=[^<>]*>>")  # GSM8K's calculator annotations: <<48/2=24>>
_NUMBER = r"\d+(?:\.\d+)?"
_EQUATION = re.compile(rf"({_NUMBER}(?:\s*[-+*/]\s*{_NUMBER})+)\s*=")  # the built-in problems' `a + b = c`


def calculations(solution: str) -> list[str]:
    """The arithmetic a worked solution does, as calculator expressions, in order."""
    marked = _ANNOTATION.findall(solution or "")
    return [m.strip() for m in (marked or _EQUATION.findall(solution or ""))]


def tool_transcript(messages: list[dict], solution: str) -> Optional[list[dict]]:
    """`messages` (a chat prompt) followed by one assistant turn that calls `calculator` once per calculation of
    `solution` and the results as tool messages; None when the solution does no calculation."""
    expressions = calculations(solution)
    if not expressions:
        return None
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
             for e in expressions]
    results = [{"role": "tool", "name": "calculator", "content": calculator(e)} for e in expressions]
    return [*messages, {"role": "assistant", "content": "", "tool_calls": calls}, *results]


def example_pieces(tokenizer, question: Question, system_prompt: str, tools: Optional[list], answer_format: str = "xml",
                   template_kwargs: Optional[dict] = None) -> list[tuple[str, bool]]:
    """One worked example as (text, trained) pieces: the prompt (rendered with `tools`' schemas, as GRPO renders
    it) masked, the formatted answer trained; with the calculator among `tools`, the transcript that uses it:
    prompt masked, the calling turn trained (up to its end-of-turn token), the tool results and the next
    assistant header masked, the answer trained. The answer is written in `answer_format` (data.answer_format);
    `template_kwargs` (data.chat_template_kwargs) go to the chat template."""
    prompt = prompt_of(question, system_prompt)
    answer = formatted(answer_format, question.solution, question.answer) + tokenizer.eos_token
    if isinstance(prompt, str):
        return [(prompt, False), (answer, True)]

    def render(messages, generation: bool) -> str:
        return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation, **(template_kwargs or {}))

    head = render(prompt, True)
    names = {getattr(t, "__name__", "") for t in tools or ()}
    transcript = tool_transcript(prompt, question.solution) if "calculator" in names else None
    if transcript is None:
        return [(head, False), (answer, True)]
    with_call = render(transcript[:len(prompt) + 1], False)
    before_answer = render(transcript, True)
    if not (with_call.startswith(head) and before_answer.startswith(with_call)):
        return [(head, False), (answer, True)]  # a template that rewrites earlier turns: the plain example
    call = with_call[len(head):]
    end = call.find(tokenizer.eos_token)
    cut = len(call) if end < 0 else end + len(tokenizer.eos_token)
    return [(head, False), (call[:cut], True), (call[cut:] + before_answer[len(with_call):], False), (answer, True)]


def _batch(tokenizer, examples: list[list[tuple[str, bool]]], max_length: int):
    import torch

    ids, labels = [], []
    for pieces in examples:
        seq, lab = [], []
        for text, trained in pieces:
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            seq += tokens
            lab += tokens if trained else [-100] * len(tokens)
        ids.append(seq[:max_length])
        labels.append(lab[:max_length])
    width = max(len(s) for s in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in ids])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
    label_ids = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return input_ids, attention, label_ids


def completion_loss(model, input_ids, attention_mask, labels):
    """Mean next-token cross-entropy over the labelled (completion) tokens, without the full logits.

    The model's own `labels=` loss builds [batch, length, vocab] logits in fp32, plus their softmax and
    gradient (three [batch, length, vocab] fp32 tensors at once). Here the backbone's hidden states go
    through the chunked, checkpointed log-probs that GRPO uses (logprobs_fallback), so only one chunk
    of logits is alive at a time. Same maths: log p(target) = z_t - logsumexp(z), in fp32.
    """
    from lowvram_grpo.training.logprobs_fallback import torch_chunked_logprobs  # loads torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    head = base.get_output_embeddings()
    log_probs = torch_chunked_logprobs(hidden[:, :-1][keep], head.weight, head.bias, targets[keep], temperature=1.0)[0]
    return -log_probs.float().mean()


def save_state(folder, model, optimizer, progress: dict) -> None:
    """One priming checkpoint's files in `folder` (run_dir.PRIME_REQUIRED_FILES)."""
    import torch

    folder = Path(folder)
    weights = {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}
    torch.save(weights, folder / "priming_weights.pt")
    torch.save(optimizer.state_dict(), folder / "priming_optimizer.pt")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, folder / "priming_rng.pt")
    (folder / PRIME_STATE).write_text(json.dumps(progress, indent=2) + "\n")


def load_state(folder, model, optimizer) -> dict:
    """Put a priming checkpoint back into `model` and `optimizer` (and the RNGs); its progress dict."""
    import torch

    folder = Path(folder)
    try:
        progress = json.loads((folder / PRIME_STATE).read_text())
        weights = torch.load(folder / "priming_weights.pt", map_location="cpu")
        optimizer_state = torch.load(folder / "priming_optimizer.pt", map_location="cpu", weights_only=False)
        rng = torch.load(folder / "priming_rng.pt", weights_only=False)
    except Exception as exc:  # a damaged checkpoint: say which
        raise RunDirError(f"{folder} cannot be read ({type(exc).__name__}: {exc}): the priming checkpoint is damaged; "
                          "delete it to continue from the one before") from None
    params = dict(model.named_parameters())
    missing = [name for name in weights if name not in params]
    if missing:
        raise RunDirError(f"{folder} holds weights this model does not have ({missing[0]}): not this run's checkpoint")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device))
    optimizer.load_state_dict(optimizer_state)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return progress


def prime(handle, questions: list[Question], plan: PrimePlan, log=print, max_seconds: Optional[float] = None,
          on_step: Optional[Callable[[int, float], None]] = None, checkpoints=None,
          resume_from: Optional[Path] = None) -> dict:
    """Run `plan.steps` (plans.PrimePlan: prime.*) supervised steps on `questions` that have worked solutions (cycling
    through them); with `max_seconds`, no step starts once that much wall time has passed (the prime-only
    baseline's equal-time budget, baseline.py). `on_step(steps_done, seconds_training_so_far)` runs after each step
    (bench/plateau.py saves and measures checkpoints of one priming there; the time it takes is not counted against
    `max_seconds` nor in the returned seconds). `checkpoints`: the run's RunDir, for prime-checkpoint-N; `resume_from`:
    one to continue from. A signal (stops.py) stops priming after the step it arrived in: StopRequested, after
    a checkpoint when there is `checkpoints`."""
    import torch

    examples = [q for q in questions if q.solution and q.answer is not None]
    if not examples:
        log("priming skipped: the training data has no worked solutions with gold answers")
        return {"steps": 0}
    model, tokenizer, prompts = handle.model, handle.text_tokenizer, plan.prompts
    tools = user_code_of(plan).prompt_tools() if plan.tools.used else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=plan.learning_rate, weight_decay=0.0)
    model.train()
    started, losses, outside = time.time(), [], 0.0  # outside: seconds spent in on_step and writing checkpoints
    earlier_seconds, first = 0.0, 0
    if resume_from is not None:
        progress = load_state(resume_from, model, optimizer)
        first, losses, earlier_seconds = int(progress["steps"]), list(progress["losses"]), float(progress["seconds"])
        log(f"resuming priming from {resume_from} (step {first} of {plan.steps})")

    if max_seconds is None:
        bar = tqdm(total=plan.steps, initial=first, desc="priming", unit="step", dynamic_ncols=True)
    else:  # a time budget: the bar counts seconds, not the (open-ended) steps
        bar = tqdm(total=round(max_seconds), desc="priming (time budget)", unit="s", dynamic_ncols=True)

    def seconds() -> float:  # training seconds: earlier ones (a resumed priming) + this call's, less `outside`
        return earlier_seconds + time.time() - started - outside

    def save(steps_done: int) -> None:
        nonlocal outside
        before = time.time()
        progress = {"steps": steps_done, "of": plan.steps, "losses": losses, "seconds": round(seconds(), 3)}
        checkpoints.save_prime_checkpoint(steps_done, lambda folder: save_state(folder, model, optimizer, progress),
                                          keep=plan.keep_checkpoints)
        outside += time.time() - before

    where = f"after this priming step{', with a checkpoint' if checkpoints is not None else ''}"
    last_started = None  # when the newest step of this call started (training seconds)
    with stops.deferred(where, check_at_exit=False):  # a signal after the last step: checked below, after its save
        for step in range(first, plan.steps):
            if max_seconds is not None and seconds() >= max_seconds:
                break
            last_started = seconds()  # a time budget's check: no step starts after it is spent
            chunk = [examples[(step * plan.batch_size + i) % len(examples)] for i in range(plan.batch_size)]
            pieces = [example_pieces(tokenizer, q, prompts.system_prompt, tools, prompts.answer_format,
                                     prompts.template_kwargs) for q in chunk]
            input_ids, attention, labels = _batch(tokenizer, pieces, prompts.max_seq_length)
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
                on_step(len(losses), seconds())
                model.train()
                outside += time.time() - before
            stopping = stops.received() is not None  # a signal came during this step: stop after it
            if checkpoints is not None and (stopping or (plan.save_steps and len(losses) % plan.save_steps == 0)):
                save(len(losses))
            if stopping:
                bar.close()
                stops.check()
    bar.close()
    if checkpoints is not None and losses:
        if [step for step, _ in checkpoints.prime_checkpoint_dirs()][-1:] != [len(losses)]:
            save(len(losses))  # the end of priming: a --resume after it goes on from here
        checkpoints.prune_prime_checkpoints(1)
    stops.check()
    if not losses:
        return {"steps": 0}
    return {"steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
            "seconds": round(seconds(), 1),
            "last_step_started": None if last_started is None else round(last_started, 3)}
