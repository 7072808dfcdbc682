"""Every setting of the service, with its flat name: `ServiceConfig` and how settings reach it.

The roles' frozen dataclasses (target worker, draft worker, scheduler, public server, Ray
deployment, replicas; specdec.role_configs, where each field's default, help text and check are
written once) are composed into `ServiceConfig`. A config is built once, from Python keyword
arguments (`ServiceConfig.from_settings(**kwargs)`, which LocalEngine uses), from `specdec serve`
flags or from `SPECDEC_*` environment variables, validated as it is built (errors name the
field), and passed whole to every factory. `specdec serve --help` and the README's settings table
print those defaults.

A *setting* has one flat name used everywhere: the keyword argument `max_batch_size`, the flag
`--max-batch-size`, the variable `SPECDEC_MAX_BATCH_SIZE`. Most map to one field; the worker
settings (`device`, `dtype`, `kv_*`) set the target's and the draft's field alike.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

# The names below are defined with their roles (specdec.role_configs, specdec.addresses) and are
# imported from here everywhere: this module is where the settings are looked up.
from specdec.addresses import host_port, is_loopback
from specdec.role_configs import (
    NGRAM,
    REPO_ROOT,
    SHIPPED_DRAFT,
    SHIPPED_TARGET,
    ConfigError,
    DraftConfig,
    RayConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServerConfig,
    TargetConfig,
    WorkerConfig,
)

__all__ = [
    "ENV_PREFIX", "NGRAM", "REPO_ROOT", "SETTINGS", "SHIPPED_DRAFT", "SHIPPED_TARGET", "ConfigError", "DraftConfig",
    "RayConfig", "ReplicaConfig", "SchedulerConfig", "ServerConfig", "ServiceConfig", "SettingInfo", "TargetConfig",
    "WorkerConfig", "cache_dir", "describe", "host_port", "is_loopback", "parse_setting", "settings_from_env",
]

ENV_PREFIX = "SPECDEC_"


def cache_dir() -> Path:
    """Where specdec keeps what it builds once per machine (compiled kernels, benchmark models):
    $SPECDEC_CACHE_DIR, default ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec")


# Settings whose flat name is not simply the field's name.
_RENAMED = {
    ("target", "model"): "target", ("draft", "model"): "draft",
    ("target", "num_threads"): "target_threads", ("draft", "num_threads"): "draft_threads",
    ("target", "weights"): "target_weights", ("draft", "weights"): "draft_weights",
    ("ray", "enabled"): "ray", ("ray", "address"): "ray_address", ("replicas", "count"): "replicas",
}


@dataclass(frozen=True)
class ServiceConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)

    @classmethod
    def from_settings(cls, base: ServiceConfig | None = None, **settings) -> ServiceConfig:
        """`base` (default: all defaults) with flat settings replaced, e.g.
        `ServiceConfig.from_settings(target="models/target", draft="ngram", max_batch_size=8)`."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(SETTINGS))}")
        changes: dict[str, dict] = {}
        for name, value in settings.items():
            for role, field_name in SETTINGS[name]:
                changes.setdefault(role, {})[field_name] = value
        config = base or cls()
        return dataclasses.replace(config, **{role: dataclasses.replace(getattr(config, role), **fields)
                                              for role, fields in changes.items()})


def _role_classes() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(ServiceConfig)}


def _flat_settings() -> dict[str, tuple[tuple[str, str], ...]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for role, cls in _role_classes().items():
        for f in dataclasses.fields(cls):
            out.setdefault(_RENAMED.get((role, f.name), f.name), []).append((role, f.name))
    return {name: tuple(targets) for name, targets in out.items()}


# flat setting name -> the (role, field) pairs it sets
SETTINGS: dict[str, tuple[tuple[str, str], ...]] = _flat_settings()


@dataclass(frozen=True)
class SettingInfo:
    name: str
    default: object
    help: str
    value_type: type  # int, float, str or bool (None allowed when `optional`)
    optional: bool

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()


def describe(name: str) -> SettingInfo:
    """Default, help text and type of a flat setting (from its first field)."""
    role, field_name = SETTINGS[name][0]
    cls = _role_classes()[role]
    f = next(f for f in dataclasses.fields(cls) if f.name == field_name)
    hint = typing.get_type_hints(cls)[field_name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    value_type = args[0] if args else hint
    return SettingInfo(name, f.default, f.metadata["help"], value_type, optional=len(args) < len(typing.get_args(hint)))


def parse_setting(name: str, text: str):
    """A setting's value from text (an environment variable): 'none' or '' is None where allowed."""
    info = describe(name)
    if info.optional and text.strip().lower() in ("", "none"):
        return None
    try:
        if info.value_type is bool:
            lowered = text.strip().lower()
            if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError
            return lowered in ("1", "true", "yes", "on")
        return info.value_type(text)
    except ValueError:
        raise ConfigError(f"{info.env_var}={text!r} is not a valid {info.value_type.__name__}") from None


def settings_from_env(environ: typing.Mapping[str, str]) -> dict:
    """The flat settings given as SPECDEC_<NAME> variables in `environ`."""
    return {name: parse_setting(name, environ[ENV_PREFIX + name.upper()])
            for name in SETTINGS if ENV_PREFIX + name.upper() in environ}
