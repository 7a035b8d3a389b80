"""A port for an endpoint several processes must know before any of them binds it.

A torchrun rendezvous endpoint, a lighthouse, the ``--master_port`` of a torchft group: the
port is chosen here, handed to each process, and bound later by one of them. A port the kernel
picked (bind to port 0, read it, release it) comes from its ephemeral range, from which it also
hands out every other port-0 bind and every outgoing connection's local port (a gloo pair, a
store client): in between, any of them may take it, and the job dies with ``EADDRINUSE``. The
port chosen here lies below that range, where only an explicit bind can land, and is one that
nothing holds now (listening or in ``TIME_WAIT``). Where a launcher can bind port 0 itself and
pass the port on (``scaffolding/forked_ranks``, ``tests/dist_utils.call_store``), it does that.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_LOWEST = 20_000  # above the ports services register (and this project's own 29500s)
_handed_out: set[int] = set()  # two endpoints of one job must not get the same port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; other systems' ranges start higher


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing holds, outside the ephemeral range where possible."""
    low = _ephemeral_low()
    candidates = [p for p in range(_LOWEST, low) if p not in _handed_out and not 29_400 <= p < 29_600]
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT is refused too
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port
