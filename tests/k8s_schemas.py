"""Validators for rendered manifests (test helper).

Core kinds: kubernetes-validate's strict schemas of the newest Kubernetes it ships (unknown
fields are errors, as with `kubectl apply --validate=strict`). Custom resources: the
openAPIV3Schema of their CRD (vendored in tests/data/crds/, see its README), made strict the
same way: an object schema with `properties` and no `additionalProperties` (nor
`x-kubernetes-preserve-unknown-fields`) refuses other keys, which is what the API server's
strict field validation does with a CRD's structural schema. Their metadata is checked as
ObjectMeta by kubernetes-validate (a RayService's CRD inlines the full PodTemplateSpec
schema of its head and worker groups, so those are checked by the CRD itself). The JSON schemas cannot say what the API server's
validation of names and labels says, so those rules are checked here too.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

CRD_DIR = Path(__file__).parent / "data" / "crds"
CRD_FILES = {
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("ray.io", "RayService"): "ray.io_rayservices.yaml",
}
K8S_VERSION = kubernetes_validate.latest_version()
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class NameError_(ValueError):
    """A name or label the API server would refuse."""


def check_names(obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    name = meta["name"]
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise NameError_(f"metadata.name {name!r}: not a DNS subdomain")
    if obj["kind"] in ("Service", "Namespace") and (
        len(name) > 63 or not _DNS_1035_LABEL.match(name)
    ):
        raise NameError_(f"{obj['kind']} name {name!r}: not a DNS-1035 label")
    for key, value in meta.get("labels", {}).items():
        prefix, _, label = key.rpartition("/")
        if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
            raise NameError_(f"label key {key!r}: its prefix is not a DNS subdomain")
        if len(label) > 63 or not _LABEL_NAME.match(label):
            raise NameError_(f"label key {key!r}: not a label name")
        if (
            not isinstance(value, str)
            or len(value) > 63
            or (value and not _LABEL_NAME.match(value))
        ):
            raise NameError_(f"label {key}={value!r}: not a label value")


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(group: str, kind: str, version: str) -> jsonschema.protocols.Validator:
    """Built once per CRD: checking a 1 MB schema against the meta-schema (what
    `jsonschema.validate` does on every call) takes seconds."""
    schema = crd_schema(group, kind, version)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@functools.cache
def crd_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    # KubeRay's CRD is 1 MB of YAML: the C loader reads it in 0.5 s, the Python one in 10+.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRD_DIR / CRD_FILES[(group, kind)]).read_text(), Loader=loader)
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return _strict(v["schema"]["openAPIV3Schema"])  # type: ignore[no-any-return]
    raise KeyError(f"{group}/{version} {kind}: not in {CRD_FILES[(group, kind)]}")


def validate(obj: dict[str, Any]) -> None:
    """Raises (kubernetes_validate.ValidationError, jsonschema.ValidationError or NameError_)
    if `obj` is not a valid object of its kind."""
    check_names(obj)
    group, _, version = obj["apiVersion"].rpartition("/")
    if (group, obj["kind"]) in CRD_FILES:
        error = jsonschema.exceptions.best_match(
            crd_validator(group, obj["kind"], version).iter_errors(obj)
        )
        if error is not None:
            raise error
        # ObjectMeta's own rules, through a kind whose schema kubernetes-validate has.
        meta_only = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
        kubernetes_validate.validate(meta_only, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
