"""Extract one API version's OpenAPI schema from a CustomResourceDefinition into a vendored JSON file.

    git -C kuberay show v1.2.2:ray-operator/config/crd/bases/ray.io_rayclusters.yaml > crd.yaml
    python tests/schemas/vendor_crd_schema.py crd.yaml v1 "KubeRay v1.2.2 (commit ...), <path>" \
        tests/schemas/kuberay-raycluster-v1.schema.json

Only `versions[name=<version>].schema.openAPIV3Schema` is kept, with its `description` keywords
dropped (KubeRay's CRD has none; Prometheus Operator's are most of its size) and a "$comment"
naming the source. Nothing else changes: tests/test_k8s_schemas.py makes the schema strict when it
loads it, so the file stays what upstream ships.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def without_descriptions(node, *, is_properties_map: bool = False):
    """The schema without `description` keywords; a *property* named "description" stays."""
    if isinstance(node, dict):
        return {key: without_descriptions(value, is_properties_map=key == "properties" and not is_properties_map)
                for key, value in node.items() if is_properties_map or key != "description"}
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    return node


def main(crd_path: str, version: str, source: str, out: str) -> None:
    crd = yaml.load(Path(crd_path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = without_descriptions(entry["schema"]["openAPIV3Schema"])
    comment = (f"{crd['spec']['names']['kind']} {crd['spec']['group']}/{version} from {source}: "
               f"versions[name={version}].schema.openAPIV3Schema without descriptions; Apache License 2.0. "
               "Regenerate with tests/schemas/vendor_crd_schema.py.")
    Path(out).write_text(json.dumps({"$comment": comment, **schema}, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
