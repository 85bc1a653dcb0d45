"""Write the GPU cluster nodes' locked environment: ``deploy/requirements-gpu.lock`` (x86_64) and
``deploy/requirements-gpu-arm64.lock`` (aarch64, for GB300 trays).

Resolved with ``uv pip compile`` for Python 3.12 on manylinux_2_28 from:
- ``ray[serve]==2.60.0`` and ``vllm==0.32.0`` (the versions the planner's memory accounting follows),
- ``pyarrow`` (imported by ``ray.serve.llm`` at run time),
- this package's runtime dependencies, read from ``pyproject.toml``.

Every line of a lock is ``name==version`` with the SHA-256 of each file, so ``pip install -r`` on a node gets
exactly these files (pip turns on hash checking by itself when a requirement carries hashes). This package
is installed afterwards with ``--no-deps`` (``deploy/Dockerfile``).

Resolving again is hermetic in two ways. Packages uploaded after ``--exclude-newer`` (recorded in each lock's
header) are ignored, and the committed lock is handed to uv as its output file, so uv keeps every pin that still
satisfies the inputs. The date alone is not enough: an index can list a release under an upload time before the
recorded date (ml-dtypes 0.7.0 appeared that way after the lock of 2026-11-30 was written). A new upstream release
therefore changes nothing; a real drift (an input that the committed pins no longer satisfy, a pinned file gone
from the index) still shows as different pins. ``--upgrade`` resolves from scratch at the new date.

    .venv/bin/python scripts/make_gpu_lock.py            # write both locks (needs PyPI; about 30 s)
    .venv/bin/python scripts/make_gpu_lock.py --check    # resolve again, compare with the committed pins
    .venv/bin/python scripts/make_gpu_lock.py --upgrade  # newest versions the inputs allow, as of now

uv is taken from the virtual environment, then from PATH; when neither has it, it is installed into this
interpreter's environment with pip.

Exit codes: 0 written / same pins, 1 ``--check`` found different pins, 2 uv or the resolution failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
PYTHON_VERSION = "3.12"
GPU_STACK = ("ray[serve]==2.60.0", "vllm==0.32.0", "pyarrow")
"""Pinned explicitly even where pyproject.toml already lists them, so a lock cannot silently lose one."""
INPUT_NAME = "requirements-gpu.in"
"""The name the locks' ``# via -r`` annotations give the input list (written to a temporary folder)."""


@dataclass(frozen=True)
class Target:
    lock: Path
    python_platform: str
    """uv's ``--python-platform``."""


TARGETS: dict[str, Target] = {
    "x86_64": Target(REPO / "deploy" / "requirements-gpu.lock", "x86_64-manylinux_2_28"),
    "aarch64": Target(REPO / "deploy" / "requirements-gpu-arm64.lock", "aarch64-manylinux_2_28"),
}

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)(?: \\)?$")
HASH = re.compile(r"^    --hash=sha256:[0-9a-f]{64}(?: \\)?$")
EXCLUDE_NEWER = re.compile(r"^# exclude-newer: (\S+)$", re.MULTILINE)


def runtime_dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    """``[project].dependencies`` of pyproject.toml."""
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def requirements_in(pyproject: Path = PYPROJECT) -> list[str]:
    """What a lock is resolved from: the GPU stack, then this package's runtime dependencies (deduplicated)."""
    seen: list[str] = []
    for requirement in (*GPU_STACK, *runtime_dependencies(pyproject)):
        if requirement not in seen:
            seen.append(requirement)
    return seen


def find_uv(*, install: bool) -> str | None:
    """The uv executable: beside this interpreter (the venv), then on PATH; else installed with pip when
    ``install``, else None."""
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file():
        return str(beside)
    on_path = shutil.which("uv")
    if on_path:
        return on_path
    if not install:
        return None
    print("uv not found: installing it into this environment with pip", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "uv"], check=True)
    return str(beside) if beside.is_file() else shutil.which("uv")


OUTPUT_NAME = "requirements-gpu.txt"
"""The output file uv writes in the temporary folder; holding the committed lock, it is uv's list of preferences."""


def compile_command(uv: str, target: Target, exclude_newer: str, *, overrides: bool) -> list[str]:
    """The ``uv pip compile`` call, run in a folder that holds the inputs and, as ``OUTPUT_NAME``, the pins to keep."""
    command = [uv, "pip", "compile", INPUT_NAME, "--python-version", PYTHON_VERSION,
               "--python-platform", target.python_platform, "--exclude-newer", exclude_newer,
               "--generate-hashes", "--no-header", "--index-url", "https://pypi.org/simple", "--quiet",
               "--output-file", OUTPUT_NAME]
    return command + (["--override", "overrides.txt"] if overrides else [])


