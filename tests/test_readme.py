"""The README's layout is a short map: a room a job (the commands, where settings are decided, where data enters and
rewards and tools run, where the model is built, training, evaluation, where outputs are written) naming its modules,
plus the top-level folders; every module and folder is named in it and nothing it names is missing. And every step
time or job time of the default job that the README, docs/ and presets/ state is the measured one."""
import json
import math
import re
import subprocess
from pathlib import Path

from conftest import REPO
from lowvram_grpo.settings.config import load_config

MAP_MAX_LINES = 20  # the map stays a map: a line a room, not a line a module


def _layout() -> tuple[str, list[str]]:
    """The README's layout section (heading to the next heading) and the lines of its map (the code block)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout"):]
    if "\n## " in section[4:]:
        section = section[:section.index("\n## ", 4)]
    block = section[section.index("```") + 3:]
    block = block[block.index("\n") + 1:block.index("```")]
    return section, [line for line in block.splitlines() if line.strip()]


def _top_level_folders() -> set[str]:
    """The repository's folders as git tracks them (not runs/, caches, build output); the tree's without git."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        names = {line.split("/")[0] for line in files.splitlines() if "/" in line}
    except (OSError, subprocess.CalledProcessError):
        names = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.endswith((".egg-info", "__pycache__"))}
    return {name for name in names if not name.startswith(".") and (REPO / name).is_dir()}


def _rooms(lines: list[str]) -> dict[str, str]:
    """{room: its lines joined}: a line that starts `NAME/` opens a room, an indented line goes on with it."""
    rooms: dict[str, str] = {}
    room = None
    for line in lines:
        if m := re.match(r"^([\w.]+)/\s", line):
            room = m.group(1)
            rooms[room] = line[m.end():]
        elif room is not None and line.startswith(" "):
            rooms[room] += " " + line.strip()
    return rooms


