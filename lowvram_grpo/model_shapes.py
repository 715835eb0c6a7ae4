"""Model shapes: what the memory plan, the settings checks and the vLLM engine know of an architecture (the
config.json fields of a Llama/Qwen-style model), from a small table of known architectures (no hub access at plan
time) or from the config.json of a local checkpoint folder. Pure Python: no torch, no transformers.

    shape = model_shape("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit")   # KNOWN_SHAPES["llama-3.1-8b"]
    shape = model_shape("runs/merged")                                  # its config.json
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import PlanError


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about an architecture (the config.json fields of a Llama/Qwen-style model)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    head_dim: Optional[int] = None
    context: Optional[int] = None   # max_position_embeddings: the longest prompt + completion the model takes

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_per_head

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer in one decoder layer, by its usual module name."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        """Parameters in the decoder layers' linear layers: the part 4-bit quantization shrinks."""
        return self.layers * sum(a * b for a, b in self.linear_dims().values())

    @property
    def other_params(self) -> int:
        """Embeddings, lm_head (unless tied) and norms: kept in 16-bit even in a 4-bit model."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params


def _shape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, context, head_dim=None) -> ModelShape:
    return ModelShape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, head_dim, context)


# The config.json values of the models the presets use (and a few neighbours). Keys are matched
# against the lowercased model name with any "org/" prefix and "meta-" dropped.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": _shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, 131072),
    "llama-3-8b": _shape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, False, 8192),
    "llama-3.2-3b": _shape("Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, True, 131072),
    "llama-3.2-1b": _shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True, 131072),
    "qwen2.5-7b": _shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, 32768),
    "qwen2.5-3b": _shape("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True, 32768),
    "qwen2.5-1.5b": _shape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, 32768),
    "qwen2.5-0.5b": _shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, 32768),
    "smollm2-135m": _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192, 64),
    "builtin:smollm2": _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192, 64),
    "builtin:tiny": _shape("builtin:tiny", 64, 2, 4, 2, 128, 512, False, 2048, 16),
}


def shape_from_config(raw: dict, name: str) -> ModelShape:
    """The shape from a model's config (config.json's mapping, or a loaded model's `config.to_dict()`):
    the one reader of these fields, for the plan, the settings checks and the vLLM engine."""
    raw = raw.get("text_config") or raw  # multimodal configs nest the language model's
    try:
        heads = int(raw["num_attention_heads"])
        return ModelShape(
            name=name, hidden=int(raw["hidden_size"]), layers=int(raw["num_hidden_layers"]), heads=heads,
            kv_heads=int(raw.get("num_key_value_heads") or heads), intermediate=int(raw["intermediate_size"]),
            vocab=int(raw["vocab_size"]), tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
            head_dim=raw.get("head_dim"), context=raw.get("max_position_embeddings"),
        )
    except KeyError as exc:
        raise PlanError(f"{name} lacks {exc.args[0]!r}: the plan needs hidden_size, num_hidden_layers, "
                        "num_attention_heads, intermediate_size and vocab_size") from None


def local_model_config(name: str) -> Optional[dict]:
    """The config.json of a local checkpoint folder `name` as a mapping, None when `name` is no such folder:
    the one reader of that file for the plan, the settings checks (checks.py) and the vLLM engine."""
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the model shape from {path}: {exc}") from None


def shape_from_config_json(path: Path) -> ModelShape:
    """The shape of a local checkpoint from its config.json (transformers' field names)."""
    raw = local_model_config(str(Path(path).parent))
    if raw is None:
        raise PlanError(f"cannot read the model shape from {path}: no such file")
    return shape_from_config(raw, str(Path(path).parent))


def model_shape(name: str) -> ModelShape:
    """The shape of model `name`: a local checkpoint dir (its config.json) or a known architecture."""
    config_json = Path(name) / "config.json"
    if config_json.is_file():
        return shape_from_config_json(config_json)
    key = name.lower()
    if not key.startswith("builtin:"):
        key = key.rsplit("/", 1)[-1].replace("meta-", "")
    for known, shape in KNOWN_SHAPES.items():
        if key == known or key.startswith(known + "-") or key.startswith(known + "_"):
            return shape
    raise PlanError(
        f"no memory plan for model {name!r}: its shape is not in lowvram_grpo.model_shapes.KNOWN_SHAPES "
        f"({', '.join(sorted({s.name for s in KNOWN_SHAPES.values()}))}); download it and set model.name to "
        "the local dir (its config.json gives the shape), or add its shape to KNOWN_SHAPES"
    )