def compile_lock(uv: str, target: Target, exclude_newer: str, *, overrides: tuple[str, ...] = (),
                 preferred: str = "") -> str:
    """The lock text for ``target``: our header, then uv's pins with hashes. ``preferred`` (a lock's text) is what
    uv keeps where the inputs still allow it. Raises RuntimeError with uv's message when the resolution fails."""
    requirements = requirements_in()
    with tempfile.TemporaryDirectory(prefix="gpu-lock-") as tmp:
        (Path(tmp) / INPUT_NAME).write_text("\n".join(requirements) + "\n")
        (Path(tmp) / OUTPUT_NAME).write_text(preferred)
        if overrides:
            (Path(tmp) / "overrides.txt").write_text("\n".join(overrides) + "\n")
        command = compile_command(uv, target, exclude_newer, overrides=bool(overrides))
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
        resolved = (Path(tmp) / OUTPUT_NAME).read_text()
    if done.returncode != 0:
        raise RuntimeError(f"uv pip compile failed for {target.python_platform} (exit {done.returncode}): "
                           + (done.stderr.strip().splitlines() or ["no message"])[-1])
    header = [
        f"# {target.lock.name}: the locked Python {PYTHON_VERSION} environment of a GPU node "
        f"({target.python_platform}).",
        f"# Written by `python scripts/make_gpu_lock.py`; do not edit. Resolved with uv from {INPUT_NAME}:",
        *(f"#   {requirement}" for requirement in requirements),
        *(f"# override: {override}" for override in overrides),
        f"# exclude-newer: {exclude_newer}",
        "# Install: pip install -r <this file>, then pip install --no-deps <the kimi-k3-serve checkout> (deploy/Dockerfile).",
    ]
    return "\n".join(header) + "\n" + resolved


def pins(text: str) -> dict[str, str]:
    """``{normalised name: version}`` of a lock's ``name==version`` lines."""
    found = {}
    for line in text.splitlines():
        match = PIN.match(line)
        if match:
            found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return found


def malformed_lines(text: str) -> list[str]:
    """Lines that are neither ``name==version``, a ``--hash=sha256:`` continuation, a comment nor blank."""
    return [line for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#") and not PIN.match(line) and not HASH.match(line)]


def recorded_exclude_newer(text: str) -> str | None:
    match = EXCLUDE_NEWER.search(text)
    return match.group(1) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  .venv/bin/python scripts/make_gpu_lock.py --check")
    parser.add_argument("--platform", choices=[*TARGETS, "all"], default="all", help="which lock (default: all)")
    parser.add_argument("--exclude-newer", help="ignore uploads after this RFC 3339 time (default: now when "
                                                "writing; the lock's recorded time with --check)")
    parser.add_argument("--override", action="append", default=[], metavar="NAME==VERSION",
                        help="force a version over what the packages ask for (uv --override); repeatable")
    parser.add_argument("--check", action="store_true", help="resolve again at the lock's date, keeping its pins "
                                                             "where the inputs allow; compare; write nothing")
    parser.add_argument("--upgrade", action="store_true", help="resolve from scratch instead of keeping the "
                                                               "committed pins")
    args = parser.parse_args(argv)
    uv = find_uv(install=not args.check)
    if uv is None:
        print("error: uv: not found beside this interpreter nor on PATH (pip install uv)", file=sys.stderr)
        return 2
    names = list(TARGETS) if args.platform == "all" else [args.platform]
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
    different = 0
    for name in names:
        target = TARGETS[name]
        committed = target.lock.read_text() if target.lock.exists() else ""
        exclude_newer = args.exclude_newer or (recorded_exclude_newer(committed) if args.check else None) or now
        overrides = tuple(args.override) or tuple(re.findall(r"^# override: (\S+)$", committed, re.MULTILINE))
        try:
            text = compile_lock(uv, target, exclude_newer, overrides=overrides,
                                preferred="" if args.upgrade else committed)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        found = pins(text)
        if args.check:
            old = pins(committed)
            changed = sorted(set(old) ^ set(found) | {k for k in set(old) & set(found) if old[k] != found[k]})
            if changed:
                different += 1
                print(f"{target.lock.relative_to(REPO)}: {len(changed)} pins differ: "
                      + ", ".join(f"{k} {old.get(k, '-')} -> {found.get(k, '-')}" for k in changed[:10]))
            else:
                print(f"{target.lock.relative_to(REPO)}: same {len(found)} pins (exclude-newer {exclude_newer})")
            continue
        target.lock.write_text(text)
        print(f"wrote {target.lock.relative_to(REPO)}: {len(found)} packages for {target.python_platform}, "
              f"ray {found.get('ray')}, vllm {found.get('vllm')}, torch {found.get('torch')} "
              f"(exclude-newer {exclude_newer})")
    return 1 if different else 0


if __name__ == "__main__":
    raise SystemExit(main())
