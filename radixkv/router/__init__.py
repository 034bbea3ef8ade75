"""Routing requests across engine replicas; pure Python, imports without torch.

`route` is the decision as one pure function; `PrefixIndex` estimates what a replica's prefix
cache holds; `Router` keeps those per replica with their loads, for the server and `simulate`.
"""

from radixkv.router.policy import (
    ROUTERS,
    NoReplicaAvailable,
    ReplicaView,
    RouteDecision,
    RouterConfig,
    route,
)
from radixkv.router.prefix_index import PrefixIndex
from radixkv.router.router import ReplicaStats, Router

__all__ = [
    "ROUTERS",
    "NoReplicaAvailable",
    "PrefixIndex",
    "ReplicaStats",
    "ReplicaView",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "route",
]
