"""Probes, ports and the network in k8s/: gRPC health on the public port for startup and
readiness, liveness from Ray, a termination grace that outlasts the drain, the workers' fixed
ports, a NetworkPolicy that keeps the workers' gRPC to the coordinator and Ray's ports among Ray
pods, and the Service.
"""
from __future__ import annotations

from k8s_base import (
    HTTP_PORT,
    PUBLIC_PORT,
    WORKER_PORT_ENV,
    allowed,
    base_groups,
    base_one,
    covers_port,
    env_of,
    pod_labels,
    policies_for,
    ray_ports,
    script_of,
    selector_matches,
    worker_port,
)
from k8s_render import env_values, ray_container

# --- probes, ports, network policy, service ----------------------------------------------------


def _probe_window_s(probe: dict) -> int:
    """How long a failing probe takes to act: the kubelet's defaults where a field is unset."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_startup_and_readiness_are_grpc_health_checks_on_the_public_port():
    container = ray_container(base_groups()["head"])
    for probe in ("startupProbe", "readinessProbe"):
        spec = container[probe]
        assert set(spec) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == PUBLIC_PORT, probe
    assert container["readinessProbe"]["grpc"]["service"] == "specdec.v1.Generation"
    assert container["startupProbe"]["grpc"].get("service", "") == ""
    assert any(p["containerPort"] == PUBLIC_PORT and p["name"] == "grpc" for p in container["ports"])


def test_startup_probe_outlasts_the_wait_for_worker_pods_plus_model_loading():
    container = ray_container(base_groups()["head"])
    worker_wait = float(env_values(container)["SPECDEC_WORKER_WAIT"])
    # The autoscaler may first have to get a GPU node (the wait), then both models load: allow at
    # least 10 minutes for loading on top.
    assert _probe_window_s(container["startupProbe"]) >= worker_wait + 600


def test_liveness_asks_ray_not_specdec_so_a_loading_head_is_not_killed():
    head = base_groups()["head"]
    container = ray_container(head)
    liveness = container["livenessProbe"]
    # Not the gRPC health of :50051: that is down while `specdec serve` (re)loads models and
    # NOT_SERVING while replicas are down, and killing the head restarts the whole Ray cluster.
    assert set(liveness) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"httpGet"}
    assert liveness["httpGet"]["path"] == "/api/gcs_healthz"
    assert liveness["httpGet"]["port"] == int(head["rayStartParams"]["dashboard-port"])
    assert any(p["containerPort"] == liveness["httpGet"]["port"] for p in container["ports"])
    assert _probe_window_s(liveness) >= 60, "one slow GCS answer must not restart the cluster"


def test_termination_grace_outlasts_drain_plus_stop():
    head = base_groups()["head"]
    container = ray_container(head)
    env = env_values(container)
    script = script_of(container)
    # The numbers the head command actually uses for each stage of stopping.
    assert '--grace-period "$SPECDEC_GRACE_PERIOD"' in script
    assert 'sleep "$SPECDEC_GRACE_PERIOD"; sleep "$SPECDEC_STOP_SECONDS"' in script
    assert 'timeout "$SPECDEC_RAY_STOP_SECONDS" ray stop' in script
    stopping = sum(float(env[v]) for v in ("SPECDEC_GRACE_PERIOD", "SPECDEC_STOP_SECONDS",
                                           "SPECDEC_RAY_STOP_SECONDS"))
    assert head["template"]["spec"]["terminationGracePeriodSeconds"] > stopping
    assert float(env["SPECDEC_GRACE_PERIOD"]) > 0 and float(env["SPECDEC_STOP_SECONDS"]) > 0


def test_worker_ports_are_fixed_and_the_same_in_every_pod():
    ports = {role: worker_port(role) for role in WORKER_PORT_ENV}
    assert len(set(ports.values())) == 2 and PUBLIC_PORT not in ports.values()
    for name, group in base_groups().items():
        env = env_of(ray_container(group))
        for role, var in WORKER_PORT_ENV.items():
            assert int(env[var]["value"]) == ports[role], (name, var)
        if name != "head":
            assert ports[name] in [p["containerPort"] for p in ray_container(group)["ports"]]
    # Not inside any range Ray may use.
    for name, group in base_groups().items():
        params = group["rayStartParams"]
        low, high = int(params["min-worker-port"]), int(params["max-worker-port"])
        for port in ports.values():
            assert not low <= port <= high and port not in ray_ports(name)


def test_network_policy_isolates_the_workers_grpc_ports_to_the_coordinator():
    head = pod_labels("head")
    for worker in ("target", "draft"):
        labels = pod_labels(worker)
        assert policies_for(labels), f"{worker} pods are not selected by any NetworkPolicy"
        for role in WORKER_PORT_ENV:
            port = worker_port(role)
            assert allowed(port, labels, head), (worker, port)
            assert not allowed(port, labels, pod_labels("target" if worker == "draft" else "draft"))
            assert not allowed(port, labels, labels)
            assert not allowed(port, labels, {"app": "something-else"})
            assert not allowed(port, labels, None)
    # The same holds rule by rule: every rule that opens a worker gRPC port names only pod peers
    # that select the head and no worker.
    for policy in policies_for(pod_labels("target")) + policies_for(pod_labels("draft")):
        for rule in policy["spec"]["ingress"]:
            if any(covers_port(p, worker_port(r)) for p in rule.get("ports", [{}]) for r in WORKER_PORT_ENV):
                assert rule.get("from"), rule
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}
                    assert selector_matches(peer["podSelector"], head)
                    assert not selector_matches(peer["podSelector"], pod_labels("target"))
                    assert not selector_matches(peer["podSelector"], pod_labels("draft"))


def test_network_policy_opens_the_public_port_and_keeps_ray_inside_the_cluster():
    head = pod_labels("head")
    assert policies_for(head), "the coordinator pod is not selected by any NetworkPolicy"
    for public in (PUBLIC_PORT, HTTP_PORT):
        assert allowed(public, head, None) and allowed(public, head, {"app": "client"})
    members = [pod_labels(g) for g in base_groups()]
    for name in base_groups():
        dst = pod_labels(name)
        params = base_groups()[name]["rayStartParams"]
        ports = ray_ports(name) + [int(params["min-worker-port"]), int(params["max-worker-port"])]
        for port in ports:
            for src in members:
                assert allowed(port, dst, src), (name, port, src)
            assert not allowed(port, dst, {"app": "something-else"}), (name, port)
            assert not allowed(port, dst, None), (name, port)


def test_service_targets_the_coordinator_on_its_grpc_and_http_ports():
    service = base_one("Service")
    selector = service["spec"]["selector"]
    assert selector_matches({"matchLabels": selector}, pod_labels("head"))
    assert not selector_matches({"matchLabels": selector}, pod_labels("target"))
    assert not selector_matches({"matchLabels": selector}, pod_labels("draft"))
    grpc_port, http_port = service["spec"]["ports"]
    assert grpc_port["port"] == PUBLIC_PORT and grpc_port["targetPort"] == PUBLIC_PORT
    assert grpc_port["appProtocol"] == "grpc" and grpc_port["protocol"] == "TCP"
    assert http_port["port"] == HTTP_PORT and http_port["targetPort"] == HTTP_PORT
    assert http_port["appProtocol"] == "http" and http_port["protocol"] == "TCP"
    container_ports = {p["name"]: p["containerPort"] for p in ray_container(base_groups()["head"])["ports"]}
    assert container_ports["grpc"] == PUBLIC_PORT and container_ports["http"] == HTTP_PORT
