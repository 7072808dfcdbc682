"""What `specdec serve` tells its user: `ServeError` (a problem the user can fix, printed without
a traceback), the warning about an exposed server, and the lines that say what is served where.
"""
from __future__ import annotations

import dataclasses
import sys

from specdec.addresses import host_port
from specdec.config import ServiceConfig


class ServeError(Exception):
    """A problem the user can fix (bad path, port in use): printed without a traceback."""


def print_error(error: ServeError) -> None:
    print(f"specdec serve: error: {error}", file=sys.stderr, flush=True)


def say(message: str) -> None:
    print(message, flush=True)


def warn_exposure(config: ServiceConfig) -> None:
    """Before anything is bound: say loudly what is unsafe about where we are about to listen."""
    warnings = config.server.exposure_warnings()
    if not warnings:
        return
    bar = "!" * 100
    lines = [bar, "specdec serve: WARNING: this server is reachable from other machines and not protected:"]
    lines += [f"  - {warning}" for warning in warnings]
    lines += ["  (serve on 127.0.0.1, the default, to keep it to this machine)", bar]
    print("\n".join(lines), file=sys.stderr, flush=True)


def http_note(config: ServiceConfig, http_port: int | None) -> str:
    """", OpenAI-compatible HTTP API at http://host:port/v1" when it is on."""
    if not http_port:
        return ""
    scheme = "https" if config.server.tls_cert else "http"
    return f", OpenAI-compatible HTTP API at {scheme}://{host_port(config.server.host, http_port)}/v1"


def describe(config: ServiceConfig) -> str:
    return (f"{config.target.model} (+draft {config.draft.model})" if config.draft.model
            else f"{config.target.model} (no draft)")


def kv_summary(target_info, replicas: int) -> str:
    """The start-up line on KV-cache capacity (TargetInfo, or its dict from a worker actor)."""
    info = target_info if isinstance(target_info, dict) else dataclasses.asdict(target_info)
    blocks, size = info["kv_blocks_total"], info["kv_block_size"]
    each = " each" if replicas > 1 else ""
    return (f"specdec KV cache: {blocks} blocks of {size} tokens{each}, at most {blocks * size} tokens of "
            f"concurrent context per target replica ({replicas} replica{'s' if replicas > 1 else ''})")
