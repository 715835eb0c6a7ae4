"""The group's prompt once (train.shared_prompt, issue 68): the loss's per-token log-probs, entropies and LoRA gradients
with each distinct prompt computed once (training/shared_prompt.py through trl_compat.SharedPrompt) against TRL 1.15's
own per-row computation (GRPOTrainer._get_per_token_logps_and_entropies), on the real tiny Llama with an adapter that
moves the outputs: two prompts of different lengths (left-padded), a group of 4 each, unequal completion lengths (one
empty, one full). Tolerances, float32: log-probs and entropies within 1e-5 absolute (they differ in the 7th digit:
other matmul shapes, the same maths); each LoRA gradient within 1e-4 of its largest entry. bfloat16 (the compute dtype
of a CPU with native bf16): log-probs within 0.05 (bf16's rounding of a -6 log-prob is 0.03), each gradient within 5%
of its largest entry. A prompt position off by one moves the log-probs by ~1e-3 and fails the float32 test.
The decode loop: greedy tokens with each distinct prompt prefilled once equal today's (every row prefilled), on
transformers' layers and on the fused ones; sampled ones too, one seed, their log-probs within 1e-5 (a prefill
position off by one leaves the tiny model's greedy tokens as they were but moves the log-probs by ~1e-3)."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import load_handle, perturb_adapter

torch = pytest.importorskip("torch")

COMPLETION = 9
LENGTHS = (9, 3, 6, 1, 0, 7, 9, 2)   # completion tokens of each row (mask ones), rows alternate between two prompts
PROMPTS = ("Question: what is 3 + 4? Think, then answer:", "Q: 12 - 5 =")


def micro_batch(tokenizer, lengths=LENGTHS, completion=COMPLETION, seed=0):
    """TRL's layout: prompts left-padded to one width, completions right-padded; rows alternate between PROMPTS."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [tokenizer(text, return_tensors="pt").input_ids[0] for text in PROMPTS]
    width = max(len(p) for p in prompts)
    ids, masks = [], []
    for row, count in enumerate(lengths):
        prompt = prompts[row % 2]
        pad = width - len(prompt)
        ids.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt,
                              torch.randint(3, 500, (completion,), generator=generator)]))
        masks.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(len(prompt), dtype=torch.long),
                                (torch.arange(completion) < count).long()]))
    return torch.stack(ids), torch.stack(masks)


def build(tmp_path, sets=()):
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.training.grpo import build_trainer

    sets = ["eval.enabled=false", "train.shared_prompt=on", *sets]
    handle = load_handle("tiny", sets)
    perturb_adapter(handle.model, 0.05)
    config = load_config("tiny", sets)
    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q[:8], config.data.system_prompt), tmp_path)
    trainer.model.train()
    return handle, trainer


