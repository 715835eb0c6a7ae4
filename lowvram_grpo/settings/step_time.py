"""A conservative estimate of one GRPO step's seconds, for the checkpoint cadence (resolve.choose_save_steps).

No GPU preset has trained on a card yet (docs/gpu.md), so this is arithmetic on each card's spec-sheet figures,
rounded to the slow side: a checkpoint that comes early costs a few seconds of writing, one that comes late loses
the work since the last one when a session ends without SIGTERM's grace (a Colab teardown, a kill).

    seconds = step_seconds(plan, hardware, generation, completions, dtype, load_in_4bit)   # None: no shape known

One step = the rollouts' decode + the training pass over them:
- decode: the completions of a generation batch decode together, so max_completion_length token steps (with tools:
  up to tools.max_turns + 1 turns of RunConfig.turn_tokens each), each reading every weight once:
  max(weight bytes / (memory bandwidth x efficiency), a floor). vLLM: efficiency 0.5, floor 25 ms (its scheduler and
  sampler each step); transformers' generate (and unsloth's, and our loop): efficiency 0.3, floor 100 ms, what the
  H100 measured with transformers' generation of 512 tokens (docs/gpu.md: ~30 s a step on unsloth, ~51 s on hf, a
  random 4-bit Qwen2.5-1.5B: 60-100 ms a token).
- training: 10 x parameters x tokens FLOPs (forward, backward through the frozen base, recomputation under gradient
  checkpointing, the reference pass for beta > 0 and TRL's scoring pass: each counted whether or not it runs) over
  the generation batch's prompt + completion tokens, at a sustained rate of about an eighth of the card's dense
  FP16 tensor peak (4-bit dequantization, LoRA's small matmuls, a batch of one group).
- a card not in the table (the card present, by its name) is planned as the slowest row: 272 GB/s, 6 TFLOP/s.
- a CPU: 10 GB/s and 0.2 TFLOP/s with native bf16 (0.07 without): ~40 s a step for smollm2_cpu, whose measured
  steps took 7.1-24.5 s on the 2-core machines of bench/results/readme_first_command/.
Pure arithmetic on the run's plan (plans.RunPlan) and its model's shape, derived once (plan.model.facts): no torch,
no hub.

That estimate decides the plan before anything has run; once the run has trained, its own steps decide
(`MeasuredStepTime`): after CALIBRATION_STEPS GRPO steps the estimate is the median of the steps measured since the
first (the first carries the warm-up: allocators, caches, on a GPU the compiling), over the last WINDOW of them, so it
follows the run as it goes; `checkpoint_cadence` and `curve_every` turn it into the checkpoint cadence and the held-out
curve's interval (training/cadence.py applies them).
"""
from __future__ import annotations

from typing import Optional

# card (hardware.PROFILES' gpu_name) -> (memory bandwidth GB/s, sustained training TFLOP/s). Bandwidth and the dense
# FP16 tensor peak from NVIDIA's spec sheets; the TFLOP/s here about 1/8 of that peak.
CARDS: dict[str, tuple[float, float]] = {
    "Tesla T4": (320, 8),                       # 65 TFLOP/s FP16 tensor
    "Tesla V100-SXM2-16GB": (900, 15),          # 125
    "NVIDIA GeForce RTX 3060": (360, 6),        # 51
    "NVIDIA GeForce RTX 4060": (272, 7),        # 60
    "NVIDIA GeForce RTX 3090": (936, 9),        # 71
    "NVIDIA GeForce RTX 4090": (1008, 20),      # 165
    "NVIDIA L4": (300, 15),                     # 121
    "NVIDIA A10G": (600, 9),                    # 70
    "NVIDIA A100-SXM4-40GB": (1555, 39),        # 312
    "NVIDIA H100 80GB HBM3": (3350, 120),       # 989
}
UNKNOWN_CARD = (272, 6)  # the slowest bandwidth and rate above
CPU_BANDWIDTH_GBS = 10
CPU_TFLOPS = {True: 0.2, False: 0.07}  # native bf16 or not
VLLM_DECODE = (0.5, 0.025)           # (bandwidth efficiency, floor in seconds) of one decode step
TRANSFORMERS_DECODE = (0.3, 0.100)
TRAINING_PASSES = 10                 # FLOPs per parameter and token: 5 passes of 2
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def card_speed(hardware) -> tuple[float, float, str]:
    """(bandwidth GB/s, training TFLOP/s, what they are) for `hardware`: its row of CARDS, the slowest for a card
    not in it, the CPU's figures on a CPU."""
    if not hardware.cuda:
        native = bool(hardware.cpu_bf16)
        return CPU_BANDWIDTH_GBS, CPU_TFLOPS[native], f"a CPU ({'native' if native else 'no native'} bf16)"
    name = hardware.gpu_name or ""
    if name in CARDS:
        return (*CARDS[name], name)
    return (*UNKNOWN_CARD, f"{name or 'a card'} (not in step_time.CARDS: planned as the slowest there)")