def test_every_package_module_and_folder_is_in_the_readme_layout():
    """The map has a room for every folder of the package and of the repository; each room's lines name every module
    of that room (the package's own top-level modules on the `lowvram_grpo/` line) and its sub-folders; every `.py`
    the map names is there; the package's top holds at most 12 entries (issue 50: rooms a newcomer can find); and the
    map has at most MAP_MAX_LINES lines (before: a line a module, 50 of the README's 200). 13 entries since issue 67
    added core/, the ground room under the others."""
    section, lines = _layout()
    assert len(lines) <= MAP_MAX_LINES, f"the README's layout map has {len(lines)} lines: at most {MAP_MAX_LINES}"
    package = REPO / "lowvram_grpo"
    top = sorted(p.name for p in package.iterdir() if p.name != "__pycache__")
    assert len(top) <= 13, f"lowvram_grpo/ holds {len(top)} entries, at most 13: {top}"
    rooms = _rooms(lines)
    expected = {"lowvram_grpo": {p.name for p in package.glob("*.py") if p.name != "__main__.py"}}
    for folder in (p for p in package.iterdir() if p.is_dir() and not p.name.startswith("__")):
        expected[folder.name] = ({p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
                                 | {f"{d.name}/" for d in folder.iterdir()
                                    if d.is_dir() and not d.name.startswith("__")})
    for folder in _top_level_folders() - {"lowvram_grpo"}:
        expected[folder] = set()
    assert set(rooms) == set(expected), f"the map's rooms {sorted(rooms)} should be the folders {sorted(expected)}"
    for room, names in expected.items():
        named = (set(re.findall(r"(?<![\w./])(\w+\.py)\b", rooms[room]))
                 | set(re.findall(r"(?<![\w./])(\w+/)", rooms[room])))
        assert names - named == set(), f"add to the README's layout map, room {room}/: {sorted(names - named)}"
    every = {p.name for p in package.rglob("*.py")}
    named_modules = set(re.findall(r"(?<![\w./])(\w+\.py)\b", section))
    assert named_modules - every == set(), \
        f"the README's layout names what is not there: {sorted(named_modules - every)}"


def _where_questions_enter(module, tmp_path):
    train, held_out = module.load_questions(load_config("tiny").data)
    assert train and held_out and train[0].question and train[0].answer


def _where_settings_are_decided(module, tmp_path):
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile

    assert module.resolve(load_config("llama8b_4bit"), profile("t4")).dtype == "float16"


def _where_the_model_is_built(module, tmp_path):
    import inspect

    assert list(inspect.signature(module.load_model).parameters)[0] == "resolved"  # built from resolve()'s settings


def _where_rewards_are_computed(module, tmp_path):
    assert module.REWARDS["correctness"]([None, None], ["<answer>72</answer>", "<answer>7</answer>"],
                                         answer=["72", "72"]) == [2.0, 0.0]


def _where_outputs_are_written(module, tmp_path):
    run = module.RunDir(tmp_path / "run").create()
    run.write_summary({"after": {"accuracy_strict": 0.5}})
    assert run.read_summary()["after"]["accuracy_strict"] == 0.5 and run.file("summary.json").is_file()


def _where_tools_run(module, tmp_path):
    assert module.calculator("6 * 7") == "42"


LAYOUT_ROLES = {"where questions enter": _where_questions_enter,
                "where settings are decided": _where_settings_are_decided,
                "where the model is built": _where_the_model_is_built,
                "where rewards are computed": _where_rewards_are_computed,
                "where tools run": _where_tools_run, "where outputs are written": _where_outputs_are_written}


def test_the_layout_says_where_the_main_things_happen(tmp_path):
    """Each role the map names is on one line of the map, and the first module that line names is imported and
    does it (before, the test only looked for the phrases anywhere in the README)."""
    import importlib

    _, lines = _layout()
    room = None
    for phrase, does_it in LAYOUT_ROLES.items():
        found = [(i, line) for i, line in enumerate(lines) if phrase in line]
        assert len(found) == 1, (phrase, found)  # one line of the map names it
        i, line = found[0]
        room = next(m.group(1) for prior in reversed(lines[:i + 1]) if (m := re.match(r"^(\w+)/\s", prior)))
        name = re.search(r"(\w+)\.py\b", line).group(1)
        does_it(importlib.import_module(f"lowvram_grpo.{room}.{name}"), tmp_path / name)


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


FIRST_COMMAND = REPO / "bench" / "results" / "readme_first_command"
DEFAULT_JOB = REPO / "bench" / "results" / "default_job"  # bench.default_job_search's records (issue 53)


def _machines(records) -> str:
    """'two AMD EPYCs, an Intel Xeon and an Intel Xeon with AMX': the machines of the records, as the README names
    them (kinds in the records' order; two records of one kind, two CPU generations under one name, counted)."""
    kinds = [re.search(r"(AMD EPYC|Intel Xeon)", r["machine"]).group(1) + (" with AMX" if "AMX" in r["machine"] else "")
             for r in records]
    counts = {kind: kinds.count(kind) for kind in kinds}  # first-seen order
    words = {2: "two", 3: "three", 4: "four"}
    names = [f"an {kind}" if n == 1
             else f"{words[n]} {kind.replace(' with', 's with', 1) if ' with' in kind else kind + 's'}"
             for kind, n in counts.items()]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def first_command_records() -> list[dict]:
    """The README's first command as timed on each machine measured: a record per machine in
    bench/results/readme_first_command/, or the one record of readme_first_command.json where there is no folder."""
    if FIRST_COMMAND.is_dir():
        return [json.loads(p.read_text()) for p in sorted(FIRST_COMMAND.glob("*.json"))]
    return [json.loads(FIRST_COMMAND.with_suffix(".json").read_text())]


def _change(paired: dict) -> str:
    """'+17/-12 (p 0.458)', '+3/-28 (p < 0.001)': a paired change as the README writes it."""
    p = paired["p"]
    return f"+{paired['right']}/-{paired['wrong']} ({f'p {p:.3f}' if p >= 0.001 else 'p < 0.001'})"


def _readme_results() -> dict[str, str]:
    """What the README's "GRPO or supervised priming?" section and its first command's paragraph state, each
    computed from the committed results (bench/results/seeds.json, plateau/, readme_first_command/, default_job/):
    the phrase as the README writes it."""
    gains = [r["after"]["accuracy_strict"] - r["primed"]["accuracy_strict"] for r in SEEDS]
    worst_p = max(max(r["paired_accuracy_strict"][2], r["paired_accuracy_lenient"][2]) for r in SEEDS)
    bound = math.ceil(worst_p * 1000) / 1000  # the smallest 3-decimal bound every seed is below
    primed = {s: _numbers(PLATEAU / f"seed-{s}" / "prime-200" / "result.json") for s in PLATEAU_SEEDS}
    prompts4 = {s: _numbers(PLATEAU / f"seed-{s}" / "prime-200" / "grpo-prompts4-12" / "result.json")
                for s in PLATEAU_SEEDS}
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
    preset = [json.loads((DEFAULT_JOB / f"seeds-preset-seed{s}.json").read_text()) for s in (3407, 1, 2)]
    assert all(r["overrides"] == [] for r in preset)  # the default job itself, today's code
    searched = [json.loads((DEFAULT_JOB / f"seeds-lr2e-4-seed{s}.json").read_text()) for s in (3407, 1, 2)]
    assert all(r["overrides"] == ["train.learning_rate=2e-4"] for r in searched)
    return {
        "searched": ", ".join(_change(r["paired_grpo"]) for r in searched[:2])
                    + f" and {_change(searched[2]['paired_grpo'])}"
                    " on seeds 3407, 1 and 2",
        "minutes": f"{min(minutes):.0f}-{max(minutes):.0f} minutes on the 2-core machines measured",
        "machines": _machines(first) + ", all with AVX512-BF16",
        "step": f"({min(steps):.1f}-{max(steps):.1f} s a GRPO step;",
        "accuracy": f"held-out accuracy {_range(of('before'), 2, same=True)} before, {_range(of('primed'), 2)} primed, "
                    f"{_range(of('after'), 2)} after on those machines",
        "seeds": f"seeds 3407, 1 and 2 on the slower EPYC ended at {_range([r['after'] for r in preset], 2)} "
                 "after GRPO, "
                 + ", ".join(_change(r["paired_grpo"]) for r in preset[:2])
                 + f" and {_change(preset[2]['paired_grpo'])} past priming",
        "gain": f"(+{min(gains):.2f} to +{max(gains):.2f}, paired p < {bound:g})",
        "equal time": f"({_range([r['prime_only']['accuracy_strict'] for r in SEEDS])} against "
                      f"{_range([r['after']['accuracy_strict'] for r in SEEDS])}, sampled at T=0.8)",
        "converged": f"(200\nsteps, {primed_acc.pop():.3f} greedy)",
        "prompts4": f"(+{mean(prompts4) - mean(primed):.3f} over the three seeds, {right} questions newly right "
                    f"and {wrong} newly wrong)",
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
    assert left <= SETTINGS, \
        f"numbers in the README's section with no results file behind them: {sorted(left - SETTINGS)}"


# --------------------------------------------------------------------------- the default job's time, wherever stated

def default_job_times() -> dict[str, str]:
    """The default job's GRPO step and whole run (the README's first command, `python -m lowvram_grpo.run`) as docs/
    and presets/ state them: ranges over the machines measured, '17.3-24.5 s a GRPO step', '18-28 minutes'."""
    first = first_command_records()
    assert {r["preset"] for r in first} == {"smollm2_cpu"} and first
    return {"step": _range([r["grpo_train_seconds"] / r["grpo_steps"] for r in first], 1) + " s a GRPO step",
            "minutes": _range([r["run_total_seconds"] / 60 for r in first], 0) + " minutes"}


# where each file states the default job's time today: how many times each phrase of default_job_times() stands there
STATED_TIMES = {"docs/results.md": 3, "presets/smollm2_cpu.yaml": 1}
# how the default job's time was stated before the records: none may come back (each was contradicted by them)
STALE_TIMES = [r"~1[1-8](?:\.\d)? s/step on 2 cores", r"48 GRPO steps of ~[\d.]+ s", r"fits? in 15 minutes",
               r"the 15 minutes the job", r"the job: ~\d+ minutes", r"\(~\d+ minutes on\s+2 cores"]
# the older code's times the docs keep, each tied to its own results file (bench/results/seeds.json, code 8ae5c13)
SEEDS_MINUTES = "About 13\nminutes a run then (`bench/results/seeds.json`"


def _flat(path: Path) -> str:
    """The file's text with line breaks (and a YAML comment's `#` on the next line) as one space."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())


def test_the_default_jobs_time_stated_in_docs_and_presets_is_the_measured_one():
    """docs/results.md and the smollm2_cpu preset state the default job's GRPO step and whole-run time as the range
    over bench/results/readme_first_command/'s machines; no file of docs/, presets/ or the README states it the old
    way (before: docs/results.md said 48 steps of ~11.5 s fit 15 minutes, the preset ~17 s/step and ~18 minutes,
    where the records say 17.3-24.5 s and 18-28 minutes); the older code's ~13 minutes is seeds.json's."""
    times = default_job_times()
    for name, count in STATED_TIMES.items():
        text = _flat(REPO / name)
        for what, phrase in times.items():
            assert text.count(phrase) == count, f"{name} states the default job's {what} as {phrase!r} {count} times"
        assert text.count(f"{times['step']}") == text.count(f"{times['minutes']}")
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "presets").glob("*.yaml"))]:
        text = _flat(path)
        for stale in STALE_TIMES:
            assert not re.search(stale, text), f"{path.relative_to(REPO)}: " \
                                               f"{re.search(stale, text).group(0)!r} is not what " \
                                               f"the records say ({times['step']}, {times['minutes']})"
        for step in re.findall(r"([\d.]+-[\d.]+) s a GRPO step", text):  # a range of step times is the default job's
            assert f"{step} s a GRPO step" == times["step"], (path.name, step)
    totals = [r["total_seconds"] / 60 for r in SEEDS]
    assert (round(sum(totals) / len(totals)) == 13
            and squash_ws(SEEDS_MINUTES) in squash_ws((REPO / "docs" / "results.md").read_text()))


def test_the_presets_levers_figures_are_levers_r1s():
    """The smollm2_cpu preset's reason for 2 prompts a step (held-out +7 points against -1 with 1 prompt, 11.8 s a step
    against 7.0) is bench/results/levers-r1.json's two_prompts_heavy against correct_heavy: another job (30 GRPO steps
    from one priming, code cdecca7) than the default job's time two comments below."""
    levers = {r["variant"]: r for r in json.loads((REPO / "bench" / "results" / "levers-r1.json").read_text())}
    two, one = levers["two_prompts_heavy"], levers["correct_heavy"]
    points = [round(100 * (r["after"]["accuracy_strict"] - r["primed"]["accuracy_strict"])) for r in (two, one)]
    phrase = (f"{points[0]:+d} points in {two['grpo_steps']} steps with 2 prompts vs {points[1]:+d} with 1, "
              f"at {two['s_per_step']:.1f} s a step there vs {one['s_per_step']:.1f}")
    assert phrase in _flat(REPO / "presets" / "smollm2_cpu.yaml"), phrase


def test_the_readme_stays_short():
    """Issue 43: at most 170 lines, newcomer first (it was 201 with a line a module in the layout)."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 170
