"""The GPU nodes' locked environment (``deploy/requirements-gpu*.lock``, written by ``scripts/make_gpu_lock.py``)
and the image built from it (``deploy/Dockerfile``).

The locks must pin the stack the planner was written for (ray 2.60.0, vllm 0.32.0, a torch), every line must
be ``name==version`` with file hashes, and every runtime dependency of this package must be in them, at a version
its requirement allows. These checks read only the repository, so what a package index holds today cannot change
their result. Resolving again against the index (the lock's recorded ``exclude-newer``, the committed pins kept
where the inputs allow) runs only when asked for: ``KIMI_K3_SERVE_LOCK_ONLINE=1``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import sys

import pytest
from packaging.requirements import Requirement

from conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("make_gpu_lock", REPO_ROOT / "scripts" / "make_gpu_lock.py")
make_gpu_lock = importlib.util.module_from_spec(_spec)
sys.modules["make_gpu_lock"] = make_gpu_lock
_spec.loader.exec_module(make_gpu_lock)

LOCKS = {name: target.lock for name, target in make_gpu_lock.TARGETS.items()}


def _requirement_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("platform", LOCKS)
def test_lock_pins_the_planned_stack(platform):
    pins = make_gpu_lock.pins(LOCKS[platform].read_text())
    assert pins.get("ray") == "2.60.0"
    assert pins.get("vllm") == "0.32.0"
    assert re.fullmatch(r"2\.\d+\.\d+", pins.get("torch", "")), pins.get("torch")
    # Everything this package imports at run time, and what ray.serve.llm needs besides.
    for requirement in make_gpu_lock.requirements_in():
        assert _requirement_name(requirement) in pins, requirement


@pytest.mark.parametrize("platform", LOCKS)
def test_every_lock_line_is_a_pin_with_hashes(platform):
    text = LOCKS[platform].read_text()
    assert make_gpu_lock.malformed_lines(text) == []
    lines = text.splitlines()
    pinned = [i for i, line in enumerate(lines) if make_gpu_lock.PIN.match(line)]
    assert len(pinned) > 100
    for i in pinned:  # each pin is followed by at least one sha256 of its files
        assert make_gpu_lock.HASH.match(lines[i + 1]), lines[i]
    assert make_gpu_lock.recorded_exclude_newer(text), "the lock must record its exclude-newer time"


def test_lock_follows_pyproject_runtime_dependencies():
    """A dependency added to pyproject.toml without writing the locks again is caught here."""
    header = LOCKS["x86_64"].read_text().split("\n\n", 1)[0]
    listed = re.findall(r"^#   (\S+)$", header, re.MULTILINE)
    assert listed == make_gpu_lock.requirements_in()
    assert set(make_gpu_lock.runtime_dependencies()) <= set(listed)


@pytest.mark.parametrize("platform", LOCKS)
def test_every_input_is_pinned_at_a_version_it_allows(platform):
    """A requirement tightened in pyproject.toml (pyyaml>=7, say) that the committed pin no longer meets is a real
    drift: caught here without asking any index."""
    pins = make_gpu_lock.pins(LOCKS[platform].read_text())
    for line in make_gpu_lock.requirements_in():
        requirement = Requirement(line)
        version = pins[_requirement_name(line)]
        assert requirement.specifier.contains(version, prereleases=True), f"{line}: the lock pins {version}"


def test_a_check_resolves_at_the_locks_date_keeping_its_pins():
    """The re-resolution is hermetic by construction: the recorded date, and the committed lock as uv's output
    file, whose pins uv keeps (a release listed after the lock was written, under an earlier upload time, cannot
    move them)."""
    target = make_gpu_lock.TARGETS["x86_64"]
    recorded = make_gpu_lock.recorded_exclude_newer(target.lock.read_text())
    command = make_gpu_lock.compile_command("uv", target, recorded, overrides=False)
    assert command[command.index("--exclude-newer") + 1] == recorded
    assert command[command.index("--output-file") + 1] == make_gpu_lock.OUTPUT_NAME
    assert "--upgrade" not in command


def test_dockerfile_installs_the_lock_then_the_package_without_dependencies():
    text = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.MULTILINE).group(1)
    assert re.search(r"cuda:13\.|rayproject/ray", base), base
    install_lock = text.index("requirements-gpu")
    install_package = text.index("--no-deps")
    assert install_lock < install_package
    assert "pip install" in text


def _pypi_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


@pytest.mark.skipif(os.environ.get("KIMI_K3_SERVE_LOCK_ONLINE") != "1",
                    reason="asks the package index: set KIMI_K3_SERVE_LOCK_ONLINE=1 to run it")
def test_resolving_again_gives_the_same_pins(capsys):
    uv = make_gpu_lock.find_uv(install=False)
    if uv is None:
        pytest.skip("uv is not installed (pip install uv): cannot resolve the lock again")
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable: cannot resolve the lock again offline")
    rc = make_gpu_lock.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("same ") == len(LOCKS), out
