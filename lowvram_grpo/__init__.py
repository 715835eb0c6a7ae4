"""lowvram_grpo: GRPO + LoRA reasoning training on one small GPU (Unsloth 4-bit + vLLM), or on a CPU.

    from lowvram_grpo import train
    result = train("tiny", ["train.max_steps=3"], output_dir="runs/tiny")
    result.summary["after"]["reward_mean"]

Step by step (what the notebook does): `lowvram_grpo.run.pipeline.GRPORun`.

Nothing heavy is imported here, so `lowvram_grpo.settings.config` and the CLI can decide the settings (and
bring in unsloth first when it is chosen) before trl/transformers load.
"""
import logging

__version__ = "0.2.0"


class _DropUnactionableNoise(logging.Filter):
    """bitsandbytes 0.50 warns on every CPU start that it cannot fetch an optional kernel from the hub
    (`pip install kernels`); that kernel is downloaded from the Hugging Face hub at run time, which
    offline machines cannot do, and the CPU path works without it. Nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load CPU gemm_4bit_forward from kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropUnactionableNoise())


def train(*args, **kwargs):
    from lowvram_grpo.run.pipeline import train as _train  # importing the package stays light

    return _train(*args, **kwargs)


__all__ = ["train", "__version__"]
