"""The README's layout section matches the tree: every module and folder of the package is named there,
and nothing it names is missing (a reader finds from it where data enters, the model is built, settings
are decided, rewards are computed and outputs are written)."""
import json
import math
import re
from pathlib import Path

from conftest import REPO


def _layout_names() -> set[str]:
    text = (REPO / "README.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    names = set()
    for line in block.splitlines():
        match = re.match(r"^  (\S+)", line)  # the package's entries are indented two spaces
        if match:
            names.add(match.group(1).rstrip("/"))
    return names


def test_every_package_module_and_folder_is_in_the_readme_layout():
    package = REPO / "lowvram_grpo"
    present = {p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    present |= {p.name for p in package.iterdir() if p.is_dir() and not p.name.startswith("__")}
    named = _layout_names()
    assert present - named == set(), f"add to the README's layout: {sorted(present - named)}"
    assert named - present == set(), f"the README's layout names what is not there: {sorted(named - present)}"


def _where_questions_enter(module, tmp_path):
    from lowvram_grpo.config import load_config

    train, held_out = module.load_questions(load_config("tiny").data)
    assert train and held_out and train[0].question and train[0].answer


def _where_settings_are_decided(module, tmp_path):
    from lowvram_grpo.config import load_config
    from lowvram_grpo.hardware import profile

    assert module.resolve(load_config("llama8b_4bit"), profile("t4")).dtype == "float16"


def _where_the_model_is_built(module, tmp_path):
    import inspect

    assert list(inspect.signature(module.load_model).parameters)[0] == "resolved"  # built from resolve()'s settings


def _where_rewards_are_computed(module, tmp_path):
    assert module.REWARDS["correctness"]([None, None], ["<answer>72</answer>", "<answer>7</answer>"], answer=["72", "72"]) == [2.0, 0.0]


def _where_outputs_are_written(module, tmp_path):
    run = module.RunDir(tmp_path / "run").create()
    run.write_summary({"after": {"accuracy_strict": 0.5}})
    assert run.read_summary()["after"]["accuracy_strict"] == 0.5 and run.file("summary.json").is_file()


LAYOUT_ROLES = {"where questions enter": _where_questions_enter, "where settings are decided": _where_settings_are_decided,
                "where the model is built": _where_the_model_is_built, "where rewards are computed": _where_rewards_are_computed,
                "where outputs are written": _where_outputs_are_written}


def test_the_layout_says_where_the_main_things_happen(tmp_path):
    """Each role the layout names is on the line of the module that does it: the module is imported and does
    it (before, the test only looked for the phrases anywhere in the README)."""
    import importlib

    text = (REPO / "README.md").read_text()
    for phrase, does_it in LAYOUT_ROLES.items():
        lines = [line for line in text.splitlines() if phrase in line]
        assert len(lines) == 1 and re.match(r"^  \S", lines[0]), (phrase, lines)  # one entry of the layout names it
        name = lines[0].split()[0].rstrip("/").removesuffix(".py")
        does_it(importlib.import_module(f"lowvram_grpo.{name}"), tmp_path / name)


# --------------------------------------------------------------------------- the README's measured numbers

SEEDS = json.loads((REPO / "bench" / "results" / "seeds.json").read_text())["runs"]
PLATEAU = REPO / "bench" / "results" / "plateau" / "smollm2_cpu"
PLATEAU_SEEDS = (3407, 1, 2)
# numbers in the section that are settings, not results
SETTINGS = {"20", "0.8", "200", "4", "2"}


def _numbers(path: Path) -> dict:
    return json.loads(path.read_text())["numbers"]


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    block = text[text.index(title):]
    return block[:block.index("\n## ", 4)]


def squash_ws(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _range(values, digits: int = 2, same: bool = False) -> str:
    """'0.41-0.45' (one number when every value rounds the same, which `same` requires)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    assert not same or low == high, values
    return low if low == high else f"{low}-{high}"


def first_command_records() -> list[dict]:
    """The README's first command as timed on each machine measured (bench/results/readme_first_command/)."""
    return [json.loads(p.read_text()) for p in sorted((REPO / "bench" / "results" / "readme_first_command").glob("*.json"))]


def _readme_results() -> dict[str, str]:
    """What the README's "GRPO or supervised priming?" section states, each computed from the committed results
    (bench/results/seeds.json, bench/results/plateau/): the phrase as the README writes it."""
    gains = [r["after"]["accuracy_strict"] - r["primed"]["accuracy_strict"] for r in SEEDS]
    worst_p = max(max(r["paired_accuracy_strict"][2], r["paired_accuracy_lenient"][2]) for r in SEEDS)
    bound = math.ceil(worst_p * 1000) / 1000  # the smallest 3-decimal bound every seed is below
    primed = {s: _numbers(PLATEAU / f"seed-{s}" / "prime-200" / "result.json") for s in PLATEAU_SEEDS}
    prompts4 = {s: _numbers(PLATEAU / f"seed-{s}" / "prime-200" / "grpo-prompts4-12" / "result.json") for s in PLATEAU_SEEDS}
    pairs = [(a, b) for s in PLATEAU_SEEDS for a, b in zip(primed[s]["strict_correct"], prompts4[s]["strict_correct"])]
    right, wrong = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
    primed_acc = {round(primed[s]["accuracy_strict"], 3) for s in PLATEAU_SEEDS}
    assert len(primed_acc) == 1 and all(primed[s]["protocol"]["decoding"] == "greedy" for s in PLATEAU_SEEDS)
    mean = lambda numbers: sum(numbers[s]["accuracy_strict"] for s in PLATEAU_SEEDS) / len(PLATEAU_SEEDS)  # noqa: E731
    first = first_command_records()
    assert all(squash_ws(r["command"]) in squash_ws((REPO / "README.md").read_text()) for r in first)  # as timed
    assert {r["seed"] for r in first} == {3407} and len(first) >= 2
    of = lambda stage: [r[stage]["accuracy_strict"] for r in first]  # noqa: E731
    minutes = [r["run_total_seconds"] / 60 for r in first]
    steps = [r["grpo_train_seconds"] / r["grpo_steps"] for r in first]
    seeds = [json.loads((REPO / "bench" / "results" / "variants" / f"seed-{s}.json").read_text()) for s in (1, 2, 3407)]
    return {
        "minutes": f"{min(minutes):.0f}-{max(minutes):.0f} minutes on the 2-core machines measured",
        "machines": " and ".join(f"an {re.search(r'(AMD EPYC|Intel Xeon)', r['machine']).group(1)}" for r in first)
                    + " with AVX512-BF16",
        "step": f"({min(steps):.1f}-{max(steps):.1f} s a GRPO step;",
        "accuracy": f"held-out accuracy {_range(of('before'), 2, same=True)} before, {_range(of('primed'), 2)} primed, "
                    f"{_range(of('after'), 2)} after on those two machines",
        "seeds": f"seeds 1, 2 and 3407 on the EPYC ended at "
                 f"{_range([s['variants']['default']['after']['accuracy_strict'] for s in seeds], 2)} after GRPO",
        "gain": f"(+{min(gains):.2f} to +{max(gains):.2f}, paired p < {bound:g})",
        "equal time": f"({_range([r['prime_only']['accuracy_strict'] for r in SEEDS])} against "
                      f"{_range([r['after']['accuracy_strict'] for r in SEEDS])}, sampled at T=0.8)",
        "converged": f"(200\nsteps, {primed_acc.pop():.3f} greedy)",
        "prompts4": f"(+{mean(prompts4) - mean(primed):.3f} over the three seeds, {right} questions newly right and {wrong} newly wrong)",
    }


def test_every_number_the_readme_states_comes_from_a_results_file():
    """Each measured number of the README's "GRPO or supervised priming?" section (and its run time) is
    recomputed from the committed results it comes from; any other number there is a setting. Before, the
    README said "paired p <= 0.002 on every seed" where seed 2's is 0.00222 (seeds.json)."""
    text = (REPO / "README.md").read_text()
    squash = squash_ws  # the README wraps lines anywhere
    stated = _readme_results()
    for what, phrase in stated.items():
        assert squash(phrase) in squash(text), f"{what}: the results say {squash(phrase)!r}"
    section = squash(_section("## GRPO or supervised priming?"))
    for phrase in stated.values():
        section = section.replace(squash(phrase), " ")
    left = set(re.findall(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?!\w)", section))  # not a name's (SmolLM2-135M)
    assert left <= SETTINGS, f"numbers in the README's section with no results file behind them: {sorted(left - SETTINGS)}"
