"""A real GRPO step whose first turn is scripted to call three tools, read back from what TRL built: shared by the
transformers-engine run (test_tools.py) and the vLLM-engine run (test_vllm_engine.py).

A random or barely trained model never writes a parseable call, so the first turn every completion writes is
replaced by SCRIPTED (on transformers generation: the first `_generate_single_turn` of a step; on our vLLM engine:
the rollout_func's output). Everything after is the product's and TRL's: parsing the calls, running them through
our wrappers, rendering the results with the model's template, generating the next turn on the run's engine,
building tool_mask and the loss."""
from __future__ import annotations

SCRIPTED = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"word": "pear"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "slow", "arguments": {"seconds": 3}}\n</tool_call><|im_end|>')
RESULTS = ["5", "error: KeyError: 'pear'", "error: TimeoutError: tool 'slow' did not finish within 0.5 seconds"]
# the tool results as the built-in models' (Qwen2.5-style) template renders them after the scripted call
RENDERED_RESULTS = ("\n<|im_start|>user" + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in RESULTS)
                    + "<|im_end|>\n<|im_start|>assistant\n")
TOOL_OVERRIDES = ["tools.names=[calculator, lookup, slow]", "tools.timeout_seconds=0.5"]

TOOLS_FILE = '''
import time


def lookup(word: str) -> str:
    """Look a word up in a small dictionary.

    Args:
        word: The word to look up.
    """
    return {"apple": "a fruit"}[word]


def slow(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "done"


def undocumented(word: str) -> str:
    return word


def unhinted(word):
    """Echo.

    Args:
        word: A word.
    """
    return word


def no_args_section(word: str) -> str:
    """Echo a word."""
    return word


def odd_type(when: tuple[int]) -> str:
    """Echo.

    Args:
        when: One number in a tuple.
    """
    return str(when)


plus = lookup
count = 3
'''


def scripting_build(real_build, seen: dict):
    """A stand-in for training.build_trainer that builds the real trainer, then scripts each step's first turn and
    records into `seen`: the completions TRL's tool loop returned, the batches it trained on, the next-turn calls."""

    def build(handle, *args, **kwargs):
        trainer = real_build(handle, *args, **kwargs)
        tokenizer = handle.tokenizer
        scripted_ids = tokenizer(SCRIPTED, add_special_tokens=False)["input_ids"]
        tool_loop, generate_and_score = trainer._tool_call_loop, trainer._generate_and_score_completions
        seen.setdefault("next_turns", [])

        if trainer.rollout_func is not None:  # our vLLM engine: the first turn is the rollout_func's
            rollout_func, sampler = trainer.rollout_func, trainer.vllm_generation
            next_turn = sampler.generate

            def scripted_rollout(prompts, trainer_):
                out = rollout_func(prompts, trainer_)  # the engine really samples; the first turn is replaced
                n = len(out["completion_ids"])
                seen.setdefault("first_turns", []).append(("vllm", [len(ids) for ids in out["completion_ids"]]))
                return {**out, "completion_ids": [list(scripted_ids) for _ in range(n)],
                        "logprobs": [[0.0] * len(scripted_ids) for _ in range(n)]}

            def counted_next_turn(prompts, *a, **kw):
                result = next_turn(prompts, *a, **kw)
                seen["next_turns"].append(("vllm", len(prompts), [len(ids) for ids in result[1]]))
                return result

            trainer.rollout_func, sampler.generate = scripted_rollout, counted_next_turn
        else:  # transformers generation: the first _generate_single_turn of a step
            turn = {"first": False}
            generate, single_turn = trainer._generate, trainer._generate_single_turn

            def _generate(prompts):
                turn["first"] = True
                return generate(prompts)

            def _generate_single_turn(prompt_ids, *rest, **kw):
                ids, logprobs = single_turn(prompt_ids, *rest, **kw)  # the model really samples
                if turn["first"]:
                    turn["first"] = False
                    seen.setdefault("first_turns", []).append(("transformers", [len(i) for i in ids]))
                    ids = [list(scripted_ids) for _ in ids]
                else:
                    seen["next_turns"].append(("transformers", len(prompt_ids), [len(i) for i in ids]))
                return ids, logprobs

            trainer._generate, trainer._generate_single_turn = _generate, _generate_single_turn

        def _tool_call_loop(*a, **kw):
            result = tool_loop(*a, **kw)
            seen.setdefault("completions", []).extend(result[1])
            return result

        def _generate_and_score_completions(inputs):
            batch = generate_and_score(inputs)
            seen.setdefault("batches", []).append(
                {k: batch[k].clone() for k in ("completion_ids", "completion_mask", "tool_mask")})
            return batch

        trainer._tool_call_loop, trainer._generate_and_score_completions = (_tool_call_loop,
                                                                            _generate_and_score_completions)
        seen["trainer"], seen["tokenizer"], seen["scripted_ids"] = trainer, tokenizer, scripted_ids
        return trainer

    return build


