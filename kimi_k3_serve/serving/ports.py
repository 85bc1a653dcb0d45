"""A free loopback port for a listener that binds it later, after Ray has started.

Asking the kernel for port 0 gives a port of its ephemeral range, the range Ray's own processes (raylet, agents,
metrics exporter) and every outgoing connection take their ports from while Ray starts. Between the choice and the
listener's bind, one of them can take it: on CI (2026-12-03) Serve's HAProxy then failed with "cannot bind socket
(Address already in use)". A port between Ray's worker ports (10002-19999 by default) and the ephemeral range is
taken by neither, except the HTTP ports Serve gives its replicas under direct ingress (30000-31000 by default), which
are left out too.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

from kimi_k3_serve.serving.haproxy_loopback import LOOPBACK
ABOVE_RAY_WORKER_PORTS = 20000
DEFAULT_EPHEMERAL_LOW = 32768
"""Linux's default ``net.ipv4.ip_local_port_range`` starts here."""
SERVE_DIRECT_INGRESS_HTTP_PORTS = range(30000, 31001)
"""Serve 2.60's ``RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_HTTP_PORT`` defaults: a replica's own HTTP server under direct
ingress takes one of these (its gRPC range, 40000-41000, lies in the ephemeral range)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def free_loopback_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` different ports free on ``host`` now, outside the ranges Ray and the kernel hand out; the kernel's
    choice where that gap is too narrow or full. Each stays bound until all are chosen, so no two are the same: ports
    drawn one call at a time can repeat, and ``ray start`` then refused two components on one port (CI, 2026-12-04)."""
    gap = [port for port in range(ABOVE_RAY_WORKER_PORTS, _ephemeral_low())
           if port not in SERVE_DIRECT_INGRESS_HTTP_PORTS]
    chosen: list[int] = []
    with contextlib.ExitStack() as held:
        for port in random.sample(gap, min(len(gap), 256 + count)):
            if len(chosen) == count:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()  # only the chosen ones stay bound
                continue
            held.enter_context(s)
            chosen.append(port)
        while len(chosen) < count:
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            chosen.append(s.getsockname()[1])
    return chosen


def free_loopback_port(host: str = LOOPBACK) -> int:
    """One port as :func:`free_loopback_ports` chooses them."""
    return free_loopback_ports(1, host)[0]
