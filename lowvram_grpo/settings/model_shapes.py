"""Model shapes: what the memory plan, the settings checks and the vLLM engine know of an architecture, read from
the model's own config.json, and what the pinned vLLM serves of each family.

    shape = model_shape("unsloth/Qwen3-4B")   # its config.json: a local folder, the hub cache, or downloaded alone
    shape = model_shape("runs/merged")       # a local checkpoint folder's config.json
    shape.source                             # where the numbers came from (the plan prints it)

Where the config.json comes from, in order: `name` as a local folder; the built-ins (KNOWN_SHAPES); the local hub
cache (huggingface_hub.try_to_load_from_cache); the hub, config.json alone (hf_hub_download), unless HF_HUB_OFFLINE
is set or the hub cannot be reached; then KNOWN_SHAPES, the offline fallback (each number's source in
SHAPE_SOURCES). Nothing else: PlanError naming the file and what to do.

Families (config.json `model_type`, of the text config in a multimodal one): Llama / Qwen2 / SmolLM (the plain
decoder); Qwen3 (q/k norms); Qwen3.5 (Gated DeltaNet linear-attention layers beside gated full attention, and a
vision tower); Gemma 3 (sliding-window layers, q/k norms, four norms a layer, a 262k vocabulary); gpt-oss (mixture
of experts, sliding-window layers, attention sinks). Pure Python: no torch, no transformers.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from lowvram_grpo.core.errors import PlanError

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's sizes (Qwen3.5: config.json linear_*): its projections and its recurrent state."""
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    state_dtype_bytes: int = 4   # config.json mamba_ssm_dtype ("float32" in Qwen3.5's): the recurrent state

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, conv_bytes: int) -> int:
        """One sequence's state in one layer: the recurrent state [value_heads, key_head_dim, value_head_dim] at
        state_dtype_bytes, and the convolution's last conv_kernel - 1 inputs [conv_dim] at `conv_bytes`."""
        recurrent = self.value_heads * self.key_head_dim * self.value_head_dim * self.state_dtype_bytes
        return recurrent + self.conv_dim * (self.conv_kernel - 1) * conv_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about an architecture (config.json's fields, transformers' names)."""
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
    family: str = "llama"           # config.json model_type (the text config's)
    layer_types: tuple = ()         # per layer: full_attention | sliding_attention | linear_attention; () = all full
    sliding_window: Optional[int] = None
    qk_norm: bool = False           # RMSNorm on each head's q and k (Qwen3, Qwen3.5, Gemma 3)
    attention_gate: bool = False    # q_proj also outputs a gate (Qwen3.5's attn_output_gate): 2 x q_dim
    attention_bias: bool = False
    norms_per_layer: int = 2        # hidden-size norms in a decoder layer (Gemma 3: 4)
    linear_attention: Optional[LinearAttention] = None
    experts: int = 0                # mixture of experts (gpt-oss num_local_experts); 0 = a dense MLP
    experts_per_token: int = 0
    extra_params: int = 0           # parameters outside the decoder (a vision tower), kept 16-bit
    extra_what: str = ""
    source: str = ""                # where the numbers came from
    unknown: tuple = field(default=())  # what the plan cannot know of this model, one sentence each

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_per_head

    @property
    def types(self) -> tuple:
        """Each layer's type (all full attention when config.json lists none)."""
        return self.layer_types or (FULL,) * self.layers

    def count(self, layer_type: str) -> int:
        return sum(1 for t in self.types if t == layer_type)

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache (full or sliding-window attention)."""
        return self.layers - self.count(LINEAR)

    def layer_modules(self) -> dict[str, tuple[int, int, int]]:
        """(in, out, layers) of each linear module by its module name (what LoRA's target_modules match): the
        attention projections in the attention layers, the Gated DeltaNet projections in the linear-attention
        layers, the MLP's in every layer (a mixture of experts has none: its experts are `expert_params`, its
        router a module of its own, not nn.Linear)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        modules: dict[str, tuple[int, int, int]] = {}
        attention = self.attention_layers
        if attention:
            modules.update({"q_proj": (h, q * (2 if self.attention_gate else 1), attention),
                            "k_proj": (h, kv, attention), "v_proj": (h, kv, attention), "o_proj": (q, h, attention)})
        la = self.linear_attention
        if la is not None and self.count(LINEAR):
            n = self.count(LINEAR)
            modules.update({"in_proj_qkv": (h, la.conv_dim, n), "in_proj_z": (h, la.value_dim, n),
                            "in_proj_b": (h, la.value_heads, n), "in_proj_a": (h, la.value_heads, n),
                            "out_proj": (la.value_dim, h, n)})
        if not self.experts:
            i = self.intermediate
            modules.update({"gate_proj": (h, i, self.layers), "up_proj": (h, i, self.layers),
                            "down_proj": (i, h, self.layers)})
        return modules

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module in the decoder layers, by its usual module name."""
        return {name: (a, b) for name, (a, b, _) in self.layer_modules().items()}

    @property
    def expert_params(self) -> int:
        """The experts' weights and biases (gpt-oss: gate_up_proj [E, h, 2i] + [E, 2i], down_proj [E, i, h] +
        [E, h])."""
        if not self.experts:
            return 0
        h, i, e = self.hidden, self.intermediate, self.experts
        return self.layers * e * (h * 2 * i + 2 * i + i * h + h)

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear layers and experts: the part 4-bit quantization shrinks."""
        return sum(a * b * n for a, b, n in self.layer_modules().values()) + self.expert_params

    @property
    def other_params(self) -> int:
        """Embeddings, lm_head (unless tied), norms, biases, linear-attention convolutions and gates, a vision
        tower: kept in 16-bit even in a 4-bit model."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        norms = (self.norms_per_layer * self.layers + 1) * self.hidden
        norms += 2 * self.dim_per_head * self.attention_layers if self.qk_norm else 0
        if self.attention_bias:
            norms += (self.q_dim + 2 * self.kv_dim + self.hidden) * self.attention_layers
        if self.family == "gpt_oss":
            norms += self.heads * self.attention_layers   # attention sinks
        if self.experts:
            norms += self.experts * (self.hidden + 1) * self.layers  # the router's weight and bias (not quantized)
        la = self.linear_attention
        if la is not None:
            # conv1d weight [conv_dim, 1, kernel], dt_bias and A_log [value_heads], the gated norm [value_head_dim]
            norms += self.count(LINEAR) * (la.conv_dim * la.conv_kernel + 2 * la.value_heads + la.value_head_dim)
        return embeddings + norms + self.extra_params

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    # ----------------------------------------------------------------------- inference state

    def kv_elements_per_token(self) -> tuple[int, list]:
        """(K + V elements per token of the layers whose cache grows with the sequence, [(window, elements)] of the
        sliding-window layers): linear-attention layers hold a fixed state instead (`state_bytes_per_sequence`)."""
        per_layer = 2 * self.kv_dim
        sliding = self.count(SLIDING) if self.sliding_window else 0
        full = self.attention_layers - sliding
        return full * per_layer, ([(self.sliding_window, sliding * per_layer)] if sliding else [])

    def kv_cache_bytes(self, sequences: int, tokens: int, kv_bytes: int) -> int:
        """The KV cache of `sequences` sequences of `tokens` tokens: full-attention layers keep every token,
        sliding-window layers at most `sliding_window`, linear-attention layers their fixed state."""
        full, sliding = self.kv_elements_per_token()
        per_sequence = full * tokens + sum(e * min(tokens, window) for window, e in sliding)
        return sequences * (per_sequence * kv_bytes + self.state_bytes_per_sequence())

    def state_bytes_per_sequence(self, conv_bytes: int = 2) -> int:
        """The linear-attention layers' state of one sequence (recurrent + convolution state), 0 without them."""
        la = self.linear_attention
        return self.count(LINEAR) * la.state_bytes(conv_bytes) if la is not None else 0

    def describe(self) -> str:
        """One line: the family and what in it the plan counts differently."""
        parts = [f"{self.family}: {self.layers} layers"]
        if self.count(LINEAR):
            parts.append(f"{self.count(LINEAR)} of them Gated DeltaNet (a fixed state per sequence, no KV cache)")
        if self.sliding_window and self.count(SLIDING):
            parts.append(f"{self.count(SLIDING)} sliding-window ({self.sliding_window} tokens of KV cache at most)")
        if self.qk_norm:
            parts.append("q/k norms")
        if self.attention_gate:
            parts.append("gated attention (q_proj 2 x q)")
        if self.experts:
            parts.append(f"{self.experts} experts, {self.experts_per_token} a token")
        if self.extra_params:
            parts.append(f"{self.extra_what} {self.extra_params / 1e6:.0f}M params (16-bit)")
        parts.append(f"vocabulary {self.vocab}")
        return ", ".join(parts)


