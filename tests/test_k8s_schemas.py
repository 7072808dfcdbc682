"""Every object that `kubectl kustomize` renders from k8s/ (the base and every overlay) validated
against its real schema, strictly: an unknown field is an error, not something the API server
would silently drop.

- RayCluster (ray.io/v1): the OpenAPI schema of KubeRay's CRD, vendored in tests/schemas/ from a
  pinned release (see the README there). CRD schemas leave `additionalProperties` open, so the
  schema is made strict here: every object schema that lists `properties` gets
  `additionalProperties: false` unless it already says otherwise or preserves unknown fields.
  Its pod templates and metadata also go through the Kubernetes schemas (below), which are newer
  than the Kubernetes API that KubeRay 1.2's CRD embeds.
- PodMonitor (monitoring.coreos.com/v1): Prometheus Operator's CRD schema, the same way.
- Every built-in kind: `kubernetes-validate` in strict mode, against the Kubernetes 1.30 API.
And the checks can fail: planted unknown fields and wrong types are rejected.
"""
from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from k8s_render import VARIANTS, groups, one, rendered

SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes k8s/README.md supports is 1.27; 1.30 is validated
CRD_SCHEMAS = {("ray.io/v1", "RayCluster"): "kuberay-raycluster-v1.schema.json",
               ("monitoring.coreos.com/v1", "PodMonitor"): "prometheus-operator-podmonitor-v1.schema.json"}


def strict(schema):
    """A copy of an OpenAPI v3 (CRD) schema for jsonschema: unknown fields rejected wherever the
    schema lists the known ones, and `nullable: true` read as "null is allowed too"."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}  # keys here are field names
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
            out[key] = strict(value)
        else:
            out[key] = value
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@cache
def _upstream_schema(api_version: str, kind: str) -> dict:
    return json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())


@cache
def _validator(api_version: str, kind: str, *, strict_mode: bool = True) -> jsonschema.Validator:
    schema = _upstream_schema(api_version, kind)
    # OpenAPI 3.0's schema objects are JSON Schema draft 4/5 plus a few keywords of their own.
    return jsonschema.Draft4Validator(strict(schema) if strict_mode else schema)


def _crd_errors(doc: dict, *, strict_mode: bool = True) -> list[str]:
    validator = _validator(doc["apiVersion"], doc["kind"], strict_mode=strict_mode)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _validate(doc: dict) -> None:
    """Raise if `doc` is not valid for its kind (AssertionError or kubernetes-validate's error)."""
    if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
        errors = _crd_errors(doc)
        assert not errors, "\n".join(errors)
        # CRD schemas leave metadata open (`type: object`): check it as any object's metadata.
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                     K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _rejected(doc: dict) -> bool:
    try:
        _validate(doc)
    except (AssertionError, kubernetes_validate.ValidationError):
        return True
    return False


def _raycluster(variant: str = "base") -> dict:
    return one(rendered(variant), "RayCluster")


# --- every rendered object ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_validates_strictly_against_its_schema(variant):
    docs = rendered(variant)
    assert docs, variant
    for doc in docs:
        _validate(doc)


@pytest.mark.parametrize("variant", VARIANTS)
def test_raycluster_pod_templates_validate_against_the_kubernetes_schema(variant):
    for name, group in groups(_raycluster(variant)).items():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"specdec-{name}"},
                   "template": group["template"]}
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def test_every_overlay_renders_a_raycluster_and_only_kinds_with_a_schema():
    for variant in VARIANTS:
        kinds = {(d["apiVersion"], d["kind"]) for d in rendered(variant)}
        assert ("ray.io/v1", "RayCluster") in kinds, variant
        for api_version, kind in kinds - set(CRD_SCHEMAS):
            assert "." not in api_version.split("/")[0] or api_version.split("/")[0].endswith("k8s.io"), \
                f"{variant}: {kind} {api_version} is a custom resource without a vendored schema"


