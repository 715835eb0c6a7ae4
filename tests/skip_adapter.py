"""Run the CLI in this process with a sampler that ignores the adapter, the fault planted where it happens.

    python tests/skip_adapter.py FAULT CLI-ARGS...     (run from the repository root)

FAULT is one of:
- `merge-skipped`: our decode loop samples with the adapter's merge skipped: fused_decode.merged_weight (the one
  place the loop's merged weights come from, fused layers or not) returns the base weight as it is, so every
  rollout comes from the base model while the trainer trains and scores the adapter;
- `lora-sync-cut`: (model.generation=vllm) our vLLM engine's adapter sync loads the first adapter only
  (vllm.engine.LocalVLLMEngine.sync returns the version it serves without saving or loading the new weights): the
  engine keeps sampling from the adapter as it was at step 0, PEFT's B = 0, i.e. the base model; unsloth #8701's
  failure, which `fast_inference` GRPO shipped with.

Nothing else is changed: the trainer, TRL and the guard (training/adapter_check.py) run as in any run. The CLI's
`main` (not `cli`, which may restart the process on another allocator) runs it.
"""
from __future__ import annotations

import sys

FAULTS = ("merge-skipped", "lora-sync-cut")


def plant(fault: str) -> None:
    if fault == "merge-skipped":
        from lowvram_grpo.model import decoding, fused_decode

        def base_weight(module):
            base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            return base.weight.detach()

        fused_decode.merged_weight = base_weight
        decoding.merged_weight = base_weight  # its own name for it (decoding.merged_weights, the unfused loop)
    elif fault == "lora-sync-cut":
        from lowvram_grpo.model.vllm import engine

        sync = engine.LocalVLLMEngine.sync

        def first_only(self, model, step):
            if self.policy is None:
                return sync(self, model, step)
            return self.policy.version  # the new adapter never reaches the engine

        engine.LocalVLLMEngine.sync = first_only
    else:
        raise SystemExit(f"error: unknown fault {fault!r}: one of {', '.join(FAULTS)}")


if __name__ == "__main__":
    plant(sys.argv[1])
    from lowvram_grpo.run.cli import main

    sys.exit(main(sys.argv[2:]))
