"""The group's prompt once in the loss (train.shared_prompt): the trainer's per-token log-probs of a micro-batch whose
rows share prompts, with each distinct prompt computed once and its keys and values serving every completion of it.

TRL 1.15 scores a micro-batch row by row: [prompt, completion] for each of the group's G completions, so the prompt's
forward and backward run G times (GRPOTrainer._get_per_token_logps_and_entropies). Here each distinct prompt becomes
one packed sequence (unsloth's PrefixGrouper, unsloth #6871, is the field's version of the idea):

    [prompt but its last token] [last prompt token, completion 1 but its last token] [last prompt token, ...

with a 4D attention mask: prompt tokens attend causally among themselves; each completion's segment attends to the
prompt and causally to its own segment, never to another completion. Every token keeps the position id TRL gives it
(its index in the padded row: transformers' default arange, left pads counted), so each segment token computes what
it computes in its own row; the last prompt token is repeated in each segment (one token a completion) because its
hidden state predicts the completion's first token, a different label in each. A completion's last token predicts
nothing (TRL's shifted labels) and no other token attends to it, so it is left out. Pads (prompt mask 0, completion
mask 0) are no one's keys in TRL's rows and predict no label, so they are left out too. The gradient through the
prompt's positions is then the sum over the group's completions, as autograd sums it over the G rows today.

`pack(input_ids, attention_mask, logits_to_keep)` returns the packed batch, or why it does not apply (the caller keeps
TRL's per-row computation): no prompt shared in the micro-batch, a left-truncated prompt without its last token, a
completion mask with holes. `packed_logps(model, packed, ...)` runs the model's forward (TRL's fused LM head,
`fused_lm_head=True` with pre-shifted labels) on it and scatters the log-probs (and entropies) back to TRL's [B, C].
"""
from __future__ import annotations

from dataclasses import dataclass

# the attention implementations that take a custom 4D (additive) mask
MASKED_ATTENTION = ("sdpa", "eager")


@dataclass
class Packed:
    """One micro-batch, one packed sequence per distinct prompt.

    input_ids, position_ids, shift_labels: [U, T] (pads: the first token id, position 0, label -100);
    mask: [U, T, T] bool (True = attend); rows [B, C] / columns [B, C]: where row b's completion token c is scored
    (its index into the packed batch, flattened [U * T]); scored [B, C] bool: the completion tokens TRL scores.
    groups: the distinct prompts (U); rows_shared: the rows that share a prompt with another row."""
    input_ids: object
    position_ids: object
    shift_labels: object
    mask: object
    index: object
    scored: object
    groups: int
    rows_shared: int

    def additive_mask(self, dtype):
        """[U, 1, T, T] in `dtype`: 0 where attended, the dtype's lowest value elsewhere (sdpa and eager add it)."""
        import torch

        return torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill(
            ~self.mask, torch.finfo(dtype).min)[:, None]


def prompt_groups(prompt_ids, prompt_mask):
    """(group index [B] of each row, number of distinct prompts): rows whose prompt tokens and mask are equal share one.
    Groups are numbered in the order of their first row."""
    import torch

    key = torch.cat([prompt_ids.masked_fill(prompt_mask == 0, -1), prompt_mask.long()], dim=1)
    first = {}
    index = []
    for row in key.tolist():
        index.append(first.setdefault(tuple(row), len(first)))
    return torch.tensor(index, dtype=torch.long, device=prompt_ids.device), len(first)