# --- the checks can fail -----------------------------------------------------------------------


RAYCLUSTER_TYPOS = [
    ("spec", "enableInTreeAutoscale", True),
    ("spec/autoscalerOptions", "idleTimeout", 60),
    ("spec/workerGroupSpecs/0", "minReplica", 1),
    ("spec/headGroupSpec", "rayStartParam", {}),
    ("spec/headGroupSpec/template/spec/containers/0/startupProbe", "grpcc", {"port": 50051}),
    ("spec/workerGroupSpecs/1/template/spec", "nodeSelectors", {"a": "b"}),
]


def _at(doc: dict, path: str):
    node = doc
    for part in path.split("/"):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


@pytest.mark.parametrize("path,field,value", RAYCLUSTER_TYPOS)
def test_an_unknown_raycluster_field_is_rejected_though_the_crd_alone_accepts_it(path, field, value):
    doc = _raycluster()
    assert not _crd_errors(doc)
    _at(doc, path)[field] = value
    errors = _crd_errors(doc)
    assert any(field in e and "Additional properties" in e for e in errors), errors
    # Why the schema is made strict: as shipped, the CRD lets the typo through (and the API server
    # would prune it without a word).
    assert not _crd_errors(doc, strict_mode=False)


def test_wrongly_typed_raycluster_values_are_rejected():
    for path, field, value in [("spec/workerGroupSpecs/0", "maxReplicas", "4"),
                               ("spec/headGroupSpec/rayStartParams", "num-cpus", 0),
                               ("spec/autoscalerOptions", "upscalingMode", "Fast")]:
        doc = _raycluster()
        _at(doc, path)[field] = value
        assert _crd_errors(doc), (path, field, value)
        assert _crd_errors(doc, strict_mode=False), (path, field, value)


def test_raycluster_metadata_and_missing_required_fields_are_checked():
    doc = _raycluster()
    doc["metadata"]["lables"] = {"a": "b"}
    assert _rejected(doc)
    doc = _raycluster()
    del doc["spec"]["headGroupSpec"]
    assert _rejected(doc)


@pytest.mark.parametrize("kind,path,field", [("Service", "spec/ports/0", "targetPorts"),
                                             ("Service", "spec", "selectors"),
                                             ("NetworkPolicy", "spec", "ingres"),
                                             ("PodDisruptionBudget", "spec", "maxUnavailabe"),
                                             ("PersistentVolumeClaim", "metadata", "label")])
def test_an_unknown_field_in_a_builtin_kind_is_rejected(kind, path, field):
    doc = [d for d in rendered() if d["kind"] == kind][0]
    _validate(doc)
    planted = copy.deepcopy(doc)
    _at(planted, path)[field] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(planted)


def test_an_unknown_field_in_a_deployment_is_rejected():
    """The same strictness for the kind most clusters run: a Deployment of the head's pod template."""
    template = groups(_raycluster())["head"]["template"]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "specdec"},
                  "spec": {"selector": {"matchLabels": template["metadata"]["labels"]}, "template": template}}
    _validate(deployment)
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "x"
    assert _rejected(deployment)


def test_an_unknown_podmonitor_field_is_rejected():
    doc = one(rendered("overlays/podmonitor"), "PodMonitor")
    assert not _crd_errors(doc)
    doc["spec"]["podMetricsEndpoints"][0]["bearerToken"] = "x"  # not a PodMonitor field
    assert _crd_errors(doc) and not _crd_errors(doc, strict_mode=False)


def test_strict_leaves_open_maps_and_preserved_fields_open():
    schema = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "raw": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "name": {"type": "string", "nullable": True}}}
    validator = jsonschema.Draft4Validator(strict(schema))
    assert not list(validator.iter_errors({"labels": {"any": "thing"}, "raw": {"b": 1}, "name": None}))
    assert list(validator.iter_errors({"labels": {"any": 1}}))
    assert list(validator.iter_errors({"nme": "x"}))
