"""Where a pool's pods may run: spot nodes or on-demand nodes, on any major cloud.

Each provider marks its spot nodes with its own label, so a spot pod needs *one* of them
(node selector terms are ORed) and an on-demand pod needs *none* of them (expressions of
one term are ANDed; NotIn also matches a node without the label). Some providers taint
spot nodes as well, so spot pods tolerate those taints.
"""

from __future__ import annotations

from typing import Any

from fleetserve.serve.config.deploy_config import PoolKind

# (node label, its value on spot nodes), per provider.
SPOT_NODE_LABELS: tuple[tuple[str, str], ...] = (
    ("cloud.google.com/gke-spot", "true"),  # GKE Spot VMs
    ("eks.amazonaws.com/capacityType", "SPOT"),  # EKS managed node groups
    ("kubernetes.azure.com/scalesetpriority", "spot"),  # AKS spot node pools
    ("karpenter.sh/capacity-type", "spot"),  # Karpenter (EKS and others)
)
# Taints the providers put on spot nodes (GKE when asked to, AKS always).
SPOT_TAINTS: tuple[tuple[str, str], ...] = (
    ("cloud.google.com/gke-spot", "true"),
    ("kubernetes.azure.com/scalesetpriority", "spot"),
)
GPU_RESOURCE = "nvidia.com/gpu"


def node_affinity(pool: PoolKind) -> dict[str, Any]:
    if pool == "spot":
        terms = [
            {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}
            for key, value in SPOT_NODE_LABELS
        ]
    else:
        terms = [
            {
                "matchExpressions": [
                    {"key": key, "operator": "NotIn", "values": [value]}
                    for key, value in SPOT_NODE_LABELS
                ]
            }
        ]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": terms}}}  # fmt: skip


def tolerations(pool: PoolKind, gpu: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if pool == "spot":
        out += [
            {"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}
            for key, value in SPOT_TAINTS
        ]
    if gpu > 0:  # GPU node pools are commonly tainted so that only GPU pods land there
        out.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return out
