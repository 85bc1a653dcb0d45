"""The loopback port a side or a test server binds after Ray has started: outside the ranges Ray and the kernel hand
out while Ray starts."""
from __future__ import annotations

import socket

from kimi_k3_serve.serving import ports


def test_the_port_lies_between_rays_worker_ports_and_the_ephemeral_range_outside_serves_replica_ports() -> None:
    low = ports._ephemeral_low()
    for _ in range(100):  # a 1,001-port range in a 12,768-port gap: 100 draws all miss it by chance 3 times in 10,000
        port = ports.free_loopback_port()
        assert ports.ABOVE_RAY_WORKER_PORTS <= port < low
        assert port not in ports.SERVE_DIRECT_INGRESS_HTTP_PORTS  # a direct-ingress replica may take those
        with socket.socket() as s:  # and it is free
            s.bind((ports.LOOPBACK, port))


def test_with_the_gap_taken_the_kernel_chooses(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind((ports.LOOPBACK, 0))
        taken = held.getsockname()[1]
        # A gap of one port, already bound: the kernel's own choice, which is free and not that port.
        monkeypatch.setattr(ports, "ABOVE_RAY_WORKER_PORTS", taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1)
        port = ports.free_loopback_port()
        assert port != taken
        with socket.socket() as s:
            s.bind((ports.LOOPBACK, port))


def test_ports_drawn_together_are_all_different_even_from_a_gap_of_one(monkeypatch) -> None:
    # A gap of one free port: drawn one call at a time, that port comes back every time; drawn together, each is
    # held until all are chosen, so the kernel supplies the other six and no two are the same.
    low = 29000
    monkeypatch.setattr(ports, "ABOVE_RAY_WORKER_PORTS", low)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: low + 1)
    chosen = ports.free_loopback_ports(7)
    assert len(set(chosen)) == 7
    assert chosen.count(low) <= 1
