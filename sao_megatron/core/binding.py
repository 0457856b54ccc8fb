"""Which address this host's servers listen on, and a TCPStore that listens only there.

torch's TCPStore server listens on every interface (``*:port``), so the trainer's rendezvous and its
weight-update store would be reachable from any network the node is on. Here the store's socket is
bound first, to one address, and handed to TCPStore (``master_listen_fd``).

The configured interface (in order): ``SAO_BIND_ADDR`` (an address), else the IPv4 address of
``SAO_INTERFACE`` (e.g. ib0), else the address this node's name resolves to (``SLURMD_NODENAME``
under slurm, the hostname otherwise: the name peers use to reach it), else 127.0.0.1.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
from typing import Mapping

BIND_ADDR_VAR = "SAO_BIND_ADDR"
INTERFACE_VAR = "SAO_INTERFACE"
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """IPv4 address of network interface `name`; ValueError naming the interface when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            raise ValueError(f"{INTERFACE_VAR}={name}: no such interface with an IPv4 address on "
                             f"{socket.gethostname()}; see `ip -4 addr`") from None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The interface holding IPv4 `address` (what GLOO_SOCKET_IFNAME wants), or None."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except ValueError:
            continue
    return None


def bind_address(env: Mapping[str, str] | None = None) -> str:
    """The address this node's servers listen on (module docstring: the order of the rules)."""
    env = os.environ if env is None else env
    if env.get(BIND_ADDR_VAR):
        return env[BIND_ADDR_VAR]
    if env.get(INTERFACE_VAR):
        return interface_address(env[INTERFACE_VAR])
    name = env.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` only; OSError naming both when the address is not ours."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((socket.gethostbyname(host), port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port} ({err.strerror}): is {host} an address "
                                 f"of this host ({socket.gethostname()})?") from None
    sock.listen(1024)
    return sock


def bound_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float):
    """torch TCPStore at host:port; the master's server listens on that address alone. Port 0 (a
    master only): the kernel picks a free port while binding, so no other process can take it between
    a choice and the bind; the store's `.port` says which."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    fd = sock.detach()   # the store owns the descriptor from here on
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)
