"""Free TCP ports for rendezvous, weight-update groups and test servers."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` ('' = every interface) at the time of the call.

    The socket is closed before returning, so another process may take the port first: callers that
    start a server retry or accept that race (it is what torch's and SGLang's own launchers do).
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
