"""The Ray Serve request router for engine replicas: `engine.replicas.routing` behind Ray
Serve's custom request-router interface.

Ray Serve creates one `ReplicaRequestRouter` per deployment handle, in the process holding the
handle (the ingress), and calls `choose_replicas` for each request to the engine replicas. The
ingress passes a `Route` as the call's `route` keyword argument; the router answers with one
replica (Ray then sends the request there, or asks again if that replica refuses it) and
replaces the argument by the `Route` with its `RoutingDecision`, so the replica learns why it
was chosen (it counts decisions in its `/metrics` and names them in a response header).
`on_request_routed` is when the decision takes effect in the router's books.

Ray Serve ships this module to the ingress by value (a copy of its classes), so the types the
ingress shares with it (`Route`) live in `engine.replicas.routing`.

Loads are Ray Serve's counts of requests in flight at each replica, from its queue-length
cache (a replica with no entry yet counts as idle).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.replicas.routing import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_MIN_MOVE_LOAD,
    ReplicaRouter,
    Route,
    RouterName,
    RoutingDecision,
    make_router,
)

ROUTE_ARGUMENT = "route"


class ReplicaRequestRouter(RequestRouter):
    """Routes each request to the engine replica chosen by a `ReplicaRouter`."""

    def initialize_state(self, router: RouterName = "affinity", seed: int = 0,
                         load_factor: float = DEFAULT_LOAD_FACTOR,
                         min_move_load: int = DEFAULT_MIN_MOVE_LOAD, **_: Any) -> None:
        """Called by Ray Serve with the deployment's `request_router_kwargs`."""
        self._router: ReplicaRouter = make_router(router, seed=seed, load_factor=load_factor,
                                                  min_move_load=min_move_load)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        replicas = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if not replicas:
            return []
        route = _route_of(pending_request)
        if route is None:
            return [list(replicas.values())]
        decision = self._decide(route, replicas)
        assert pending_request is not None
        pending_request.kwargs[ROUTE_ARGUMENT] = dataclasses.replace(route, decision=decision)
        return [[replicas[decision.replica_id]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        route = _route_of(pending_request)
        if route is None or route.decision is None or route.purpose == "replica":
            return
        if route.decision.replica_id != replica_id.unique_id:
            return
        self._router.routed(route.key, route.decision)
        if route.purpose == "end_job" and route.key is not None:
            self._router.forget(route.key)

    def _decide(self, route: Route, replicas: dict[str, RunningReplica]) -> RoutingDecision:
        if route.purpose == "replica":
            replica_ids = sorted(replicas)
            return RoutingDecision(replica_ids[(route.replica_index or 0) % len(replica_ids)],
                                   "lookup")
        loads = {replica_id: self._queue_len(replica)
                 for replica_id, replica in replicas.items()}
        return self._router.choose(route.key, loads, lookup=route.purpose != "generate")

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


def _route_of(pending_request: PendingRequest | None) -> Route | None:
    if pending_request is None:
        return None
    route = pending_request.kwargs.get(ROUTE_ARGUMENT)
    return route if isinstance(route, Route) else None
