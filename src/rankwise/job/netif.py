"""Which local network interface reaches a given host (for Gloo on several machines).

Gloo binds to the interface of the machine's hostname unless GLOO_SOCKET_IFNAME says otherwise.
On hosts where the hostname resolves to 127.0.0.1 (common in containers and network namespaces)
the other machines then cannot reach it and the rendezvous waits for the whole timeout. Asking
the kernel's routing table which source address it would use towards the master gives the
interface that actually reaches it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from . import env as envmod

_SIOCGIFADDR = 0x8915


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def source_address_towards(host: str, port: int = 9) -> str | None:
    """The local IPv4 address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(host: str) -> str | None:
    """The name of the interface that reaches ``host`` (e.g. 'eth0'), or None if unknown."""
    address = source_address_towards(host)
    if address is None:
        return None
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def missed_by_hostname(host: str) -> bool:
    """True when ``host`` is an address of one of this machine's interfaces, but not one that
    this machine's hostname resolves to (torch's test for "this is the store's host" then
    says no: an address on a second interface, or a hostname that resolves to 127.0.0.1)."""
    try:
        address = socket.gethostbyname(host)
        if ipaddress.ip_address(address).is_loopback:
            return False
        named = set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        return False
    if address in named:
        return False
    return any(interface_address(name) == address for _, name in socket.if_nameindex())


def point_gloo_at(host: str) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that reaches ``host`` (rank 0's machine),
    unless the user chose one or ``host`` is this machine (then any interface works)."""
    if envmod.gloo_interface() or is_loopback(host):
        return
    name = interface_towards(host)
    if name is not None:
        envmod.default_gloo_interface(name)
