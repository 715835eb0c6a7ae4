"""How the suite is spread over CI's two workers (tests/conftest.py): each module whole on one worker, so a
module-scoped SmolLM2 run or vLLM engine is made once, and FIRST's long tests units of their own. pytest-xdist's
`--dist loadgroup` stopped grouping under pytest 9.2 without a word (every module's fixtures were made on both
workers); these tests see the grouping where xdist schedules it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIRST, REPO, work_unit

MODULE = '''
import os, time
from pathlib import Path

def _note(name):
    start = time.time()
    time.sleep(0.3)  # long enough that a per-test scheduler hands the next test to the other worker
    with open(Path(__file__).parent / "workers.txt", "a") as f:
        f.write(f"{Path(__file__).stem} {name} {os.environ['PYTEST_XDIST_WORKER']} {start}\\n")

def test_a(): _note("a")
def test_b(): _note("b")
def test_c(): _note("c")
def test_d(): _note("d")
'''


def _session(folder: Path) -> list[tuple[str, str, str, float]]:
    """(module, test, worker, start) of each test of a two-worker session of `folder`, in the order they started."""
    path = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    # the suite's conftest as a plugin; no ini file, so xdist's own default (--dist load) is what it overrides
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), "-c", os.devnull, str(folder)],
                          cwd=folder, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = [line.split() for line in (folder / "workers.txt").read_text().splitlines()]
    return sorted(((m, t, w, float(s)) for m, t, w, s in ran), key=lambda r: r[3])


@pytest.mark.slow  # starts a two-worker pytest session
def test_each_module_runs_whole_on_one_worker(tmp_path):
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).write_text(MODULE)
    ran = _session(tmp_path)
    assert len(ran) == 8
    workers = {module: {w for m, _, w, _ in ran if m == module} for module in ("test_one", "test_two")}
    assert all(len(w) == 1 for w in workers.values()), workers


@pytest.mark.slow  # starts a two-worker pytest session
def test_units_are_handed_out_in_collection_order(tmp_path):
    """FIRST's one-test units go first because the collection puts them first: a scheduler that reorders units by
    their number of tests (xdist's default) would start a one-test module last."""
    (tmp_path / "test_1_short.py").write_text(MODULE.split("def test_b")[0])  # one test, collected first
    for name in ("test_2_long.py", "test_3_long.py"):
        (tmp_path / name).write_text(MODULE)
    ran = _session(tmp_path)
    started = {m: min(s for m2, _, _, s in ran if m2 == m) for m, _, _, _ in ran}
    assert started["test_1_short"] < started["test_3_long"], ran


def test_first_tests_are_units_of_their_own_and_their_modules_stay_whole():
    places = [work_unit(name)[0] for name in FIRST]
    assert places == list(range(len(FIRST)))
    for name in FIRST:
        module = name.split("::", 1)[0]
        if "::" in name:  # a FIRST test alone; the rest of its module one unit
            assert work_unit(name + "[param]") == work_unit(name)
            assert work_unit(module + "::test_some_other") == (len(FIRST), module)
        else:  # a FIRST module whole
            assert work_unit(module + "::test_some_other")[1] == module
    assert work_unit("tests/test_x.py::test_y") == (len(FIRST), "tests/test_x.py")


def test_first_names_tests_that_exist():
    """A renamed test would leave FIRST pointing at nothing, and its long test where collection puts it."""
    for name in FIRST:
        path, _, test = name.partition("::")
        source = (REPO / path).read_text()
        assert not test or re.search(rf"^def {re.escape(test)}\(", source, re.M), name
