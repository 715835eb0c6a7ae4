"""The package's import graph: no module imports a module that imports it back (at module level or inside a
function: a lazy import is still a dependency a reader must hold in mind), and library code never imports the
CLI module. Read from the source with `ast`; nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "lowvram_grpo"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, `from X import Y` counting as X.Y when that is a module."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    targets.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in _reachable(graph, b)})
    assert not circles, f"import circles (each pair reaches the other): {circles}"


def test_the_walk_sees_lazy_imports():
    graph = import_graph()
    assert "lowvram_grpo.training.grpo" in graph["lowvram_grpo.run.pipeline"]          # imported inside a method
    assert "lowvram_grpo.model.vllm.engine" in graph["lowvram_grpo.training.vllm_rollouts"]
    assert "lowvram_grpo.core.errors" in graph["lowvram_grpo.model.vllm.settings"]


def test_only_the_entry_points_import_the_cli_module():
    graph = import_graph()
    users = sorted(m for m, targets in graph.items() if "lowvram_grpo.run.cli" in targets)
    assert users == ["lowvram_grpo.__main__", "lowvram_grpo.run.__main__"], users


# --------------------------------------------------------------------------- the rooms' order

# The package's rooms from the ground up: a room imports only rooms below it (the package's top-level modules --
# train(), doctor, install, baseline -- stand above run/). The README's layout map lists them top down.
ROOM_ORDER = ("core", "task", "settings", "model", "evaluate", "report", "training", "run")
TOP = len(ROOM_ORDER)


def room_of(module: str) -> int:
    """The floor of `module`: its room's index in ROOM_ORDER, TOP for the package's top-level modules."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOM_ORDER):
        return ROOM_ORDER.index(parts[1])
    return TOP


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module from a room above the importer's."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if room_of(b) > room_of(a))


def test_no_room_imports_a_room_above_it():
    assert set(ROOM_ORDER) == {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert not upward_imports(import_graph()), "\n".join(upward_imports(import_graph()))


def test_no_two_rooms_import_each_other():
    graph = import_graph()
    pairs = {(room_of(a), room_of(b)) for a, targets in graph.items() for b in targets if room_of(a) != room_of(b)}
    both = sorted((ROOM_ORDER + ("top",))[a] + " <-> " + (ROOM_ORDER + ("top",))[b] for a, b in pairs
                  if (b, a) in pairs and a < b)
    assert not both, both


def test_the_order_check_sees_an_upward_import():
    """A planted import of the pipeline from core/errors.py, and of model/ from settings/, are both caught."""
    graph = {name: set(targets) for name, targets in import_graph().items()}
    graph["lowvram_grpo.core.errors"].add("lowvram_grpo.run.pipeline")
    graph["lowvram_grpo.settings.resolve"].add("lowvram_grpo.model.decoding")
    assert upward_imports(graph) == ["lowvram_grpo.core.errors -> lowvram_grpo.run.pipeline",
                                     "lowvram_grpo.settings.resolve -> lowvram_grpo.model.decoding"]


def test_the_readme_map_lists_the_rooms_top_down():
    """The README's layout block names each room at the start of a line, in ROOM_ORDER read from the top."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    named = [line.split("/", 1)[0] for line in block.splitlines() if line[:1].isalpha() and "/" in line.split()[0]]
    rooms = [name for name in named if name in ROOM_ORDER]
    assert rooms == list(reversed(ROOM_ORDER)), rooms


# --------------------------------------------------------------------------- the pure modules' import guards

# What a user's reward or tools file is checked and run with must import without the training stack: --dry-run,
# the doctor and the checks import them before (or without) any model.
PURE_MODULES = ("lowvram_grpo.task.rewards", "lowvram_grpo.task.tools")
HEAVY_PACKAGES = ("trl", "torch", "transformers", "peft", "datasets", "vllm", "unsloth", "bitsandbytes")
OFF_LIMITS = ("lowvram_grpo.model.backends", "lowvram_grpo.training.trl_compat",
              "lowvram_grpo.training.grpo")  # and their submodules
# Modules a pure one may reach whose heavy imports sit inside functions, run only on request (by name, and why):
# their module-level imports are still checked.
LAZY_BOUNDARIES = {
    "lowvram_grpo.task.reward_models": "scores a reward model named in rewards.names: transformers, torch, "
                                       "trl.data_utils",
}


def _off_limits(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in OFF_LIMITS)


def _heavy_imports(path: Path, module_level_only: bool) -> list[str]:
    """'line N: import X' for each import of a heavy package in `path` (inside functions too, unless
    `module_level_only`)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in HEAVY_PACKAGES]
    return found


