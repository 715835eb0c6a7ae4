"""Every reach into transformers', PEFT's, torch's and unsloth's private names (trl_compat: the door to TRL's trainer),
and the marks this package keeps on their objects, each a small function here; nowhere else touches a `_` name of a
model, a layer or a library (tests/test_trl_compat.py::test_private_reaches_go_through_the_doors).

Written for transformers 5.17.0, peft 0.21.2, torch 2.13.0 (requirements*.txt). Nothing heavy is imported here at
module level (settings/ reads the machine through it before any model): each reach is looked up when it is used and a
missing one raises BackendError saying to install the pinned versions; `missing_reaches()` lists them all at once
(tests/test_trl_compat.py checks it against the installed wheels). The reaches:

- `prepare_generation_config(model, generation_config, **kwargs)`: transformers'
  `GenerationMixin._prepare_generation_config`, how generate reads a call's settings (decoding._plan).
- `default_generation_params(config)`: `GenerationConfig._get_default_generation_params`, the values generate gives
  settings nobody set (decoding._neutral_settings).
- `set_adapters_disabled(layer, flag)`: PEFT's `BaseTunerLayer._disable_adapters`, the flag behind its read-only
  `disable_adapters`, which LoraLayer.forward reads (decoding.merged_weights).
- `cuda_driver_version()`: `torch._C._cuda_getDriverVersion()` (CUDA builds of torch only; settings.cuda_facts).
- `mkldnn_bf16_supported()`: `torch.ops.mkldnn._is_mkldnn_bf16_supported()` (settings.hardware).
- `int8_prepack(weight, bias)` / `int8_linear(x, packed)`: torch's quantized API, deprecated in torch 2.13
  (`torch.quantize_per_channel`, `torch.ops.quantized.linear_prepack`, `torch.ops.quantized.linear_dynamic`: FBGEMM's
  dynamic int8 linear on x86), public names but on their way out, so reached here like the private ones
  (fused_decode.FusedLayers with decode.weights=int8; bench/int8_matmul.py measured it); 7-bit activations on a CPU
  without VNNI, where 8 would saturate (`int8_saturates()`).
- `tensor_version(tensor)`: torch's in-place write counter `Tensor._version` (fused_decode's int8 base: repacked when a
  base weight was written; its merged copies: merged again when a base or adapter weight was written).
- `mark_requested_float32(model, value)`: unsloth's `_unsloth_user_float32` (model.unsloth_backend).
- `replace_generate(model, fn)` / `restore_generate(model, own)`: a model's `generate` replaced on the instance (our
  decode loop, decoding.install; the sampler's log-probs, trl_compat.ModelSampler).
- `decode_graph_stats(model)`: unsloth's private `unsloth.models._decode_graphs.stats` (its CUDA-graph decode
  counters, kept on the model's CausalLM), summed for summary.json and the log of a CUDA run on the unsloth backend;
  imported when called (unsloth is not in the CPU set), None where it is missing.
- `custom_op_alias_check_warns()`: torch's `torch._functorch.config.error_on_custom_op_aliasing` set False (a warning,
  not an error, under unsloth's compiled GRPO loss: model.unsloth_backend._pool_alias_check_warns says why).
- `forget_gguf_origin(config)`: a transformers config's `quantization_config` and private `_name_or_path` removed
  (model.smollm2: the plain float copy of a GGUF-loaded model is neither quantized nor that file).
- `mark(obj, name)` / `set_mark(obj, name, value)`: our own marks on a model or layer (MARKS), kept as `_lowvram_<name>`
  attributes so that PEFT's and transformers' attribute forwarding never meets them.
"""
from __future__ import annotations

import functools
import importlib
import warnings

from lowvram_grpo.core.cpu import cpu_flags
from lowvram_grpo.core.errors import BackendError

WRITTEN_FOR = {"transformers": "5.17.0", "peft": "0.21.2", "torch": "2.13.0"}
# (module, owner's dotted path in it ('' = the module itself), private or deprecated attribute): each reach this
# module makes
REACHES = (
    ("transformers.generation.utils", "GenerationMixin", "_prepare_generation_config"),
    ("transformers.generation.configuration_utils", "GenerationConfig", "_get_default_generation_params"),
    ("peft.tuners.tuners_utils", "BaseTunerLayer", "_disable_adapters"),
    ("torch", "ops.mkldnn", "_is_mkldnn_bf16_supported"),
    ("torch", "_C", "_cuda_getDriverVersion"),  # CUDA builds only: missing_reaches skips it on a CPU torch
    ("torch", "", "quantize_per_channel"),      # deprecated in torch 2.13 (the quantized API): decode.weights=int8
    ("torch", "ops.quantized", "linear_prepack"),
    ("torch", "ops.quantized", "linear_dynamic"),
    ("torch", "Tensor", "_version"),           # fused_decode's keys: int8_base, merged_copies
)
MARKS = ("decode", "decode_calls", "logprobs", "contiguous_input")
UNSLOTH_FLOAT32 = "_unsloth_user_float32"  # unsloth 2026.10.9: loader.py sets it, UnslothGRPOTrainer.__init__ reads it