def scored(trainer, ids, mask, shared: bool, weights):
    """(log-probs, entropies, {LoRA parameter: gradient of sum(weights * log-probs)}) by our path or TRL's own."""
    import trl

    trainer.model.zero_grad(set_to_none=True)
    if shared:
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION,
                                                                         compute_entropy=True)
    else:
        logps, entropies, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask,
                                                                                 COMPLETION, compute_entropy=True)
    (logps.float() * weights).sum().backward()
    grads = {name: p.grad.float().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return logps.detach().float(), entropies.detach().float(), grads


def assert_close(ours, theirs, logp_atol: float, grad_rtol: float) -> None:
    assert torch.equal(ours[0] == 0, theirs[0] == 0)  # the same tokens scored
    assert (ours[0] - theirs[0]).abs().max().item() <= logp_atol
    assert (ours[1] - theirs[1]).abs().max().item() <= logp_atol
    assert set(ours[2]) == set(theirs[2]) and ours[2]
    for name, grad in theirs[2].items():
        scale = grad.abs().max().item()
        assert scale > 0, name  # every LoRA weight gets a gradient here
        assert (ours[2][name] - grad).abs().max().item() <= grad_rtol * scale, name


@pytest.mark.parametrize("sets, attention", [((), None), (("memory.gradient_checkpointing=true",), "eager")],
                         ids=["sdpa", "eager+checkpointing"])
def test_the_shared_prompt_loss_equals_trls_per_row_computation(tmp_path, sets, attention):
    handle, trainer = build(tmp_path, sets)
    if attention is not None:
        trainer.model.get_base_model().set_attn_implementation(attention)
    if handle.resolved.gradient_checkpointing != "false":  # as transformers' Trainer.train turns it on
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert all(layer.gradient_checkpointing for layer in trainer.model.get_base_model().model.layers)
    ids, mask = micro_batch(handle.tokenizer)
    weights = torch.randn(ids.shape[0], COMPLETION, generator=torch.Generator().manual_seed(1))
    theirs = scored(trainer, ids, mask, False, weights)
    ours = scored(trainer, ids, mask, True, weights)
    assert trainer.shared_prompt_chunks == 1 and trainer.shared_prompt_kept == {}
    assert_close(ours, theirs, logp_atol=1e-5, grad_rtol=1e-4)


def test_the_shared_prompt_loss_in_bf16_is_within_bf16s_rounding(tmp_path):
    handle, trainer = build(tmp_path, ["model.dtype=bfloat16"])
    ids, mask = micro_batch(handle.tokenizer)
    weights = torch.randn(ids.shape[0], COMPLETION, generator=torch.Generator().manual_seed(1))
    theirs = scored(trainer, ids, mask, False, weights)
    ours = scored(trainer, ids, mask, True, weights)
    assert trainer.shared_prompt_chunks == 1
    assert_close(ours, theirs, logp_atol=0.05, grad_rtol=0.05)


def test_what_the_packing_cannot_take_is_scored_per_row(tmp_path):
    from lowvram_grpo.training.shared_prompt import pack

    handle, trainer = build(tmp_path)
    ids, mask = micro_batch(handle.tokenizer)
    holed = mask.clone()
    holed[0, -COMPLETION + 2] = 0
    assert pack(ids, holed, COMPLETION) == "a completion mask with holes"
    assert pack(ids[:2], mask[:2], COMPLETION) == "no prompt shared by two rows of the micro-batch"
    weights = torch.randn(ids.shape[0], COMPLETION, generator=torch.Generator().manual_seed(1))
    theirs = scored(trainer, ids, holed, False, weights)
    ours = scored(trainer, ids, holed, True, weights)
    assert trainer.shared_prompt_kept == {"a completion mask with holes": 1} and trainer.shared_prompt_chunks == 0
    assert_close(ours, theirs, logp_atol=0.0, grad_rtol=0.0)  # TRL's own computation: bit for bit


def test_the_packing_computes_each_prompt_once():
    from lowvram_grpo.training.shared_prompt import pack

    ids = torch.tensor([[0, 5, 6, 7, 10, 11, 12], [0, 5, 6, 7, 20, 21, 22], [8, 9, 6, 7, 30, 31, 32]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    packed = pack(ids, mask, 3)
    assert packed.groups == 2 and packed.rows_shared == 2
    # prompt 1 without its last token and pad, then [last prompt token, completion but its last token] a row
    assert packed.input_ids[0].tolist() == [5, 6, 7, 10, 7, 20, 21]
    assert packed.position_ids[0].tolist() == [1, 2, 3, 4, 3, 4, 5]   # TRL's positions: the padded row's index
    assert packed.shift_labels[0].tolist() == [-100, -100, 10, 11, 20, 21, 22]
    assert packed.mask[0, 4].tolist() == [True, True, False, False, True, False, False]  # prompt + itself, not row 0
    assert packed.input_ids[1, :4].tolist() == [8, 9, 6, 7] and packed.shift_labels[1, 3].item() == 30


def greedy(model, ids, mask, tokens=12):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False)


def test_the_decode_loops_greedy_tokens_with_the_shared_prefill_equal_todays(tiny_model_dir):
    from lowvram_grpo.model import fused_decode
    from lowvram_grpo.model.decoding import shared_rows

    today = load_handle("tiny", ["train.shared_prompt=off", "decode.loop=lowvram"])
    shared = load_handle("tiny", ["train.shared_prompt=on", "decode.loop=lowvram"])
    assert shared.resolved.decode.shared_prefill and not today.resolved.decode.shared_prefill
    for handle in (today, shared):
        perturb_adapter(handle.model, 0.05)
    ids, mask = micro_batch(today.tokenizer, lengths=(0,) * 8, completion=0)
    ids, mask = ids[[0, 0, 1, 0, 1, 1, 0, 1]], mask[[0, 0, 1, 0, 1, 1, 0, 1]]
    first, group = shared_rows(ids, mask)
    assert first.tolist() == [0, 2] and group.tolist() == [0, 0, 1, 0, 1, 1, 0, 1]
    expected = greedy(today.model, ids, mask)
    calls = []
    own = shared.model.get_base_model().forward

    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return own(*args, **kwargs)

    shared.model.get_base_model().forward = counted
    got = greedy(shared.model, ids, mask)
    del shared.model.get_base_model().forward
    assert calls[0] == (2, ids.shape[1])  # one prefill row a distinct prompt
    assert torch.equal(got, expected)
    assert not torch.equal(expected[0, ids.shape[1]:], expected[2, ids.shape[1]:])  # the prompts' answers differ

    from lowvram_grpo.model.decoding import decode

    sampled = {}  # sampled tokens on transformers' layers, one seed: the same draws, log-probs within float rounding
    for on in (False, True):
        settings = dataclasses.replace(shared.resolved.decode, shared_prefill=on)
        logprobs = []
        torch.manual_seed(0)
        with torch.no_grad():
            tokens = decode(shared.model, ids, mask, max_new_tokens=12, do_sample=True, temperature=1.0,
                            settings=settings, logprobs=logprobs)
        sampled[on] = tokens, torch.stack(logprobs, dim=1)
    assert torch.equal(sampled[True][0], sampled[False][0])
    assert (sampled[True][1] - sampled[False][1]).abs().max().item() <= 1e-5

    inner = shared.model.get_base_model()  # the fused layers (sampled tokens), greedy pick: the same tokens
    with torch.no_grad():
        per_row, once = (fused_decode.decode(inner, ids, mask, max_new_tokens=12, eos_token_ids=[], pad_token_id=0,
                                             pick=lambda logits: logits.argmax(dim=-1), shared=s)
                         for s in (None, (first, group)))
    assert torch.equal(once, per_row)


def test_the_plan_says_where_the_prompt_is_computed_once():
    """Opt-in; where asked for but not taken (the unsloth backend, tool turns), the plan (--dry-run) says so."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect, profile
    from lowvram_grpo.settings.resolve import resolve

    def train(preset, sets, hardware=None, backend="hf"):
        resolved = resolve(load_config(preset, sets), hardware or detect(), backend)
        return resolved.plan.train, resolved.decode.shared_prefill, resolved.plan.describe()

    off, prefill, text = train("smollm2_cpu", [])
    assert not off.shared_prompt and not prefill
    assert "prompt of a group: computed per completion (train.shared_prompt=off, the default" in text
    on, prefill, text = train("tiny", ["train.shared_prompt=on", "decode.loop=lowvram"])
    assert on.shared_prompt and prefill
    assert "prompt of a group: computed once (train.shared_prompt=on: in the loss and the decode loop's prefill" in text
    on, prefill, text = train("tiny", ["train.shared_prompt=on", "decode.loop=transformers"])
    assert on.shared_prompt and "the rollouts' prefill stays per row (transformers' generate)" in text
    tools, prefill, text = train("smollm2_tools_cpu", ["train.shared_prompt=on"])
    assert not tools.shared_prompt and not prefill and "kept per completion: tool turns" in text
    unsloth, prefill, text = train("qwen1_5b_4bit", ["train.shared_prompt=on"], profile("t4"), "auto")
    assert not unsloth.shared_prompt and not prefill and "kept per completion on the unsloth backend" in text


@pytest.mark.slow  # a real tiny run (pytest.ini: the fast tier is -m "not slow")
def test_a_tiny_run_trains_with_the_prompt_once(tmp_path):
    """Every scoring of a GRPO step (the loss's forward, beta > 0's reference pass, ...) packs its micro-batch: one
    group of 4 completions of one prompt; the rollouts' prefill is shared too."""
    import json
    import math

    handle, trainer = build(tmp_path, ["train.max_steps=2"])
    assert trainer.shared_prompt and handle.resolved.decode.shared_prefill and handle.plan.train.beta > 0
    trainer.train()
    # nothing kept per row; at least the loss's forward and the reference pass each step (train.adapter_check_every's
    # no-grad pass, when on, scores through it too)
    assert trainer.shared_prompt_kept == {} and trainer.shared_prompt_chunks >= 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert trainer.effective_settings["settings"]["shared_prompt"] is True
