"""A deployment on a Ray instance of the load test's own (--chaos, --replicas-sweep): Ray started
on this machine without a dashboard, the service launched on loopback with any free public port,
and both stopped when the run ends.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import ray

from specdec.config import ServiceConfig
from specdec_app.ray_actors import Deployment, launch
from specdec_app.ray_cluster import NAMESPACE, checkout_env


def local_config(config: ServiceConfig, name: str, **settings) -> ServiceConfig:
    """`config` on loopback (any free gRPC port, no HTTP API) under deployment name `name`, with
    `settings` on top. Actors run in other directories: model paths must not be relative to this
    one, so a model that is a local path is made absolute."""
    paths = {role: str(Path(model).resolve()) for role, model in (("target", config.target.model),
                                                                  ("draft", config.draft.model))
             if model is not None and Path(model).exists()}
    return ServiceConfig.from_settings(config, host="127.0.0.1", port=0, http_port=0, name=name,
                                       **{**paths, **settings})


@contextlib.contextmanager
def local_deployment(config: ServiceConfig, num_cpus: int) -> Iterator[Deployment]:
    """Start Ray with `num_cpus`, launch `config` on it, yield the deployment; then drain it and
    shut Ray down, however the block ends."""
    ray.init(include_dashboard=False, logging_level="WARNING", namespace=NAMESPACE, num_cpus=num_cpus,
             runtime_env={"env_vars": checkout_env()})
    try:
        deployment = launch(config)
        try:
            yield deployment
        finally:
            deployment.drain_and_stop(5.0)
    finally:
        ray.shutdown()


def machine_cpus(at_least: int) -> int:
    """This machine's CPU count, but at least `at_least` (Ray schedules by the count it is told)."""
    return max(os.cpu_count() or 1, at_least)