def _owner(module: str, path: str):
    owner = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    return owner


def _dotted(module: str, path: str, name: str) -> str:
    return ".".join(part for part in (module, path, name) if part)


def _reach(module: str, path: str, name: str):
    """The private (or deprecated) `name` of `module`.`path`; BackendError naming the pins when it is gone."""
    try:
        return getattr(_owner(module, path), name)
    except AttributeError:
        pins = " ".join(f"{k}=={v}" for k, v in WRITTEN_FOR.items())
        raise BackendError(f"lowvram_grpo uses {_dotted(module, path, name)}, which the installed "
                           f"{module.split('.')[0]} "
                           f"does not have: install the pinned versions (pip install {pins})") from None


def missing_reaches() -> list[str]:
    """Each REACHES entry the installed libraries lack ('module.owner.name'); [] when all are there."""
    import torch  # the reaches' owners are torch's, transformers' and PEFT's

    missing = []
    for module, path, name in REACHES:
        if (path, name) == ("_C", "_cuda_getDriverVersion") and torch.version.cuda is None:
            continue
        try:
            _reach(module, path, name)
        except BackendError:
            missing.append(_dotted(module, path, name))
    return missing


# --------------------------------------------------------------------------- transformers' and PEFT's generation

def prepare_generation_config(model, generation_config, **kwargs) -> tuple:
    """(GenerationConfig, model kwargs) for a generate call on `model` (not a PEFT wrapper), as its generate reads
    them."""
    _reach("transformers.generation.utils", "GenerationMixin", "_prepare_generation_config")
    return model._prepare_generation_config(generation_config, **kwargs)


def default_generation_params(config) -> dict:
    """The defaults transformers' generate gives the settings of GenerationConfig `config` that nobody set."""
    _reach("transformers.generation.configuration_utils", "GenerationConfig", "_get_default_generation_params")
    return config._get_default_generation_params()


def set_adapters_disabled(layer, flag: bool) -> None:
    """Set PEFT's flag behind `layer.disable_adapters` (its forward then runs the base layer alone)."""
    _reach("peft.tuners.tuners_utils", "BaseTunerLayer", "_disable_adapters")
    layer._disable_adapters = flag


def replace_generate(model, fn):
    """Make `fn` the instance's `generate`; returns the instance's own one before (None: the class's)."""
    own = model.__dict__.get("generate")
    model.generate = fn
    return own


def restore_generate(model, own) -> None:
    """Undo replace_generate: `own` (its return) back, or the class's generate when it was None."""
    if own is None:
        model.__dict__.pop("generate", None)
    else:
        model.generate = own


# --------------------------------------------------------------------------- torch's machine facts

