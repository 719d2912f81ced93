"""Renderers of what runs fleetserve elsewhere: Kubernetes manifests (Deployment, Service,
PodDisruptionBudget, KEDA ScaledObject, ServiceMonitor, kustomization) and the Grafana
dashboard. Pure functions from a FleetConfig to plain dicts; the commands write YAML/JSON."""
