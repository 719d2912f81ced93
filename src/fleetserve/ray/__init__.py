"""fleetserve on Ray (`pip install fleetserve[ray]`): the fleet as a Ray Serve application.

    from fleetserve.ray import build_app
    serve.run(build_app("fleet.yaml"), route_prefix="/")

Importing this package imports Ray; nothing else in fleetserve does.
"""

from fleetserve.ray.app import build_app
from fleetserve.ray.ingress import IngressOptions

__all__ = ["IngressOptions", "build_app"]
