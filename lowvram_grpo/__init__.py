"""lowvram_grpo: GRPO + LoRA reasoning training on one small GPU (Unsloth 4-bit + vLLM), or on a CPU.

    from lowvram_grpo import train
    result = train("tiny", ["train.max_steps=3"], output_dir="runs/tiny")
    result.summary["after"]["reward_mean"]

Nothing heavy is imported here, so `lowvram_grpo.config` and the CLI can pick a backend (and import
unsloth first when it is chosen) before trl/transformers load.
"""
__version__ = "0.1.0"


def train(*args, **kwargs):
    from .pipeline import train as _train

    return _train(*args, **kwargs)


__all__ = ["train", "__version__"]