def pure_module_problems(module: str, graph: dict[str, set[str]], modules: dict[str, Path]) -> list[str]:
    """What `module` reaches that it must not: a package module off limits (through any import of any module it
    reaches, at module level or inside a function, relative ones included), or an import of a heavy package
    (inside functions too, except in LAZY_BOUNDARIES, where only module-level imports count)."""
    problems, reached = [], _reachable(graph, module) - {module}
    for name in sorted(reached | {module}):
        if name != module and _off_limits(name):
            by = sorted(m for m in reached | {module} if name in graph[m])
            problems.append(f"{module} reaches {name} (imported by {', '.join(by)})")
            continue
        for hit in _heavy_imports(modules[name], module_level_only=name in LAZY_BOUNDARIES):
            problems.append(f"{module} reaches {name}, {hit}" if name != module else f"{module}, {hit}")
    return problems


def test_rewards_and_tools_reach_no_heavy_module_by_any_import():
    """Read from the source: a `from .trl_compat import X` inside a function of rewards.py (or of any module it
    imports) fails here, though importing rewards would not load it."""
    graph, modules = import_graph(), _modules()
    for name in LAZY_BOUNDARIES:
        assert name in modules, f"LAZY_BOUNDARIES names {name}, which is not a module of the package"
    problems = [p for module in PURE_MODULES for p in pure_module_problems(module, graph, modules)]
    assert not problems, "\n".join(problems)


def test_the_guard_sees_relative_and_lazy_imports():
    """The walk the guard uses resolves `from .x import y` and imports inside functions: training (which imports
    trl_compat inside the package) is caught as reaching trl_compat, and reward_models' function-level transformers
    import is what makes it a boundary."""
    graph, modules = import_graph(), _modules()
    assert any("lowvram_grpo.training.trl_compat" in p
               for p in pure_module_problems("lowvram_grpo.training.grpo", graph, modules))
    assert _heavy_imports(modules["lowvram_grpo.task.reward_models"], module_level_only=False)
    assert not _heavy_imports(modules["lowvram_grpo.task.reward_models"], module_level_only=True)


def test_importing_rewards_or_tools_loads_no_heavy_module():
    """Each imported in a fresh interpreter: afterwards sys.modules holds none of the heavy packages and none of
    the package's backends, trl_compat or training."""
    import json
    import subprocess
    import sys

    for module in PURE_MODULES:
        code = (f"import importlib, json, sys; importlib.import_module({module!r}); "
                "print(json.dumps(sorted(sys.modules)))")
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        loaded = json.loads(out.stdout.splitlines()[-1])
        assert module in loaded
        heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY_PACKAGES or _off_limits(m))
        assert not heavy, f"importing {module} loads {heavy}"


def test_the_memory_plan_stays_arithmetic():
    """The plan's modules reach no trl_compat, backend or training by any import (the out-of-memory line, oom.py,
    reads TRL's rollout frame names from trl_compat when a run runs out of memory: it is not part of the plan)."""
    graph = import_graph()
    plan_modules = ("lowvram_grpo.settings.memory_plan", "lowvram_grpo.settings.memory_terms",
                    "lowvram_grpo.settings.memory_fit", "lowvram_grpo.settings.model_shapes")
    reached = {m: sorted(n for n in _reachable(graph, m) if _off_limits(n)) for m in plan_modules}
    assert reached == {m: [] for m in plan_modules}, reached
    assert "lowvram_grpo.training.trl_compat" in graph["lowvram_grpo.run.oom"]


# Values derived from several settings are computed in one place (config.py's properties, resolve.py), never again
# where they are used: prompt + completion (TrainConfig.rollout_tokens), the batch default
# (TrainConfig.batch_size), the per-turn cap (RunConfig.turn_tokens).
DERIVED_HOMES = {"config.py", "resolve.py"}


def _attr(node) -> str:
    return node.attr if isinstance(node, ast.Attribute) else ""


def _derivations(tree) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and \
                {_attr(node.left), _attr(node.right)} == {"max_prompt_length", "max_completion_length"}:
            found.append((node.lineno, "max_prompt_length + max_completion_length: use train.rollout_tokens"))
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            names = {_attr(v) for v in node.values}
            if "per_device_train_batch_size" in names:
                found.append((node.lineno, "per_device_train_batch_size or ...: use train.batch_size"))
            if "max_tokens_per_turn" in names:
                found.append((node.lineno, "max_tokens_per_turn or ...: use config.turn_tokens"))
    return found


