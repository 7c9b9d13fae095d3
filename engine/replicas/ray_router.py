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

Loads are the requests in flight at each replica: those this router sent that have not
completed, or Ray Serve's cached queue length there when larger.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict
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
MAX_EARLY_COMPLETIONS = 10_000


class ReplicaRequestRouter(RequestRouter):
    """Routes each request to the engine replica chosen by a `ReplicaRouter`."""

    def initialize_state(self, router: RouterName = "affinity", seed: int = 0,
                         load_factor: float = DEFAULT_LOAD_FACTOR,
                         min_move_load: int = DEFAULT_MIN_MOVE_LOAD, **_: Any) -> None:
        """Called by Ray Serve with the deployment's `request_router_kwargs`."""
        self._router: ReplicaRouter = make_router(router, seed=seed, load_factor=load_factor,
                                                  min_move_load=min_move_load)
        # The requests this router sent each replica that have not completed (internal request
        # ids); Ray may report a fast request completed before it reports it routed.
        self._in_flight: defaultdict[str, set[str]] = defaultdict(set)
        self._completed_early: OrderedDict[str, None] = OrderedDict()

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
        request_id = pending_request.metadata.internal_request_id
        if self._completed_early.pop(request_id, "absent") == "absent":
            self._in_flight[replica_id.unique_id].add(request_id)
        route = _route_of(pending_request)
        if route is None or route.decision is None or route.purpose == "replica":
            return
        if route.decision.replica_id != replica_id.unique_id:
            return
        self._router.routed(route.key, route.decision)
        if route.purpose == "end_job" and route.key is not None:
            self._router.forget(route.key)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        in_flight = self._in_flight[replica_id.unique_id]
        if internal_request_id in in_flight:
            in_flight.discard(internal_request_id)
            return
        self._completed_early[internal_request_id] = None  # or refused: never routed
        while len(self._completed_early) > MAX_EARLY_COMPLETIONS:
            self._completed_early.popitem(last=False)

    def _decide(self, route: Route, replicas: dict[str, RunningReplica]) -> RoutingDecision:
        usable = {replica_id: replica for replica_id, replica in replicas.items()
                  if replica_id != route.avoid_replica_id} or replicas
        if route.replica_id in usable:
            kind = "affinity" if route.purpose == "generate" else "lookup"
            return RoutingDecision(route.replica_id, kind)
        if route.purpose == "replica":
            replica_ids = sorted(usable)
            return RoutingDecision(replica_ids[(route.replica_index or 0) % len(replica_ids)],
                                   "lookup")
        loads = {replica_id: self._load(replica) for replica_id, replica in usable.items()}
        return self._router.choose(route.key, loads, lookup=route.purpose != "generate")

    def _load(self, replica: RunningReplica) -> int:
        # Requests this router has in flight there; Ray's queue-length cache (which forgets a
        # replica not probed for a while) covers requests routed elsewhere.
        cached = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(len(self._in_flight[replica.replica_id.unique_id]), cached)


def _route_of(pending_request: PendingRequest | None) -> Route | None:
    if pending_request is None:
        return None
    route = pending_request.kwargs.get(ROUTE_ARGUMENT)
    return route if isinstance(route, Route) else None