def check_transcripts_and_mask(seen: dict, completions: int) -> None:
    """What the rewards saw (the model's call, the three tools' answers: a result, an error, a timeout; its next
    turn), the wrappers' counts, and the batch TRL trains on: tool_mask is 0 on exactly the rendered tool results,
    1 on everything the model wrote."""
    assert len(seen["completions"]) == completions
    for messages in seen["completions"]:
        assert [m["role"] for m in messages[:4]] == ["assistant", "tool", "tool", "tool"]
        assert [c["function"]["name"] for c in messages[0]["tool_calls"]] == ["calculator", "lookup", "slow"]
        assert [m["content"] for m in messages[1:4]] == RESULTS
    counts = {t.__name__: (t.calls, t.failures, t.timeouts) for t in seen["trainer"].tool_functions}
    assert counts == {"calculator": (completions, 0, 0), "lookup": (completions, completions, 0),
                      "slow": (completions, 0, completions)}

    tokenizer, scripted_ids = seen["tokenizer"], seen["scripted_ids"]
    (batch,) = seen["batches"]
    masked_total = 0
    for ids, completion_mask, tool_mask in zip(batch["completion_ids"], batch["completion_mask"], batch["tool_mask"]):
        length = int(completion_mask.sum())
        ids, tool_mask = ids[:length].tolist(), tool_mask[:length].tolist()
        n = len(scripted_ids)
        assert ids[:n] == scripted_ids and tool_mask[:n] == [1] * n  # the model's call: trained on
        masked = [i for i, m in enumerate(tool_mask) if m == 0]
        assert masked == list(range(n, masked[-1] + 1))  # one contiguous block right after the call
        assert tokenizer.decode([ids[i] for i in masked]) == RENDERED_RESULTS  # exactly the tool results
        assert all(m == 1 for m in tool_mask[masked[-1] + 1:])  # the model's next turn: trained on
        assert length > masked[-1] + 1  # it did write a next turn
        masked_total += len(masked)
    loss_mask = batch["completion_mask"] * batch["tool_mask"]  # what TRL's loss averages over (_compute_loss)
    assert int(batch["completion_mask"].sum() - loss_mask.sum()) == masked_total


RUN_SCRIPT = '''
import sys
sys.path.insert(0, {tests!r})
from lowvram_grpo.model.backends import prepare_backend
prepare_backend({backend!r})  # unsloth's patches before trl is imported, as the CLI and train() do
from tool_transcripts import TOOL_OVERRIDES, check_transcripts_and_mask, scripting_build
from lowvram_grpo.training import grpo as training
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.run.pipeline import run
from lowvram_grpo.training.trl_compat import trainer_name

seen = {{}}
training.build_trainer = scripting_build(training.build_trainer, seen)
config = load_config({preset!r}, ["train.max_steps=1", "eval.enabled=false", "train.num_generations=4",
                                  "train.per_device_train_batch_size=4", "train.max_prompt_length=1400",
                                  "model.max_seq_length=1950", "train.max_completion_length=512",
                                  "tools.module={tools_file}", *TOOL_OVERRIDES, *{overrides!r}])
result = run(config, {out!r}, backend={backend!r}, log=print)
assert result.summary["status"] == "complete" and result.summary["steps"] == 1
check_transcripts_and_mask(seen, completions=4)
print("NEXT TURNS", seen["next_turns"])
print("FIRST TURNS", seen["first_turns"])
print("TRAINER", trainer_name(seen["trainer"]), type(getattr(seen["trainer"], "vllm_generation", None)).__name__)
'''


def run_script(tmp_path, preset: str, backend: str, overrides=()) -> str:
    """A `python -c` script: the scripted GRPO step above on `preset` / `backend`, in a process of its own (a vLLM
    engine or unsloth's patches end with it); prints NEXT TURNS (engine, prompts, lengths) and TRAINER (the class
    GRPORunTrainer is mixed over, the trainer's vllm_generation)."""
    from pathlib import Path

    tools_file = tmp_path / "my_tools.py"
    tools_file.write_text(TOOLS_FILE)
    return RUN_SCRIPT.format(tests=str(Path(__file__).parent), preset=preset, backend=backend,
                             tools_file=str(tools_file), overrides=list(overrides), out=str(tmp_path / "run"))


# An environment in TRL 1.15's form whose methods are the scripted call's lookup and slow (tools.names keeps the
# calculator): reset per prompt, state per rollout, get_reward from that state.
ENVIRONMENT_FILE = '''
import time


class Shop:
    """A small shop whose stock the model can look up."""

    def __init__(self):
        self.lookups = 0
        self.resets = []

    def reset(self, **row):
        self.lookups = 0
        self.resets.append(row.get("answer"))
        return None

    def lookup(self, word: str) -> str:
        """Look a word up in the shop's stock.

        Args:
            word: The word to look up.
        """
        self.lookups += 1
        return {"apple": "a fruit"}[word]

    def slow(self, seconds: float) -> str:
        """Wait, then answer.

        Args:
            seconds: How long to wait.
        """
        time.sleep(seconds)
        return "done"

    def get_reward(self) -> float:
        return float(self.lookups)

    def _private(self):
        return "never a tool"


class Broken(Shop):
    """Cannot be built."""

    def __init__(self):
        raise RuntimeError("no stock today")


class NoReset:
    """No reset."""

    def look(self, word: str) -> str:
        """Look.

        Args:
            word: A word.
        """
        return word


class Undocumented(Shop):
    def count(self, n: int) -> str:
        return str(n)


class Nothing:
    """Only hooks."""

    def reset(self, **row):
        return None


class Clash(Shop):
    """Its method has a built-in tool's name."""

    def calculator(self, expression: str) -> str:
        """Compute.

        Args:
            expression: Arithmetic.
        """
        return expression


not_a_class = 3
'''
