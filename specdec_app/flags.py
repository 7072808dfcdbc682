"""Command-line flags for the settings of specdec.config.

A setting `max_batch_size` is the flag `--max-batch-size` and the variable SPECDEC_MAX_BATCH_SIZE;
booleans get `--x / --no-x`. Flags default to "not given", so the default shown in `--help` and
the value used are the config's own. A flag beats the environment, the environment beats the
default. `settings_table()` renders the same facts for the README.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from specdec.config import REPO_ROOT, ServiceConfig, describe, parse_setting

# Groups of `specdec serve` settings, in the order --help and the README list them.
SERVE_SETTINGS = {
    "models": ("target", "draft", "num_speculative_tokens", "adaptive", "overlap", "tree_branches",
               "tree_side_depth", "device", "dtype",
               "max_batch_size", "kv_cache_blocks", "kv_block_size", "kv_cache_max_bytes", "kv_cache_dtype",
               "kv_memory_fraction",
               "prefill_chunk_tokens",
               "target_threads", "draft_threads", "target_weights", "draft_weights", "packed_weights", "cpu_kernels",
               "cuda_graph_max_batch",
               "max_q_entries", "ngram_max",
               "ngram_min", "ngram_window"),
    "network": ("host", "port", "http_port", "tls_cert", "tls_key", "auth_token", "grace_period",
                "max_concurrent_rpcs", "max_request_bytes", "max_stop_strings", "max_stop_string_length",
                "max_waiting_requests", "max_request_bytes_in_flight"),
    "ray": ("ray", "ray_address", "dashboard_host", "dashboard_port", "name", "worker_host", "worker_cpus",
            "max_restarts", "worker_wait", "target_worker_port", "draft_worker_port"),
    "worker failures": ("worker_round_timeout", "worker_recovery_timeout"),
    "replicas": ("replicas", "min_replicas", "max_replicas", "draft_replicas", "draft_placement",
                 "scale_up_queue", "scale_window", "scale_down_idle"),
}
# Other spellings of a setting's flag: short ones, and the name OpenAI clients know the token by.
FLAG_ALIASES = {"num_speculative_tokens": "-k", "auth_token": "--api-key"}
# Extra spellings of "no" for a boolean setting.
NEGATIVE_FLAGS = {"adaptive": "--fixed-k"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def format_default(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(REPO_ROOT):
        return str(Path(value).relative_to(REPO_ROOT))  # the shipped models, as the README names them
    return str(value)


def add_settings(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: Iterable[str],
                 defaults_note: Mapping[str, str] | None = None) -> None:
    """One flag per setting; `defaults_note` replaces the printed default where the command
    resolves it itself (e.g. `serve`'s draft)."""
    for name in names:
        info = describe(name)
        default = (defaults_note or {}).get(name, format_default(info.default))
        help_text = f"{info.help} (default: {default}; env {info.env_var})".replace("%", "%%")
        flags = [flag(name)] + ([FLAG_ALIASES[name]] if name in FLAG_ALIASES else [])
        if info.value_type is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            if name in NEGATIVE_FLAGS:
                parser.add_argument(NEGATIVE_FLAGS[name], dest=name, action="store_false",
                                    help=f"the same as --no-{flag(name)[2:]}")
        else:
            parser.add_argument(*flags, dest=name, type=info.value_type, default=None,
                                metavar=name.upper(), help=help_text)


def given_settings(args: argparse.Namespace, names: Iterable[str],
                   environ: Mapping[str, str] = os.environ) -> dict:
    """The settings the user chose: flags given on the command line, else SPECDEC_* variables."""
    out = {}
    for name in names:
        value, env_var = getattr(args, name, None), describe(name).env_var
        if value is not None:
            out[name] = value
        elif env_var in environ:
            out[name] = parse_setting(name, environ[env_var])  # may be None: "unset it"
    return out


def all_serve_settings() -> list[str]:
    return [name for group in SERVE_SETTINGS.values() for name in group]


def settings_table(defaults_note: Mapping[str, str] | None = None) -> str:
    """The README's Markdown table of `specdec serve` settings."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name in all_serve_settings():
        info = describe(name)
        shown = [flag(name)] if info.value_type is not bool else [f"{flag(name)} / --no-{flag(name)[2:]}"]
        shown += [f"/ {NEGATIVE_FLAGS[name]}"] if name in NEGATIVE_FLAGS else []
        default = (defaults_note or {}).get(name, format_default(info.default))
        rows.append(f"| `{' '.join(shown + ([FLAG_ALIASES[name]] if name in FLAG_ALIASES else []))}` "
                    f"| `{info.env_var}` | {default} | {info.help} |")
    return "\n".join(rows)


def config_from_args(args: argparse.Namespace, names: Iterable[str], **overrides) -> ServiceConfig:
    return ServiceConfig.from_settings(**{**given_settings(args, names), **overrides})