def test_derived_settings_are_computed_only_where_they_are_decided():
    offenders = [f"{path.relative_to(REPO)}:{line}: {what}"
                 for path in sorted((REPO / "lowvram_grpo").rglob("*.py")) if path.name not in DERIVED_HOMES
                 for line, what in _derivations(ast.parse(path.read_text()))]
    assert not offenders, "\n".join(offenders)
    # the check sees what it looks for
    sample = "need = t.max_prompt_length + t.max_completion_length\n" \
             "b = c.per_device_train_batch_size or c.num_generations\n" \
             "cap = config.tools.max_tokens_per_turn or config.train.max_completion_length\n"
    assert [line for line, _ in _derivations(ast.parse(sample))] == [1, 2, 3]


# --------------------------------------------------------------------------- imports at the top (issue 50)

# What an import inside a function may load without saying why: the libraries whose import takes seconds or
# decides the order of patches (unsloth before transformers/trl), and what they bring.
HEAVY = {"torch", "transformers", "trl", "peft", "vllm", "unsloth", "unsloth_zoo", "bitsandbytes", "accelerate",
         "datasets", "matplotlib", "safetensors", "huggingface_hub", "triton", "numpy", "tokenizers", "pyarrow"}


def unexplained_function_imports(source: str) -> list[str]:
    """Each import inside a function that names no HEAVY library and has no comment on its line or the line
    above (the reason it is not at the top: a heavy module it loads, an optional dependency, a circle)."""
    lines = source.splitlines()
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(name.split(".")[0] in HEAVY for name in names):
                continue
            here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            if "#" not in here and not above.startswith("#"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_an_import_inside_a_function_is_heavy_or_says_why():
    planted = ("import os\n\n\ndef f():\n    import json\n    import torch\n    from x import y  # lazy: a circle\n"
               "    return json\n")
    assert unexplained_function_imports(planted) == ["line 5: import json"]  # the rule sees a planted one
    found = {str(path.relative_to(REPO)): bad for path in sorted(PACKAGE.rglob("*.py"))
             if (bad := unexplained_function_imports(path.read_text()))}
    assert not found, f"move these imports to the top of the file, or say on the line why they wait: {found}"


# --------------------------------------------------------------------------- config below the pipeline (issue 50)

SECTIONS = {"model", "lora", "train", "data", "rewards", "tools", "environment", "prime", "eval", "log", "memory",
            "decode"}
# Where the plan is built (resolve.py, plans.py: the phases' frozen settings) and the user's settings are checked or
# changed (checks, the memory plan and its fixes; run/oom.py turns an out-of-memory into `--set` changes, re-resolved),
# and the commands at the edge that build the plan. Every other module takes the plan (plans.RunPlan) or plain values.
READS_CONFIG = {"settings/config.py", "settings/resolve.py", "settings/plans.py", "settings/checks.py",
                "settings/memory_plan.py", "settings/memory_terms.py", "settings/memory_fit.py",
                "settings/step_time.py", "settings/hardware.py", "doctor.py", "baseline.py", "evaluate/cli.py",
                "run/cli.py", "run/pipeline.py", "run/oom.py"}
# In the pipeline only construction reads the config: GRPORun's step methods read its plan (and the handle).
PIPELINE_CLASS, CONSTRUCTION = "GRPORun", ("__init__",)


def _is_config(value) -> bool:
    """`config`, `x.config`, `x.user_config` or `resolved.config`: an expression that is the user's config."""
    return (isinstance(value, ast.Name) and value.id == "config") or (
        isinstance(value, ast.Attribute) and value.attr in ("config", "user_config"))


def config_reads(source: str) -> int:
    """`config.SECTION` / `x.config.SECTION` reads in `source`, and every `resolved.config` (read or handed on)."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS and _is_config(node.value):
            count += 1
        elif (isinstance(node, ast.Attribute) and node.attr == "config"
              and isinstance(node.value, (ast.Name, ast.Attribute))
              and (getattr(node.value, "id", None) or getattr(node.value, "attr", None)) == "resolved"):
            count += 1
    return count


def step_method_config_reads(source: str, cls: str = PIPELINE_CLASS) -> list[str]:
    """'method: line' for each `self.config` / `config.SECTION` / `self.user_config.SECTION` in `cls`'s methods
    other than construction."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name not in CONSTRUCTION:
                    for sub in ast.walk(method):
                        if isinstance(sub, ast.Attribute) and (
                                (sub.attr == "config" and isinstance(sub.value, ast.Name) and sub.value.id == "self")
                                or (sub.attr in SECTIONS and _is_config(sub.value))):
                            found.append(f"{method.name}: {sub.lineno}")
    return found


def test_the_pipeline_steps_read_the_plan_not_the_config():
    planted = ("class GRPORun:\n    def __init__(self, config):\n        self.n = config.train.max_steps\n"
               "    def load(self):\n        return self.config.model.name, self.user_config.data.dataset\n")
    assert step_method_config_reads(planted) == ["load: 5", "load: 5", "load: 5"]
    assert not step_method_config_reads((PACKAGE / "run" / "pipeline.py").read_text())


def test_config_is_read_only_where_the_plan_is_built_and_the_settings_are_checked():
    assert config_reads("def f(config, handle):\n    return config.train.seed + handle.config.lora.r\n") == 2
    assert config_reads("def f(resolved):\n    return g(resolved.config) + resolved.config.model.name\n") == 3
    reads = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
             if str(path.relative_to(PACKAGE)) not in READS_CONFIG and (n := config_reads(path.read_text()))}
    assert not reads, ("config read below the pipeline (module: reads): pass the plan (plans.RunPlan) or plain "
                       f"values: {reads}")