def cuda_driver_version() -> int:
    """The CUDA driver's version as torch reads it (e.g. 12090 for 12.9)."""
    return _reach("torch", "_C", "_cuda_getDriverVersion")()


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU; False where this torch cannot say."""
    try:
        return bool(_reach("torch", "ops.mkldnn", "_is_mkldnn_bf16_supported")())
    except (BackendError, RuntimeError):
        return False


# --------------------------------------------------------------------------- torch's quantized int8 linear (deprecated)

INT8_DEPRECATION = r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor creation"


def int8_prepack(weight, bias=None):
    """`weight` [out, in] (any float dtype) as the packed int8 weight of torch's quantized linear: symmetric, one
    scale per output row (max |w| / 127, zero point 0, so the largest entry of each row is exactly +-127), packed once
    for FBGEMM's kernels with `bias` [out] (float32) beside it; int8_linear multiplies with it. Half the bytes of a
    16-bit weight. The deprecation warning torch 2.13 gives for the quantized tensor this goes through is silenced
    here, where the reach is."""
    import torch

    quantize = _reach("torch", "", "quantize_per_channel")
    prepack = _reach("torch", "ops.quantized", "linear_prepack")
    w32 = weight.detach().float()
    scale = w32.abs().amax(1).clamp(min=1e-8) / 127                                          # [out]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=INT8_DEPRECATION, category=UserWarning)
        quantized = quantize(w32, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
    return prepack(quantized, None if bias is None else bias.detach().float())


def int8_linear(x, packed):
    """x [..., in] times int8_prepack's weight, + its bias, in x's dtype: FBGEMM's dynamic int8 linear
    (`quantized::linear_dynamic`: x in float32 quantized per call to 8 bits with one scale for the tensor, int32
    accumulation, float32 out). On a CPU without VNNI the activations get 7 bits (int8_saturates)."""
    out = _linear_dynamic()(x.float(), packed, int8_saturates())
    return out if out.dtype == x.dtype else out.to(x.dtype)


VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


@functools.cache
def int8_saturates() -> bool:
    """Whether FBGEMM's int8 kernels on this CPU add products in 16-bit pairs that saturate: x86 without VNNI
    (AVX2, or AVX512 before Cascade Lake) multiplies with `vpmaddubsw`, whose int16 sum of two u8 x s8 products
    clips past 32767, so the activations must keep to 7 bits (torch's `reduce_range`, as its fbgemm qconfig does).
    Measured on an AVX2-only EPYC: 8-bit activations 2.1% error on tests/test_decode_int8.py's product, 7-bit 1.1%.
    With VNNI (`vpdpbusd` adds in int32) the full 8 bits are exact to accumulate. False where no flags can be read
    (not Linux x86: FBGEMM is x86's)."""
    flags = cpu_flags()
    return bool(flags) and not (VNNI_FLAGS & flags)


@functools.cache
def _linear_dynamic():
    return _reach("torch", "ops.quantized", "linear_dynamic")


def tensor_version(tensor) -> int:
    """How many in-place writes `tensor` has had (torch's `_version`; autograd's own check reads it)."""
    return _reach("torch", "Tensor", "_version").__get__(tensor)


# --------------------------------------------------------------------------- unsloth's float32 mark, and ours

def mark_requested_float32(model, requested: bool) -> None:
    """Record on `model` whether float32 was asked for (unsloth's mark), unless it carries one already."""
    if getattr(model, UNSLOTH_FLOAT32, None) is None:
        setattr(model, UNSLOTH_FLOAT32, requested)


def _mark_name(name: str) -> str:
    if name not in MARKS:
        raise ValueError(f"unknown mark {name!r}: one of {', '.join(MARKS)}")
    return f"_lowvram_{name}"


def custom_op_alias_check_warns() -> None:
    """torch's custom-op alias check a warning, not an error (its private functorch config; see the module list)."""
    import torch._functorch.config as functorch_config  # torch's private config module: imported when asked for

    functorch_config.error_on_custom_op_aliasing = False


def forget_gguf_origin(config) -> None:
    """Remove `quantization_config` and transformers' private `_name_or_path` from a model config, where set."""
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass


def mark(obj, name: str, default=None):
    """Our mark `name` (one of MARKS) on `obj`, or `default` where it has none."""
    return getattr(obj, _mark_name(name), default)


def set_mark(obj, name: str, value) -> None:
    """Set our mark `name` (one of MARKS) on `obj`."""
    setattr(obj, _mark_name(name), value)


# --------------------------------------------------------------------------- unsloth's decode graphs (summary, log)
# unsloth 2026.10.9 (unsloth/models/_decode_graphs.py): `stats(model)` reads the counters a model's CausalLM keeps in
# its __dict__ under this name (captures, replays, graphs, eager_steps, disabled); the state lives on the module the
# decode forward runs on, under any PEFT wrapper, so every module holding one is read. tests/test_gpu_wheels.py reads
# these lines in the pinned wheel.
DECODE_GRAPHS_MODULE = "unsloth.models._decode_graphs"
DECODE_GRAPHS_STATE = "_unsloth_decode_graphs"
DECODE_GRAPH_COUNTERS = ("captures", "replays", "graphs", "eager_steps")


def missing_decode_graph_stats() -> list[str]:
    """[] when the installed unsloth has the decode-graph counters decode_graph_stats reads; else what is missing.
    Checked when the unsloth backend is prepared (unsloth_backend.prepare: a warning, the counters are a report)."""

    try:
        graphs = importlib.import_module(DECODE_GRAPHS_MODULE)
    except ImportError as exc:
        return [f"{DECODE_GRAPHS_MODULE} ({type(exc).__name__}: {exc})"]
    return [] if callable(getattr(graphs, "stats", None)) else [f"{DECODE_GRAPHS_MODULE}.stats"]


def decode_graph_stats(model) -> dict | None:
    """unsloth's decode CUDA-graph counters of `model` summed over the modules that hold them ({} where none was ever
    captured or run: no graph state), plus `disabled` (the first reason unsloth gave, else None); None where unsloth's
    module does not import (the CPU set) or lacks `stats` (another unsloth than requirements.txt's)."""

    try:
        graphs = importlib.import_module(DECODE_GRAPHS_MODULE)
    except ImportError:
        return None
    stats = getattr(graphs, "stats", None)
    if not callable(stats):
        return None
    found = [stats(m) for m in model.modules() if DECODE_GRAPHS_STATE in getattr(m, "__dict__", {})]
    if not found:
        return {}
    out = {key: sum(int(s.get(key) or 0) for s in found) for key in DECODE_GRAPH_COUNTERS}
    out["disabled"] = next((s.get("disabled") for s in found if s.get("disabled")), None)
    return out


def describe_decode_graphs(stats: dict | None, decided: bool) -> str:
    """One log line for a CUDA run on the unsloth backend: what unsloth's decode graphs did against what resolve
    decided."""
    if stats is None:
        return "unsloth decode CUDA graphs: unsloth's _decode_graphs.stats is not available here"
    if not stats:
        return f"unsloth decode CUDA graphs: none captured (decided {'on' if decided else 'off'})"
    line = (f"unsloth decode CUDA graphs: {stats['captures']} captures, {stats['replays']} replays, "
            f"{stats['eager_steps']} eager steps (decided {'on' if decided else 'off'})")
    return line + (f"; disabled: {stats['disabled']}" if stats.get("disabled") else "")
