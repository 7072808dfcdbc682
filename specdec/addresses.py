"""Network addresses as the settings give them: is a host this machine only, and "host:port"."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Is `host` reachable from this machine only? (A hostname other than localhost counts as not.)"""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """"host:port", with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