# --------------------------------------------------------------------------- reading config.json

def _vision_params(vision: dict) -> int:
    """Qwen3.5's vision tower (transformers 5.17 modeling_qwen3_5.Qwen3_5VisionModel): patch embedding (Conv3d with
    bias), position embedding, `depth` blocks (two LayerNorms, qkv and proj with bias, a two-layer MLP with bias),
    the patch merger (LayerNorm, fc1 over spatial_merge_size**2 patches, fc2 to out_hidden_size)."""
    h, i, depth = int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision.get("depth", 27))
    patch = int(vision.get("patch_size", 16))
    kernel = int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2)) * patch * patch
    block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    merged = h * int(vision.get("spatial_merge_size", 2)) ** 2
    out = int(vision.get("out_hidden_size", h))
    merger = 2 * h + (merged * merged + merged) + (merged * out + out)
    return kernel * h + h + int(vision.get("num_position_embeddings", 2304)) * h + depth * block + merger


def family_unknowns(family: str) -> list:
    """What the plan cannot know of a family's memory, one sentence each (the plan prints them)."""
    if family == "qwen3_5":
        return ["the Gated DeltaNet layers' backward working set (flash-linear-attention's chunked kernels) is "
                "estimated from their projections' outputs, not read from the kernels"]
    if family == "gpt_oss":
        return ["which expert modules LoRA adapts and in what precision the experts load depend on the checkpoint "
                "layout unsloth picks (fused experts or its bnb-4bit per-expert Linear; unsloth/models/loader.py): the "
                "experts are counted as 4-bit NF4 weights with no LoRA"]
    return []


