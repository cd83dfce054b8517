"""Channel options for a caller of a replicated service (the routers, from a ranking stage):
calls spread over every replica the target resolves to, and skip a replica whose health says
NOT_SERVING, as a replica does from the moment it begins to drain (docs/reliability.md)."""

from __future__ import annotations

import json

from relaygr.tls import ChannelOption


def replica_options(service: str) -> list[ChannelOption]:
    """gRPC channel options for a target listing several replicas of `service` (e.g.
    "relaygr.v1.RouterService" at "ipv4:10.0.0.1:50051,10.0.0.2:50051", or a headless DNS name).

    Round robin over the replicas, each watched through `grpc.health.v1.Health/Watch` for
    `service`: a replica that turns NOT_SERVING gets no new call while the others serve, so a
    restart of one replica fails none of the calls sent during its `health_linger_s`.
    """
    config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": service},
    }
    return [("grpc.service_config", json.dumps(config))]
