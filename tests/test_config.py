"""One config per role: defaults written once, validation that names the field, and the three
ways to give a setting (keyword argument, flag, environment) agreeing with each other."""
from __future__ import annotations

import argparse
import dataclasses
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from specdec.config import (
    NGRAM,
    SETTINGS,
    SHIPPED_DRAFT,
    SHIPPED_TARGET,
    ConfigError,
    DraftConfig,
    SchedulerConfig,
    ServiceConfig,
    describe,
    settings_from_env,
)
from specdec_app import cli
from specdec_app.flags import SERVE_SETTINGS, add_settings, all_serve_settings, given_settings, settings_table
from specdec_app.serve import DRAFT_DEFAULT_NOTE, build_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_compose_into_one_service_config():
    config = ServiceConfig()
    assert config.target.model == str(SHIPPED_TARGET) and config.draft.kind == "none"
    assert config.scheduler == SchedulerConfig()
    # The worker settings are declared once (WorkerConfig) and shared by both roles.
    assert config.target.kv_block_size == config.draft.kv_block_size == describe("kv_block_size").default
    assert config.target.resolved_dtype == "float32"
    assert ServiceConfig.from_settings(device="cuda").draft.resolved_dtype == "bfloat16"


def test_flat_settings_set_every_role_they_name():
    config = ServiceConfig.from_settings(target="/m/t", draft=NGRAM, device="cuda", kv_block_size=8,
                                         max_batch_size=3, port=0, ray=False, target_threads=2)
    assert (config.target.model, config.draft.kind) == ("/m/t", NGRAM)
    assert config.target.device == config.draft.device == "cuda"
    assert config.target.kv_block_size == config.draft.kv_block_size == 8
    assert config.scheduler.max_batch_size == 3 and config.server.port == 0 and not config.ray.enabled
    assert (config.target.num_threads, config.draft.num_threads) == (2, None)
    # Every flat setting reaches at least one field, and every field has exactly one setting.
    fields = [pair for pairs in SETTINGS.values() for pair in pairs]
    assert len(fields) == len(set(fields))
    for role in ("target", "draft", "scheduler", "server", "ray"):
        cls = type(getattr(config, role))
        assert {(role, f.name) for f in dataclasses.fields(cls)} <= set(fields), role


@pytest.mark.parametrize("settings,field", [
    (dict(max_batch_size=0), "scheduler.max_batch_size"),
    (dict(num_speculative_tokens=-1), "scheduler.num_speculative_tokens"),
    (dict(num_speculative_tokens=65), "scheduler.num_speculative_tokens"),
    (dict(dtype="float64"), "target.dtype"),
    (dict(device="tpu"), "target.device"),
    (dict(kv_block_size=0), "target.kv_block_size"),
    (dict(kv_cache_blocks=-3), "target.kv_cache_blocks"),
    (dict(ngram_min=3, ngram_max=2), "draft.ngram_max"),
    (dict(max_q_entries=0), "draft.max_q_entries"),
    (dict(port=70000), "server.port"),
    (dict(http_port=-2), "server.http_port"),
    (dict(tls_cert="cert.pem"), "server.tls_key"),
    (dict(grace_period=-1.0), "server.grace_period"),
    (dict(max_restarts=-2), "ray.max_restarts"),
])
def test_bad_values_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        ServiceConfig.from_settings(**settings)


def test_unknown_setting_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown setting.*max_bach_size.*max_batch_size"):
        ServiceConfig.from_settings(max_bach_size=4)


def test_draft_none_in_any_spelling_means_no_speculation():
    assert DraftConfig(model="none").kind == DraftConfig(model="None").kind == DraftConfig().kind == "none"


def test_environment_parses_by_type():
    env = {"SPECDEC_MAX_BATCH_SIZE": "7", "SPECDEC_RAY": "no", "SPECDEC_GRACE_PERIOD": "2.5",
           "SPECDEC_KV_CACHE_BLOCKS": "none", "SPECDEC_AUTH_TOKEN": "s3cret", "SPECDEC_UNRELATED": "x"}
    assert settings_from_env(env) == {"max_batch_size": 7, "ray": False, "grace_period": 2.5,
                                      "kv_cache_blocks": None, "auth_token": "s3cret"}
    with pytest.raises(ConfigError, match="SPECDEC_PORT='eighty' is not a valid int"):
        settings_from_env({"SPECDEC_PORT": "eighty"})


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for title, names in SERVE_SETTINGS.items():
        add_settings(parser.add_argument_group(title), names)
    return parser.parse_args(argv)


def test_a_flag_beats_the_environment_which_beats_the_default():
    env = {"SPECDEC_MAX_BATCH_SIZE": "7", "SPECDEC_PORT": "6000"}
    given = given_settings(_serve_args(["--port", "5000", "-k", "3", "--no-ray"]), all_serve_settings(), env)
    assert given == {"port": 5000, "num_speculative_tokens": 3, "ray": False, "max_batch_size": 7}
    config = ServiceConfig.from_settings(**given)
    assert config.server.host == describe("host").default  # untouched: the default


def test_http_port_and_the_api_key_spelling_of_the_token():
    given = given_settings(_serve_args(["--api-key", "k3y", "--http-port", "-1"]), all_serve_settings(), {})
    assert given == {"auth_token": "k3y", "http_port": -1}
    config = ServiceConfig.from_settings(**given).server
    assert config.auth_token == "k3y" and config.http_enabled
    env = given_settings(_serve_args([]), all_serve_settings(), {"SPECDEC_HTTP_PORT": "0"})
    assert env == {"http_port": 0} and not ServiceConfig.from_settings(**env).server.http_enabled
    assert ServiceConfig().server.http_port == 8000


def test_serve_uses_the_shipped_draft_only_with_the_shipped_target(monkeypatch, tmp_path):
    for name in list(__import__("os").environ):
        if name.startswith("SPECDEC_"):
            monkeypatch.delenv(name)
    assert build_config(_serve_args([])).draft.model == str(SHIPPED_DRAFT)
    assert build_config(_serve_args(["--target", str(SHIPPED_TARGET)])).draft.kind == "none"
    assert build_config(_serve_args(["--draft", NGRAM])).draft.kind == NGRAM
    monkeypatch.setenv("SPECDEC_DRAFT", "none")
    assert build_config(_serve_args([])).draft.kind == "none"


def test_serve_help_prints_the_config_defaults():
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(out.getvalue().split())
    for name in ("max_batch_size", "num_speculative_tokens", "kv_block_size", "port", "grace_period"):
        assert f"(default: {describe(name).default}; env SPECDEC_{name.upper()})" in text, name
    assert "models/target" in text and DRAFT_DEFAULT_NOTE in text


def test_readme_settings_table_is_generated_from_the_config():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- settings table: generated -->\n", "\n<!-- end of settings table -->"
    assert start in readme and end in readme, "README lacks the generated settings table markers"
    table = readme.split(start, 1)[1].split(end, 1)[0]
    assert table == settings_table({"draft": DRAFT_DEFAULT_NOTE}), (
        "README settings table is stale: regenerate it with `python scripts/readme_settings.py`")