def shape_from_config(raw: dict, name: str, source: str = "") -> ModelShape:
    """The shape from a model's config (config.json's mapping, or a loaded model's `config.to_dict()`):
    the one reader of these fields, for the plan, the settings checks and the vLLM engine."""
    top = raw
    raw = raw.get("text_config") or raw  # multimodal configs nest the language model's
    try:
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        family = str(raw.get("model_type") or top.get("model_type") or "llama").removesuffix("_text")
        layer_types = tuple(raw.get("layer_types") or ())
        if family == "gemma3" and not layer_types and raw.get("sliding_window_pattern"):
            pattern = int(raw["sliding_window_pattern"])  # older Gemma 3 configs: every pattern-th layer is full
            layer_types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
        if family == "qwen3_5" and not layer_types:
            interval = int(raw.get("full_attention_interval", 4))  # Qwen3_5TextConfig.__post_init__'s default
            layer_types = tuple(LINEAR if (i + 1) % interval else FULL for i in range(layers))
        if layer_types and len(layer_types) != layers:
            raise PlanError(f"{name}: layer_types lists {len(layer_types)} layers, num_hidden_layers is {layers}")
        linear = None
        if LINEAR in layer_types:
            dtype = str(raw.get("mamba_ssm_dtype") or "float32")
            linear = LinearAttention(int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                                     int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]),
                                     int(raw.get("linear_conv_kernel_dim", 4)), 4 if "32" in dtype else 2)
        extra, extra_what, unknown = 0, "", []
        vision = top.get("vision_config") if top is not raw else None
        if vision:
            if family == "qwen3_5":
                extra, extra_what = _vision_params(vision), "vision tower"
            else:
                unknown.append(f"its vision tower ({vision.get('model_type', 'vision_config')}) is loaded too and "
                               "not counted: the plan reads the text model only")
        # a multimodal model's lm_head is tied by the top-level flag (its ForConditionalGeneration class),
        # else the text's
        unknown += family_unknowns(family)
        tied = (top["tie_word_embeddings"] if top is not raw and "tie_word_embeddings" in top
                else raw.get("tie_word_embeddings", family == "gemma3"))
        return ModelShape(
            name=name, hidden=int(raw["hidden_size"]), layers=layers, heads=heads,
            kv_heads=int(raw.get("num_key_value_heads") or heads), intermediate=int(raw["intermediate_size"]),
            vocab=int(raw["vocab_size"]), tied_embeddings=bool(tied),
            head_dim=raw.get("head_dim"), context=raw.get("max_position_embeddings"), family=family,
            layer_types=layer_types if len(set(layer_types)) > 1 or (layer_types and layer_types[0] != FULL) else (),
            sliding_window=raw.get("sliding_window") if SLIDING in layer_types else None,
            qk_norm=family in ("qwen3", "qwen3_5", "gemma3", "gemma4", "qwen3_moe"),
            attention_gate=bool(raw.get("attn_output_gate", family == "qwen3_5")),
            attention_bias=bool(raw.get("attention_bias", False)),
            norms_per_layer=4 if family in ("gemma2", "gemma3") else 2, linear_attention=linear,
            experts=int(raw.get("num_local_experts") or 0),
            experts_per_token=int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 0),
            extra_params=extra, extra_what=extra_what, source=source, unknown=tuple(unknown),
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
    return _read_json(path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the model shape from {path}: {exc}") from None


def shape_from_config_json(path: Path) -> ModelShape:
    """The shape of a local checkpoint from its config.json (transformers' field names)."""
    raw = local_model_config(str(Path(path).parent))
    if raw is None:
        raise PlanError(f"cannot read the model shape from {path}: no such file")
    return shape_from_config(raw, str(Path(path).parent), source=str(path))


# --------------------------------------------------------------------------- the hub: cache, then config.json alone

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_DOWNLOADED: dict[str, Path] = {}  # hub id -> its config.json downloaded by this process (model_shape says so)
HUB_TIMEOUT_S = 5


def hub_offline() -> bool:
    """huggingface_hub's HF_HUB_OFFLINE (read when it was imported, as every hub call of the run reads it)."""
    from huggingface_hub import constants  # noqa: PLC0415  (imported when a hub id is planned, not at startup)

    return bool(constants.HF_HUB_OFFLINE)


def cached_config_path(repo: str) -> Optional[Path]:
    """`repo`'s config.json in the local hub cache (huggingface_hub.try_to_load_from_cache), None when not there."""
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415  (only for hub ids)

    found = try_to_load_from_cache(repo, "config.json")
    return Path(found) if isinstance(found, str) else None


@functools.lru_cache(maxsize=None)
def _hub_reachable() -> Optional[str]:
    """None when the hub's endpoint answers a TCP connection within HUB_TIMEOUT_S, else why not. Asked once a
    process: hf_hub_download retries an unreachable host for ~25 s before it gives up."""
    import socket  # noqa: PLC0415
    from urllib.parse import urlparse  # noqa: PLC0415

    from huggingface_hub import constants  # noqa: PLC0415

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_TIMEOUT_S).close()
        return None
    except OSError as exc:
        return f"{url.hostname} cannot be reached ({exc.strerror or exc})"


