"""The pinned GPU wheels (requirements.txt), fetched and read as source text: never installed, never imported.

    wheels = PinnedWheels.fetch(["unsloth", "unsloth_zoo", "vllm", "trl", "transformers"])
    func = wheels.function("unsloth", "unsloth/models/loader.py", "FastLanguageModel.from_pretrained")
    problems = check_keywords("FastLanguageModel.from_pretrained", func, kwargs, origin="...")

Fetching: `pip download --no-deps --only-binary=:all:` for CPython 3.11 on manylinux x86_64 (what
requirements.txt targets, whatever machine runs this), from the index pip is configured with (its
index-url, extra-index-url, find-links, cert: pip's own configuration, as `pip install -r requirements.txt`
would use it; an explicit `index_url` asks that index alone), into a cache directory
(`LOWVRAM_GRPO_WHEEL_CACHE`, default `~/.cache/lowvram_grpo/wheels`); a cached wheel is reused. An index
that cannot be reached raises `RegistryUnreachable` (the tests skip, or fail in CI: `registry_required`); a
version or wheel the index does not have raises `WheelNotFound` (the tests fail).

Reading: members are read straight out of the zip and parsed with `ast`. A keyword counts as accepted
only when it is an explicit named parameter (or dataclass / msgspec field): a `**kwargs` that would
swallow it does not count, since a renamed keyword would vanish there without an error.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Mapping, Optional

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "requirements.txt"
CACHE_ENV = "LOWVRAM_GRPO_WHEEL_CACHE"
CI_ENV = "LOWVRAM_GRPO_CI"  # set by .ci/run: what must run there fails instead of skipping
# What requirements.txt is for: CPython 3.11 on Linux x86_64 (vllm's wheel is cp38-abi3-manylinux_2_28_x86_64).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PYTHON_VERSION = "3.11"
# Module-level `if` tests that are false on that target: their bodies are not the code that runs there
# (unsloth/__init__.py: `if _IS_MLX:` defines Apple-MLX stand-ins; its else branch is the CUDA path).
FALSE_ON_TARGET = ("_IS_MLX",)


class RegistryUnreachable(Exception):
    """The package registry could not be reached: nothing can be said about the pins (skip)."""


class WheelNotFound(Exception):
    """The registry answered and has no such wheel: the pin itself is wrong (fail)."""


def registry_required() -> bool:
    """In CI (`LOWVRAM_GRPO_CI=1`, set by .ci/run, or a CI service's `CI=true`) an unreachable index is a
    failure, not a skip: a green run must have checked the pins."""
    return os.environ.get(CI_ENV) == "1" or os.environ.get("CI", "").lower() in ("1", "true")


# What pip prints when an index cannot be reached (after its retries), as opposed to "no such version".
_UNREACHABLE = re.compile(r"NewConnectionError|Failed to establish a new connection|Could not fetch URL|"
                          r"ConnectTimeoutError|ReadTimeoutError|Max retries exceeded|ProxyError|SSLError|"
                          r"connection broken by|Temporary failure in name resolution")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = REQUIREMENTS) -> dict[str, str]:
    """{normalized name: version} for every `name==version` line of a requirements file (lowvram_grpo.doctor's
    parser, the one the package uses)."""
    from lowvram_grpo.doctor import read_pins as parse

    return parse(path)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lowvram_grpo" / "wheels").expanduser()


def _wheel_prefix(name: str, version: str) -> str:
    # Wheel file names use the name with runs of -_. as "_" (PEP 427 / 491), case as published.
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}-".lower()


def cached_wheel(name: str, version: str, cache: Path) -> Optional[Path]:
    prefix = _wheel_prefix(name, version)
    for path in sorted(cache.glob("*.whl")):
        if path.name.lower().startswith(prefix):
            try:
                with zipfile.ZipFile(path):
                    return path
            except zipfile.BadZipFile:
                path.unlink()  # a damaged file from an interrupted copy: fetch again
    return None


def fetch(name: str, version: str, cache: Optional[Path] = None, index_url: Optional[str] = None) -> Path:
    """The wheel of `name==version` for the GPU target, from the cache or downloaded into it: from pip's
    configured index (None), or from `index_url` alone (`pip --isolated --index-url`)."""
    cache = Path(cache) if cache is not None else cache_dir()
    found = cached_wheel(name, version, cache)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    where = index_url or "the configured index (pip config list)"
    try:
        cert = os.environ.get("PIP_CERT")
        command = [sys.executable, "-m", "pip", *(["--isolated"] if index_url else []), "--disable-pip-version-check",
                   *(["--cert", cert] if cert else []),
                   "download", "--no-deps", "--only-binary=:all:",
                   *[arg for platform in PLATFORMS for arg in ("--platform", platform)],
                   "--python-version", PYTHON_VERSION, "--implementation", "cp",
                   *(["--index-url", index_url] if index_url else []),
                   "--timeout", "30", "--retries", "2", "--progress-bar", "off",
                   "-d", str(tmp), f"{name}=={version}"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
        wheels = list(tmp.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            output = (proc.stdout + proc.stderr).strip()
            tail = "\n".join(output.splitlines()[-6:])
            if _UNREACHABLE.search(output):
                raise RegistryUnreachable(f"{where} cannot be reached (pip download {name}=={version}):\n{tail}")
            raise WheelNotFound(f"{where} answers but pip found no CPython {PYTHON_VERSION} manylinux x86_64 wheel "
                                f"of {name}=={version} (the pin in requirements.txt):\n{tail}")
        target = cache / wheels[0].name
        os.replace(wheels[0], target)  # same directory tree: a complete file or none under the final name
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- reading a wheel's source

@dataclass(frozen=True)
class Params:
    """What a call can bind by keyword."""

    named: tuple[str, ...]          # positional-or-keyword and keyword-only parameters, in order
    positional_only: tuple[str, ...]
    required: tuple[str, ...]       # named parameters without a default
    var_keyword: Optional[str]      # the name of **kwargs, if any
    var_positional: Optional[str]

    @classmethod
    def of_function(cls, node: ast.FunctionDef | ast.AsyncFunctionDef) -> "Params":
        a = node.args
        positional = [p.arg for p in a.posonlyargs + a.args]
        defaults_from = len(positional) - len(a.defaults)
        required = [name for i, name in enumerate(positional) if i < defaults_from]
        required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
        posonly = tuple(p.arg for p in a.posonlyargs)
        return cls(named=tuple(p.arg for p in a.args) + tuple(p.arg for p in a.kwonlyargs),
                   positional_only=posonly, required=tuple(r for r in required if r not in posonly),
                   var_keyword=a.kwarg.arg if a.kwarg else None,
                   var_positional=a.vararg.arg if a.vararg else None)

    def without_first(self, count: int = 1) -> "Params":
        """The parameters left once `count` leading positional ones are bound (self, a partial's model, ...)."""
        positional = list(self.positional_only) + [n for n in self.named]
        bound = set(positional[:count])
        return Params(named=tuple(n for n in self.named if n not in bound),
                      positional_only=tuple(n for n in self.positional_only if n not in bound),
                      required=tuple(n for n in self.required if n not in bound),
                      var_keyword=self.var_keyword, var_positional=self.var_positional)


@dataclass
class Found:
    """A class or function definition located in a wheel."""

    wheel: "Wheel"
    member: str                      # path inside the wheel, e.g. unsloth/models/loader.py
    node: ast.AST
    qualname: str

    @property
    def where(self) -> str:
        return f"{self.wheel.name} {self.wheel.version}, {self.member}"

    @property
    def params(self) -> Params:
        assert isinstance(self.node, (ast.FunctionDef, ast.AsyncFunctionDef)), self.qualname
        return Params.of_function(self.node)

    def source(self) -> str:
        """The definition's own source with its decorators, dedented (as `inspect.getsource` + `textwrap.dedent`)."""
        decorators = getattr(self.node, "decorator_list", None) or []
        start = decorators[0].lineno if decorators else self.node.lineno
        lines = self.wheel.source(self.member).splitlines(keepends=True)[start - 1:self.node.end_lineno]
        return textwrap.dedent("".join(lines))


def top_level_statements(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """A module's (or class's) statements, looking inside if/else, try/except and with blocks
    (leaving out the bodies of the `if`s in FALSE_ON_TARGET)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if ast.unparse(node.test) not in FALSE_ON_TARGET:
                yield from top_level_statements(node.body)
            yield from top_level_statements(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            yield from top_level_statements(node.body)
            for handler in node.handlers:
                yield from top_level_statements(handler.body)
            yield from top_level_statements(node.orelse)
            yield from top_level_statements(node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from top_level_statements(node.body)


class Wheel:
    def __init__(self, name: str, version: str, path: Path):
        self.name, self.version, self.path = name, version, Path(path)
        self._zip = zipfile.ZipFile(self.path)
        self._sources: dict[str, str] = {}
        self._trees: dict[str, ast.Module] = {}

    @cached_property
    def members(self) -> frozenset[str]:
        return frozenset(self._zip.namelist())

    def source(self, member: str) -> str:
        if member not in self._sources:
            self._sources[member] = self._zip.read(member).decode("utf-8")
        return self._sources[member]

    def tree(self, member: str) -> ast.Module:
        if member not in self._trees:
            self._trees[member] = ast.parse(self.source(member), filename=f"{self.path.name}/{member}")
        return self._trees[member]

    def module_member(self, module: str) -> Optional[str]:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.members:
                return candidate
        return None


class PinnedWheels:
    """The wheels of some pinned packages, and name resolution across them (imports followed as written)."""

    def __init__(self, wheels: Mapping[str, Wheel]):
        self.wheels = dict(wheels)

    @classmethod
    def fetch(cls, names: Iterable[str], requirements: Path = REQUIREMENTS,
              cache: Optional[Path] = None) -> "PinnedWheels":
        pins = read_pins(requirements)
        wheels = {}
        for name in names:
            version = pins.get(normalize(name))
            if version is None:
                raise WheelNotFound(f"{requirements} pins no {name}")
            wheels[normalize(name)] = Wheel(name, version, fetch(name, version, cache))
        return cls(wheels)

    def __getitem__(self, name: str) -> Wheel:
        return self.wheels[normalize(name)]

    def locate_module(self, module: str) -> Optional[tuple[Wheel, str]]:
        for wheel in self.wheels.values():
            member = wheel.module_member(module)
            if member is not None:
                return wheel, member
        return None

    @staticmethod
    def _module_name(member: str) -> str:
        name = member[:-3].replace("/", ".")
        return name[: -len(".__init__")] if name.endswith(".__init__") else name

    def _absolute(self, member: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = self._module_name(member)
        if not member.endswith("__init__.py"):
            package = package.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def resolve(self, wheel: Wheel, member: str, name: str, _seen=None) -> Optional[Found]:
        """The definition that `name` refers to at module level in `member`, following imports into any wheel held."""
        seen = _seen if _seen is not None else set()
        if (member, name) in seen:
            return None
        seen.add((member, name))
        tree = wheel.tree(member)
        stars = []
        for node in top_level_statements(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Found(wheel, member, node, name)
            if isinstance(node, ast.ImportFrom):
                target = self._absolute(member, node)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(target)
                    elif (alias.asname or alias.name) == name:
                        located = self.locate_module(target)
                        if located is not None:
                            found = self.resolve(*located, alias.name, seen)
                            if found is not None:
                                return found
                        sub = self.locate_module(f"{target}.{alias.name}")  # `from pkg import module`
                        if sub is not None:
                            return Found(sub[0], sub[1], sub[0].tree(sub[1]), f"{target}.{alias.name}")
        for target in stars:
            located = self.locate_module(target)
            if located is not None and self._exports(*located, name):
                found = self.resolve(*located, name, seen)
                if found is not None:
                    return found
        return None

    def _exports(self, wheel: Wheel, member: str, name: str) -> bool:
        """Would `from module import *` bind `name`? (`__all__` if it is a literal list, else public names.)"""
        for node in top_level_statements(wheel.tree(member).body):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                try:
                    return name in ast.literal_eval(node.value)
                except ValueError:
                    break
        return not name.startswith("_")

    def find(self, package: str, member: str, qualname: str) -> Found:
        """`Class`, `Class.method` or `function` defined in (or imported into) `member` of `package`'s wheel;
        a method is looked up through the class's bases the way Python would (left to right, depth first)."""
        wheel = self[package]
        head, _, rest = qualname.partition(".")
        found = self.resolve(wheel, member, head)
        if found is None:
            raise LookupError(f"{head} is not defined in {wheel.name} {wheel.version}, {member}")
        if not rest:
            return found
        method = self.method(found, rest)
        if method is None:
            raise LookupError(f"{qualname} is not defined in {found.where} (nor in its bases)")
        return method

    def method(self, cls: Found, name: str) -> Optional[Found]:
        for node in cls.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Found(cls.wheel, cls.member, node, f"{cls.qualname}.{name}")
        for base in self.bases(cls):
            found = self.method(base, name)
            if found is not None:
                return found
        return None

    def bases(self, cls: Found) -> list[Found]:
        """The class's bases that are defined in the wheels held (others, e.g. msgspec.Struct, are left out)."""
        out = []
        for base in cls.node.bases:
            if isinstance(base, ast.Name):
                found = self.resolve(cls.wheel, cls.member, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                module = self.resolve(cls.wheel, cls.member, base.value.id)
                found = None
                if module is not None and isinstance(module.node, ast.Module):
                    found = self.resolve(module.wheel, module.member, base.attr)
            else:
                found = None
            if found is not None and isinstance(found.node, ast.ClassDef):
                out.append(found)
        return out

    def base_names(self, cls: Found) -> list[str]:
        return [ast.unparse(b) for b in cls.node.bases]

    def fields(self, cls: Found) -> dict[str, str]:
        """{field: where it is declared} of a dataclass or msgspec Struct: the annotated class attributes
        (ClassVar and `field(init=False)` left out), its bases' included where they are in the wheels held."""
        out: dict[str, str] = {}
        for base in reversed(self.bases(cls)):
            out.update(self.fields(base))
        for node in cls.node.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if "ClassVar" in ast.unparse(node.annotation):
                    continue
                value = node.value
                if (isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field"
                        and any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                                for k in value.keywords)):
                    out.pop(node.target.id, None)
                    continue
                out[node.target.id] = f"{cls.qualname} ({cls.where}:{node.lineno})"
        return out


# --------------------------------------------------------------------------- the check

def check_keywords(call: str, target: Found, kwargs: Mapping[str, object], origin: str,
                   positional: int = 0, accepted: Optional[Mapping[str, str]] = None) -> list[str]:
    """Problems with `call(<positional> positional arguments>, **kwargs)` against the definition found.

    `target` is a function (its parameters are checked; `positional` leading ones are taken as given
    positionally) or, with `accepted`, anything whose accepted keywords are listed there (dataclass
    fields). `origin` names where our keywords come from, for the messages."""
    where = target.where
    if accepted is None:
        params = target.params.without_first(positional)
        names, var_kw = set(params.named), params.var_keyword
        problems = []
        for key in params.required:
            if key not in kwargs:
                problems.append(f"{call} ({where}) requires '{key}', which we do not pass (from {origin})")
    else:
        names, var_kw, problems = set(accepted), None, []
    for key in kwargs:
        if key in names:
            continue
        swallow = f"; its **{var_kw} would swallow it without an error" if var_kw else ""
        close = [n for n in sorted(names) if _similar(key, n)]
        hint = f" (did it become {', '.join(repr(c) for c in close)}?)" if close else ""
        problems.append(f"{call} ({where}) has no parameter '{key}'{swallow}{hint} (we pass it from {origin})")
    return problems


def _similar(a: str, b: str) -> bool:
    import difflib

    return a in b or b in a or difflib.SequenceMatcher(None, a, b).ratio() >= 0.8