def weight_bytes(shape, load_in_4bit: bool, dtype: str) -> float:
    """What one decode step reads: the linear layers in NF4 (half a byte, plus a 1/32 of scales) when 4-bit, the
    rest in the compute dtype."""
    if load_in_4bit:
        return shape.linear_params * 0.5 * (1 + 1 / 32) + shape.other_params * 2
    return shape.params * BYTES.get(dtype, 2)


def step_seconds(plan, hardware, generation: str, completions: int, dtype: str,
                 load_in_4bit: bool) -> Optional[tuple[float, str]]:
    """(seconds, where the figures come from) of one GRPO step of the run planned as `plan` (plans.RunPlan) on
    `hardware`, generating with `generation` ('unsloth_vllm' | 'vllm' | 'transformers') `completions` completions a
    step per process, computing in `dtype` on a 4-bit base or not; None when the model's shape is not known (its
    plan's facts have none: model_shapes raised PlanError)."""
    shape = plan.model.facts.shape
    if shape is None:
        return None
    bandwidth, tflops, what = card_speed(hardware)
    efficiency, floor = VLLM_DECODE if generation in ("unsloth_vllm", "vllm") else TRANSFORMERS_DECODE
    per_token = max(weight_bytes(shape, load_in_4bit, dtype) / (bandwidth * 1e9 * efficiency), floor)
    decode_steps = plan.model.max_completion_length
    tools = plan.tools
    if tools.used:  # a tool loop: up to max_turns + 1 turns, each its own decode
        decode_steps = max(decode_steps, (tools.max_turns + 1) * tools.turn_tokens)
    tokens = completions * plan.model.rollout_tokens
    training = TRAINING_PASSES * shape.params * tokens / (tflops * 1e12)
    return decode_steps * per_token + training, what


CALIBRATION_STEPS = 3  # GRPO steps a process runs before its own measure replaces the plan's estimate
WINDOW = 8             # the estimate is the median of at most this many of the latest steps (the first left out)


class MeasuredStepTime:
    """A GRPO step's seconds on this machine, from the run's own steps, corrected as the run goes.

        timer = MeasuredStepTime(planned=41.0)     # the plan's estimate (step_seconds), or None
        timer.add(16.9); timer.add(16.4); timer.add(16.6)
        timer.seconds, timer.measured, timer.basis()  # 16.5, True, 'measured over steps 2-3'

    Args:
        planned: the plan's estimate, used until `calibration` steps are measured (None: none).
        calibration: how many steps this process runs before its own measure counts.
        first_step: the GRPO step the process starts after (a resumed run's checkpoint step), for `basis`'s names.
    """

    def __init__(self, planned: Optional[float], calibration: int = CALIBRATION_STEPS, first_step: int = 0):
        self.planned, self.calibration, self.first_step = planned, max(1, calibration), first_step
        self.steps: list[float] = []

    def add(self, seconds: float) -> None:
        self.steps.append(float(seconds))

    @property
    def measured(self) -> bool:
        return len(self.steps) >= self.calibration

    def _counted(self) -> list[float]:
        counted = self.steps[1:] or self.steps  # the first step warms up, unless it is the only one
        return counted[-WINDOW:]

    @property
    def seconds(self) -> Optional[float]:
        """The measured median once calibrated, the plan's estimate before."""
        if not self.measured:
            return self.planned
        counted = sorted(self._counted())
        middle = len(counted) // 2
        return counted[middle] if len(counted) % 2 else (counted[middle - 1] + counted[middle]) / 2

    def basis(self) -> str:
        """'measured over steps 2-3' (the GRPO steps the figure is the median of), or 'estimated'."""
        if not self.measured:
            return "estimated"
        done = self.first_step + len(self.steps)
        first = done - len(self._counted()) + 1
        return f"measured over step {done}" if first == done else f"measured over steps {first}-{done}"


def checkpoint_cadence(seconds: Optional[float], max_steps: int, every_s: float, fallback: int) -> int:
    """GRPO steps between checkpoints: as many as fit in `every_s` seconds at `seconds` a step (at least 1, at most
    `max_steps`); `fallback` without a figure."""
    if not seconds or seconds <= 0:
        return max(1, min(max_steps, fallback))
    return max(1, min(max_steps, int(every_s // seconds)))


def curve_cost(every: int, steps: int, validation_size: int, answer_seconds: float, step_seconds: float) -> float:
    """The held-out curve's share of GRPO's time, measured: its answers (validation_size at step 0, every `every`-th
    step and the last) at `answer_seconds` each, over `steps` GRPO steps at `step_seconds` each."""
    evaluations = -(-steps // every) + 1  # step 0: validation.Validation.start, before GRPO
    return evaluations * validation_size * answer_seconds / (steps * step_seconds)


def curve_every(steps: int, validation_size: int, answer_seconds: float, step_seconds: float,
                budget: float) -> tuple[int, float]:
    """(every N steps, its share) for an automatic held-out curve from measured times: the smallest N whose curve
    (step 0, every N-th step and the last) costs at most `budget` of GRPO's time; (0, the share of the two points of
    step 0 and the last) when none does."""
    for every in range(1, steps + 1):
        share = curve_cost(every, steps, validation_size, answer_seconds, step_seconds)
        if share <= budget:
            return every, share
    return 0, curve_cost(steps, steps, validation_size, answer_seconds, step_seconds)