@functools.lru_cache(maxsize=None)
def download_config(repo: str) -> tuple[Optional[Path], str]:
    """(path, '') of `repo`'s config.json downloaded alone into the hub cache (hf_hub_download), or (None, why not)."""
    unreachable = _hub_reachable()
    if unreachable:
        return None, unreachable
    from huggingface_hub import hf_hub_download  # noqa: PLC0415
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError  # noqa: PLC0415

    try:
        return Path(hf_hub_download(repo, "config.json", etag_timeout=HUB_TIMEOUT_S)), ""
    except GatedRepoError:
        return None, f"{repo} is gated: accept its license on the hub and log in (hf auth login)"
    except RepositoryNotFoundError:
        return None, f"the hub has no model {repo}"
    except (HfHubHTTPError, OSError) as exc:
        return None, f"the hub did not give it ({type(exc).__name__})"


def model_shape(name: str) -> ModelShape:
    """The shape of model `name`: a local checkpoint folder's config.json, a built-in, the hub cache's config.json,
    config.json downloaded alone (online), or the offline fallback table; PlanError naming the file otherwise."""
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        return shape_from_config_json(folder / "config.json")
    if folder.is_dir():
        raise PlanError(f"{name} is a folder without a config.json: the plan reads the model's shape from "
                        f"{folder / 'config.json'}; point model.name at the checkpoint folder that has it")
    if name.startswith("builtin:"):
        key = _known_key(name)
        if key is None:
            raise PlanError(f"no built-in model {name!r}: "
                            f"{', '.join(k for k in KNOWN_SHAPES if k.startswith('builtin:'))}")
        return replace(KNOWN_SHAPES[key], source="built locally (lowvram_grpo.model.builtin_models)")
    if not HUB_ID.match(name):
        raise PlanError(f"model.name {name!r} is neither a local folder with a config.json nor a hub id (org/name)")
    if name in _DOWNLOADED:  # fetched earlier in this process: say so, not "in the cache"
        return shape_from_config(_read_json(_DOWNLOADED[name]), name,
                                 source=f"config.json downloaded from the hub ({_DOWNLOADED[name]})")
    cached = cached_config_path(name)
    if cached is not None:
        return shape_from_config(_read_json(cached), name, source=f"config.json in the hub cache ({cached})")
    why = "HF_HUB_OFFLINE is set" if hub_offline() else ""
    if not why:
        path, why = download_config(name)
        if path is not None:
            _DOWNLOADED[name] = path
            return shape_from_config(_read_json(path), name, source=f"config.json downloaded from the hub ({path})")
    key = _known_key(name)
    if key is not None:
        return replace(KNOWN_SHAPES[key], name=name,
                       source=f"lowvram_grpo.settings.model_shapes.KNOWN_SHAPES[{key!r}], the offline fallback "
                              f"({why}); where its numbers come from: SHAPE_SOURCES[{key!r}]")
    from huggingface_hub import constants  # noqa: PLC0415

    raise PlanError(
        f"cannot plan for {name}: its config.json is not in the local hub cache ({constants.HF_HUB_CACHE}) and "
        f"was not downloaded ({why}); download that one file (hf download {name} config.json) or set "
        "model.name to a local folder with its config.json")