# --------------------------------------------------------------------------- Resolved without the config (issue 67)

def class_members(source: str, cls: str) -> tuple[set[str], set[str]]:
    """(annotated fields, methods) of class `cls` in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            return fields, methods
    raise AssertionError(f"no class {cls}")


def test_resolved_carries_no_config():
    """resolve.Resolved holds what was decided and the run's plan (plans.RunPlan), never the user's config: a phase
    reads its plan, and what needs the config takes it beside the settings (`config, resolved`)."""
    fields, methods = class_members((PACKAGE / "settings" / "resolve.py").read_text(), "Resolved")
    assert {"hardware", "backend", "plan"} <= fields and "describe" in methods  # the rule reads the class
    assert "config" not in fields and "user_config" not in fields, sorted(fields)
    assert "with_config" not in methods


def resolved_config_reads(source: str) -> list[int]:
    """The lines of each `resolved.config` / `x.resolved.config` (read or handed on) and each `.with_config(...)`
    call: the user's config reached through the resolved settings."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr == "config"
                and ((isinstance(node.value, ast.Name) and node.value.id == "resolved")
                     or (isinstance(node.value, ast.Attribute) and node.value.attr == "resolved"))):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "with_config":
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_reaches_the_config_through_the_resolved_settings():
    """Anywhere in the package, READS_CONFIG's modules too: the config is a parameter where it is needed."""
    planted = ("def f(resolved, p, r, c):\n    x = resolved.config.train\n"
               "    return g(p.resolved.config), r.with_config(c), resolved.plan, resolved.config_note\n")
    assert resolved_config_reads(planted) == [2, 3, 3]
    found = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
             if (lines := resolved_config_reads(path.read_text()))}
    assert not found, f"the config reached through Resolved (module: lines): pass it as a parameter: {found}"


# --------------------------------------------------------------------------- files read where a config is built
# (issue 50)

# What reads a file's contents (a path's existence is a check, and stays in __post_init__)
FILE_READERS = {"open", "read_text", "read_bytes", "safe_load", "load", "adapter_settings", "import_user_file"}


def post_init_file_reads(source: str) -> list[str]:
    """The calls in `source`'s `__post_init__` methods that read a file (or call a `_read...` helper)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    func = call.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name in FILE_READERS or name.startswith("_read"):
                        found.append(f"{node.lineno}: {name}")
    return found


def test_no_post_init_reads_a_file():
    """A config is checked in __post_init__ and built from files in the functions that read them (litgpt reads in
    classmethods such as `Config.from_checkpoint`): constructing a section never touches the disk."""
    assert post_init_file_reads("class A:\n    def __post_init__(self):\n        self._read_adapter()\n")
    assert post_init_file_reads("class A:\n    def __post_init__(self):\n        x = Path(self.p).read_text()\n")
    found = {str(path.relative_to(PACKAGE)): hits for path in PACKAGE.rglob("*.py")
             if (hits := post_init_file_reads(path.read_text()))}
    assert not found, f"__post_init__ reads a file (module: calls): read it where the config is built: {found}"
