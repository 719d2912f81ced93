"""A model's `deploy:` section: how `fleetserve deploy k8s` runs it as a pool of pods.

    models:
      - name: chat
        replicas: 1                  # engine processes per pod
        deploy:
          pool: spot                 # spot | on_demand: the nodes its pods may run on
          cpu: "4"                   # requests = limits (Kubernetes quantities)
          memory: 16Gi
          gpu: 1                     # nvidia.com/gpu per pod
          min_replicas: 0            # pods; 0 scales to zero when nothing waits
          max_replicas: 8
          target_queue_depth: 8      # waiting requests per pod KEDA aims for
          activation_queue_depth: 0  # scale up from zero when more than this wait
          cooldown_s: 300            # idle time before scaling to zero
          drain_timeout_s: 30        # in-flight requests' time after SIGTERM

`fleetserve serve` does not read it: inside a pod the server runs the model as the rest of
the entry says. It lives in the fleet file so that one file describes the fleet everywhere.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PoolKind = Literal["spot", "on_demand"]

# Kubernetes' resource quantity: a number with an optional decimal or binary suffix.
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


class DeployConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    pool: PoolKind = "on_demand"
    cpu: str = "2"
    memory: str = "8Gi"
    gpu: int = Field(default=0, ge=0, le=64)
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)
    target_queue_depth: float = Field(default=8.0, gt=0.0)
    activation_queue_depth: float = Field(default=0.0, ge=0.0)
    cooldown_s: int = Field(default=300, ge=0, le=86_400)
    polling_interval_s: int = Field(default=15, ge=1, le=3600)
    drain_timeout_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    # Seconds between a pod leaving the Service's endpoints and its SIGTERM: requests
    # routed before the endpoint update lands still reach a server that takes them.
    endpoint_delay_s: int = Field(default=5, ge=0, le=300)
    startup_timeout_s: int = Field(default=900, ge=10, le=86_400)

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, value: object) -> object:
        # YAML reads `cpu: 4` as an int; a quantity is the same number as a string.
        if isinstance(value, bool):
            return value  # let strict str validation refuse it
        if isinstance(value, int | float):
            value = str(value)
        if isinstance(value, str) and not _QUANTITY.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
        return value

    @model_validator(mode="after")
    def _check(self) -> DeployConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        return self