# --------------------------------------------------------------------------- derived once for a run

@dataclass(frozen=True)
class ModelFacts:
    """What a run knows of its model before loading it, derived once (model_facts; plans.run_plan keeps it as
    `plan.model.facts`): the shape (model_shape) or why there is none, and what a local checkpoint's own
    config.json says. The settings checks, the step-time estimate, the memory plan and the doctor read this one."""
    name: str
    shape: Optional[ModelShape] = None
    why_no_shape: str = ""                  # model_shape's PlanError where shape is None
    local: bool = False                     # `name` is a local folder with a config.json (read)
    local_error: str = ""                   # that config.json could not be read (local_model_config's PlanError)
    local_context: Optional[int] = None     # its (text config's) max_position_embeddings
    local_model_type: Optional[str] = None  # its (text config's) model_type, as written
    local_architectures: tuple = ()         # its `architectures`

    def require_shape(self) -> ModelShape:
        """The shape; PlanError (model_shape's own) where there is none."""
        if self.shape is None:
            raise PlanError(self.why_no_shape)
        return self.shape


def model_facts(name: str) -> ModelFacts:
    """ModelFacts of model `name`: its local config.json (local_model_config) and its shape (model_shape), each
    read once. Never raises PlanError: what is missing is kept, and raised by what needs it (require_shape)."""
    try:
        raw = local_model_config(name)
    except PlanError as exc:  # an unreadable config.json: checks.check_model_folder refuses it in one line
        return ModelFacts(name, why_no_shape=str(exc), local=True, local_error=str(exc))
    local: dict = {}
    if raw is not None:
        text = (raw.get("text_config") or raw) if isinstance(raw, dict) else {}
        text = text if isinstance(text, dict) else {}
        local = dict(local=True, local_context=text.get("max_position_embeddings"),
                     local_model_type=text.get("model_type"),
                     local_architectures=tuple((raw.get("architectures") or []) if isinstance(raw, dict) else []))
        if not isinstance(raw, dict):  # not a mapping (check_model_folder refuses it): no shape to read from it
            return ModelFacts(name, why_no_shape=f"cannot read the model shape from {name}/config.json: "
                                                 "not a JSON object", **local)
    try:
        return ModelFacts(name, shape=model_shape(name), **local)
    except PlanError as exc:
        return ModelFacts(name, why_no_shape=str(exc), **local)


# --------------------------------------------------------------------------- the offline fallback table

def _shape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, context, head_dim=None,
           **family) -> ModelShape:
    return ModelShape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, head_dim, context, **family)


def _pattern(layers: int, every: int, other: str) -> tuple:
    """Every `every`-th layer full attention, the rest `other` (Gemma 3's sliding_window_pattern, Qwen3.5's
    full_attention_interval)."""
    return tuple(FULL if (i + 1) % every == 0 else other for i in range(layers))


_QWEN3_5_0_8B_VISION = {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "in_channels": 3,
                        "num_position_embeddings": 2304, "out_hidden_size": 1024, "patch_size": 16,
                        "spatial_merge_size": 2, "temporal_patch_size": 2}

