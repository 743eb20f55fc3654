"""Addresses for servers that Slurm workers must reach (the rollout server, the fleet queue)."""
from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)


def node_address(name: str) -> str:
    """The address to bind for a server that workers reach as `name`: the first non-loopback IPv4 address `name`
    resolves to; when it resolves to loopback only (e.g. `localhost`, or a node whose name maps to 127.0.1.1),
    that loopback address (with a warning: workers on other nodes cannot reach it); when it does not resolve,
    127.0.0.1 (warned). Never 0.0.0.0: a server asked for one address must not listen on every interface."""
    try:
        addrs = [a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)]
    except OSError:
        addrs = []
    for a in addrs:
        if not a.startswith("127."):
            return a
    bind = addrs[0] if addrs else "127.0.0.1"
    log.warning("server for workers: %r resolves to no non-loopback address (%s); listening on %s only, which "
                "workers on other nodes cannot reach (set serve_host to this node's cluster address)", name, addrs,
                bind)
    return bind
