"""Addresses for servers that Slurm workers must reach (the rollout server, the fleet queue)."""
from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)


def node_address(name: str) -> str:
    """The first non-loopback IPv4 address `name` resolves to; 0.0.0.0 (with a warning) when there is none."""
    try:
        addrs = [a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)]
    except OSError:
        addrs = []
    for a in addrs:
        if not a.startswith("127."):
            return a
    log.warning("server for workers: %r resolves to no non-loopback address (%s); listening on 0.0.0.0 "
                "(mutating endpoints still need the job token)", name, addrs)
    return "0.0.0.0"