# The config.json values of the models the presets use (and a few neighbours): the plan's fallback when the
# model's own config.json cannot be read (offline, not cached). Keys are matched against the lowercased model
# name with any "org/" prefix and "meta-" dropped. Where each number comes from: SHAPE_SOURCES.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": _shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, 131072),
    "llama-3-8b": _shape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, False, 8192),
    "llama-3.2-3b": _shape("Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, True, 131072),
    "llama-3.2-1b": _shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True, 131072),
    "qwen2.5-7b": _shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, 32768, family="qwen2"),
    "qwen2.5-3b": _shape("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True, 32768, family="qwen2"),
    "qwen2.5-1.5b": _shape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, 32768, family="qwen2"),
    "qwen2.5-0.5b": _shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, 32768, family="qwen2"),
    "qwen3-4b": _shape("Qwen3-4B", 2560, 36, 32, 8, 9728, 151936, True, 40960, 128, family="qwen3", qk_norm=True),
    "qwen3.5-0.8b": _shape(
        "Qwen3.5-0.8B", 1024, 24, 8, 2, 3584, 248320, True, 262144, 256, family="qwen3_5",
        layer_types=_pattern(24, 4, LINEAR), qk_norm=True, attention_gate=True,
        linear_attention=LinearAttention(16, 16, 128, 128, 4, 4),
        extra_params=_vision_params(_QWEN3_5_0_8B_VISION), extra_what="vision tower",
        unknown=tuple(family_unknowns("qwen3_5"))),
    "gemma-3-1b": _shape("Gemma-3-1B", 1152, 26, 4, 1, 6912, 262144, True, 32768, 256, family="gemma3",
                         layer_types=_pattern(26, 6, SLIDING), sliding_window=512, qk_norm=True, norms_per_layer=4),
    "gpt-oss-20b": _shape("gpt-oss-20b", 2880, 24, 64, 8, 2880, 201088, False, 131072, 64, family="gpt_oss",
                          layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(24)), sliding_window=128,
                          attention_bias=True, experts=32, experts_per_token=4,
                          unknown=tuple(family_unknowns("gpt_oss"))),
    "smollm2-135m": _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192, 64),
    "builtin:smollm2": _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192, 64),
    "builtin:tiny": _shape("builtin:tiny", 64, 2, 4, 2, 128, 512, False, 2048, 16),
}

# Where the table's numbers come from (read through the search tools: huggingface.co itself is not reachable from
# the machines this was written on, so the copies named here were read, and the families' layouts checked against
# transformers 5.17's own config classes by tests/test_memory.py).
_CONFIG_JSON = ("the model's config.json (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                "intermediate_size, vocab_size, tie_word_embeddings, max_position_embeddings); the parameter count it "
                "gives checked against the published one by tests/test_memory.py")
