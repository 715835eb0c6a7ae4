"""The README's layout section matches the tree: every module and folder of the package is named there,
and nothing it names is missing (a reader finds from it where data enters, the model is built, settings
are decided, rewards are computed and outputs are written)."""
import re

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


def test_the_layout_says_where_the_main_things_happen():
    text = (REPO / "README.md").read_text()
    for phrase in ("where questions enter", "where the model is built", "where settings are decided",
                   "where rewards are computed", "where outputs are written"):
        assert phrase in text, phrase