def pack(input_ids, attention_mask, logits_to_keep: int):
    """The micro-batch [B, P + C] (prompts left-padded, completions right-padded, C = logits_to_keep) packed as the
    module's docstring says; or a str: why not (the caller keeps the per-row computation)."""
    import torch

    rows, width = input_ids.shape
    prompt_len = width - logits_to_keep
    if prompt_len < 1 or logits_to_keep < 1:
        return "no prompt or no completion tokens"
    prompt_ids, prompt_mask = input_ids[:, :prompt_len], attention_mask[:, :prompt_len]
    completion_mask = attention_mask[:, prompt_len:].bool()
    if not bool(prompt_mask[:, -1].bool().all()):
        return "a prompt whose last position is padding"
    lengths = completion_mask.sum(dim=1)                                                   # [B]
    if not bool((completion_mask == (torch.arange(logits_to_keep, device=input_ids.device) < lengths[:, None])).all()):
        return "a completion mask with holes"
    group, groups = prompt_groups(prompt_ids, prompt_mask)
    if groups == rows:
        return "no prompt shared by two rows of the micro-batch"
    ids_cpu, prompt_mask_cpu, lengths_cpu = input_ids.tolist(), prompt_mask.tolist(), lengths.tolist()
    sequences = []   # per group: (token ids, positions, labels, segment of each token: -1 prompt, row b)
    where = {}       # (row, completion index) -> (group, packed position)
    for g in range(groups):
        members = [b for b in range(rows) if int(group[b]) == g]
        first = members[0]
        ids = [ids_cpu[first][j] for j in range(prompt_len - 1) if prompt_mask_cpu[first][j]]
        positions = [j for j in range(prompt_len - 1) if prompt_mask_cpu[first][j]]
        labels, segment = [-100] * len(ids), [-1] * len(ids)
        for b in members:
            count = lengths_cpu[b]
            for c in range(count):  # token at P-1+c predicts completion token c
                where[(b, c)] = (g, len(ids))
                ids.append(ids_cpu[b][prompt_len - 1 + c])
                positions.append(prompt_len - 1 + c)
                labels.append(ids_cpu[b][prompt_len + c])
                segment.append(b)
        sequences.append((ids, positions, labels, segment))
    length = max(len(s[0]) for s in sequences)
    device = input_ids.device
    packed_ids = torch.full((groups, length), ids_cpu[0][prompt_len - 1], dtype=input_ids.dtype)
    packed_positions = torch.zeros((groups, length), dtype=torch.long)
    labels = torch.full((groups, length), -100, dtype=torch.long)
    segments = torch.full((groups, length), -2, dtype=torch.long)
    for g, (ids, positions, row_labels, segment) in enumerate(sequences):
        n = len(ids)
        packed_ids[g, :n] = torch.tensor(ids, dtype=input_ids.dtype)
        packed_positions[g, :n] = torch.tensor(positions)
        labels[g, :n] = torch.tensor(row_labels)
        segments[g, :n] = torch.tensor(segment)
    causal = torch.ones(length, length, dtype=torch.bool).tril()                          # [T, T]: key <= query
    query, key = segments[:, :, None], segments[:, None, :]                               # [U, T, 1], [U, 1, T]
    mask = causal[None] & ((key == -1) | ((key == query) & (key >= 0)))                   # prompt, or own segment
    mask |= torch.eye(length, dtype=torch.bool)[None]                                     # pads: themselves only
    index = torch.zeros((rows, logits_to_keep), dtype=torch.long)
    scored = torch.zeros((rows, logits_to_keep), dtype=torch.bool)
    for (b, c), (g, position) in where.items():
        index[b, c] = g * length + position
        scored[b, c] = True
    shared = sum(1 for b in range(rows) if int((group == group[b]).sum()) > 1)
    return Packed(input_ids=packed_ids.to(device), position_ids=packed_positions.to(device),
                  shift_labels=labels.to(device), mask=mask.to(device), index=index.to(device),
                  scored=scored.to(device), groups=groups, rows_shared=shared)


def unpack(values, packed: Packed):
    """Per-packed-token values [U, T] back to TRL's [B, C]: each scored completion token's, 0 elsewhere (as TRL's fused
    head gives unscored positions)."""
    import torch

    gathered = values.reshape(-1)[packed.index.reshape(-1)].view(packed.index.shape)
    return torch.where(packed.scored, gathered, torch.zeros_like(gathered))


def packed_logps(model, packed: Packed, compute_entropy: bool, additive_dtype=None):
    """(log-probs [B, C], entropies [B, C] or None) of the packed batch through `model`'s forward with TRL's fused LM
    head (trl.trainer.utils.add_fused_lm_head: `fused_lm_head=True`, `shift_labels` scored without shifting). The mask
    goes in as bool (sdpa), or additive in `additive_dtype` (eager attention adds it to the scores)."""
    mask = packed.mask[:, None] if additive_dtype is None else packed.additive_mask(additive_dtype)
    outputs = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                    shift_labels=packed.shift_labels, fused_lm_head=True)
    logps = unpack(outputs.log_probs, packed)
    entropies = unpack(outputs.entropy, packed) if compute_entropy and outputs.entropy is not None else None
    return logps, entropies