SHAPE_SOURCES: dict[str, str] = {
    **{key: _CONFIG_JSON for key in ("llama-3.1-8b", "llama-3-8b", "llama-3.2-1b", "qwen2.5-7b", "qwen2.5-3b",
                                     "qwen2.5-1.5b", "qwen2.5-0.5b", "smollm2-135m")},
    "builtin:smollm2": "the SmolLM2-135M-Instruct config.json shipped in its wheel (lowvram_grpo.model.smollm2)",
    "builtin:tiny": "lowvram_grpo.model.builtin_models, which builds it from these numbers",
    "qwen3-4b": "Qwen/Qwen3-4B config.json (hidden_size 2560, num_hidden_layers 36, 32/8 heads, head_dim 128, "
                "intermediate_size 9728, vocab_size 151936, tie_word_embeddings true, max_position_embeddings 40960), "
                "as copied into public code found by the code search; the model card's 36 layers, 32 Q / 8 KV heads",
    "qwen3.5-0.8b": "Qwen/Qwen3.5-0.8B@2fc06364 config.json as quoted in a public test fixture (text: hidden_size "
                    "1024, 24 layers = 3 linear_attention + 1 full_attention x 6, 8/2 heads, head_dim 256, "
                    "intermediate_size 3584, linear 16/16 heads of 128, conv kernel 4, vocab 248320, tied, "
                    "attn_output_gate; vision: depth 12, hidden 768, intermediate 3072, out_hidden_size 1024); "
                    "mamba_ssm_dtype float32 as in Qwen3.5 configs quoted elsewhere",
    "gemma-3-1b": "google/gemma-3-1b-it config.json as quoted in public code (\"gemma-3-1B's real values\": "
                  "hidden_size 1152, 26 layers, 4/1 heads, head_dim 256, intermediate_size 6912, sliding_window 512, "
                  "sliding_window_pattern 6, max_position_embeddings 32768); vocab_size 262144 and tied embeddings as "
                  "in transformers' Gemma3TextConfig defaults",
    "gpt-oss-20b": "openai/gpt-oss-20b config.json as quoted in public code (hidden_size 2880, 24 layers, 64/8 heads, "
                   "head_dim 64, intermediate_size 2880, 32 local experts, 4 a token, vocab_size 201088, "
                   "sliding_window 128, layer_types sliding/full alternating, attention_bias true, MXFP4 experts)",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct config.json (hidden_size 3072, 28 layers, 24/8 heads, "
                    "intermediate_size 8192, vocab_size 128256, tied); parameter count checked against the "
                    "published 3.21B",
}


def _known_key(name: str) -> Optional[str]:
    """The KNOWN_SHAPES key model `name` matches, None when none does."""
    key = name.lower()
    if not key.startswith("builtin:"):
        key = key.rsplit("/", 1)[-1].replace("meta-", "")
    for known in KNOWN_SHAPES:
        if key == known or key.startswith(known + "-") or key.startswith(known + "_"):
            return known
    return None


# --------------------------------------------------------------------------- what vLLM 0.31 and unsloth do, by family

# unsloth 2026.10.9 (unsloth/models/loader.py, unsloth_zoo/model_lists.py), read again by tests/test_family_wheels.py:
# families whose weights unsloth's fast_inference cannot share with vLLM (it switches to its own generation),
# families it runs vLLM for only on compute capability >= 8.0, and families it trains in float32 where the card has
# no bf16 (FORCE_FLOAT32: "float16 NaNs the grad_norm"; matched on model_type with "_" dropped, so gemma3_text too).
UNSLOTH_NO_VLLM = ("gpt_oss",)
# families whose decoder modules have the usual names (q/k/v/o_proj, gate/up/down_proj): checks.py checks
# lora.target_modules against them before loading (gpt-oss's experts are parameters, not such modules)
STANDARD_MODULE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5", "gemma3")
UNSLOTH_VLLM_NEEDS_SM80 = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
UNSLOTH_FORCE_FLOAT32 = ("gemma3", "gemma3n", "gemma4", "glm4_moe", "gpt_oss", "qwen3_5", "qwen3_moe")

@dataclass(frozen=True)
class VllmServes:
    """What the pinned vLLM (0.31.0, with vllm-bnb-plugin 0.0.3) serves of a family, read in its wheel
    (tests/test_family_wheels.py reads it again and fails when it changes)."""

    lora: Optional[bool]          # the model class implements SupportsLoRA
    bnb_4bit: Optional[bool]      # its weights load through the bitsandbytes loader (packed_modules_mapping)
    unsloth_vllm: Optional[bool]  # unsloth's fast_inference shares the weights with vLLM (not in
                                  # VLLM_UNSUPPORTED_MODEL_TYPES)
    model_file: str               # vllm/model_executor/models/<file>
    model_class: str
    why_not: str = ""             # why a run of this family goes without vLLM, when it does


VLLM_FAMILIES: dict[str, VllmServes] = {
    "llama": VllmServes(True, True, True, "llama.py", "LlamaForCausalLM"),
    "qwen2": VllmServes(True, True, True, "qwen2.py", "Qwen2ForCausalLM"),
    "qwen3": VllmServes(True, True, True, "qwen3.py", "Qwen3ForCausalLM"),
    "qwen3_5": VllmServes(True, True, True, "qwen3_5.py", "Qwen3_5ForConditionalGeneration"),
    "gemma3": VllmServes(True, True, True, "gemma3.py", "Gemma3ForCausalLM"),
    "gpt_oss": VllmServes(True, False, False, "gpt_oss.py", "GptOssForCausalLM",
                          why_not="unsloth 2026.10.9 lists gpt_oss in VLLM_UNSUPPORTED_MODEL_TYPES "
                                  "(unsloth/models/loader.py): fast_inference switches to unsloth's own generation"),
}


def vllm_serves(shape: ModelShape) -> Optional[VllmServes]:
    """What vLLM 0.31 serves of the shape's family, None when the family was not read."""
    return VLLM_FAMILIES.get(shape.family)
