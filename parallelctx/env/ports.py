"""Free TCP ports for a rendezvous store, drawn below the range outgoing connections use."""

from __future__ import annotations

import random
import socket

_PORT_FLOOR = 15000  # lowest port free_port draws (above most registered services' ports)


def _ephemeral_low() -> int:
    """The lowest port Linux hands out for outgoing connections (32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    It is drawn at random below the range the OS hands out for outgoing connections
    (``/proc/sys/net/ipv4/ip_local_port_range``): a port the OS picks (``bind(0)``) comes from
    that range, where any process's next outgoing connection (gloo opens many) may take it
    before the store binds it; below it only another program's explicit bind can. When no
    port there binds in 64 draws, the OS picks one. Raises ``OSError`` when ``host`` cannot be
    bound at all."""
    low = _ephemeral_low()
    draw = random.Random()
    if low - _PORT_FLOOR >= 1000:
        for _ in range(64):
            port = draw.randrange(_PORT_FLOOR, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
