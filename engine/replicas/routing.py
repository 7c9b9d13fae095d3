"""Which engine replica serves a request: the routing logic shared by the Ray Serve request
router (`engine.replicas.ray_router`) and the multi-replica simulator (`bench sim --replicas`).

Torch-free and clock-free. A router sees a request's routing key (its job, or what stands for
one, from `engine.replicas.routing_key`; None for a request with neither) and the live
replicas' loads, and returns a `RoutingDecision`. The caller sends the request there and then
calls `routed` with the decision it acted on, which is when the router's books change: Ray may
call `choose` more than once for one request (it backs off when a replica refuses).

Loads are requests in flight at each replica (queued or running), as the caller last saw them.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.registry import Registry

RouterName = Literal["affinity", "round-robin", "least-loaded"]

RoutingKind = Literal["affinity", "placed", "rerouted", "moved", "spread", "lookup"]
"""Why a request went where it did:

- `affinity`: its job's replica, where the job's earlier turns ran;
- `placed`: a job seen for the first time, on its rendezvous-hash replica;
- `rerouted`: its job's replica is gone (died or removed); placed again over live replicas;
- `moved`: its job's replica was over the load bound; sent to the least-loaded replica, which
  becomes the job's replica;
- `spread`: no job (or a router that keeps none): load balancing alone;
- `lookup`: a job operation (`GET`/`DELETE /v1/jobs/{id}`) sent to the job's replica.
"""

DEFAULT_LOAD_FACTOR = 1.5
DEFAULT_MIN_MOVE_LOAD = 8
DEFAULT_MAX_JOBS = 100_000


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Send the request to `replica_id`, for the reason `kind`."""

    replica_id: str
    kind: RoutingKind


RoutePurpose = Literal["generate", "lookup", "end_job", "replica"]


@dataclass(frozen=True, slots=True)
class Route:
    """How the ingress asks for a request to be routed.

    `purpose`: `generate` (a turn: its job's replica, placed or moved as needed), `lookup` (a
    job operation: the job's replica, nothing placed), `end_job` (`DELETE /v1/jobs`: as lookup,
    then the job is forgotten), `replica` (the `replica_index`-th live replica by id, modulo
    their number: asking every replica in turn). `replica_id`: the replica the request belongs
    on while it is live, whatever the router would choose (the one storing a Responses API
    conversation). `avoid_replica_id`: a replica not to use while another is live (one that
    failed the request). `decision` is filled in by the router."""

    key: str | None
    purpose: RoutePurpose = "generate"
    replica_index: int | None = None
    replica_id: str | None = None
    avoid_replica_id: str | None = None
    decision: RoutingDecision | None = None


class ReplicaRouter(Protocol):
    """Chooses a replica per request. Owned by one caller (one Ray request router, or one
    simulated cluster), which calls `choose` as a request is routed, `routed` once it was sent
    (with the decision acted on), and `forget` when a job ends."""

    def choose(self, key: str | None, loads: Mapping[str, int], *,
               lookup: bool = False) -> RoutingDecision:
        """The replica for a request with routing key `key`, among `loads` (live replica id ->
        requests in flight there; not empty). `lookup`: a job operation, which goes to the
        job's replica and neither places nor moves it. Changes nothing."""
        ...

    def routed(self, key: str | None, decision: RoutingDecision) -> None:
        """The request with `key` was sent as `decision` says."""
        ...

    def forget(self, key: str) -> None:
        """The job `key` ended: its replica is no longer remembered."""
        ...

    @property
    def counts(self) -> Mapping[RoutingKind, int]:
        """Requests routed (`routed` calls) per kind."""
        ...


def rendezvous_rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """`replica_ids` ordered by their highest-random-weight score for `key`, best first.

    Removing a replica moves only the keys whose best it was; adding one takes about 1/N of
    the keys. Stable across processes (a cryptographic hash, not Python's salted `hash`)."""
    def score(replica_id: str) -> bytes:
        # A key may hold a lone surrogate from a JSON escape (a job id of "\ud800").
        text = f"{key}\x00{replica_id}".encode("utf-8", "surrogatepass")
        return hashlib.blake2b(text, digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


class _Counts:
    def __init__(self) -> None:
        self._counts: Counter[RoutingKind] = Counter()

    def add(self, kind: RoutingKind) -> None:
        self._counts[kind] += 1

    @property
    def counts(self) -> Mapping[RoutingKind, int]:
        return dict(self._counts)


class JobAffinityRouter(_Counts):
    """A job's turns go to one replica: the rendezvous-hash replica of its key among the live
    replicas when the job is first seen, and the same replica afterwards, so that its KV (pin,
    prefix cache, host tier) is where its next turn runs.

    **Load bound.** When the job's replica has more than `max(min_move_load, load_factor x the
    mean load)` requests in flight, the request goes to the least-loaded replica instead, which
    becomes the job's replica (a move: the job's cached prefix stays behind). A job whose
    replica left the live set is placed again (rerouted). Requests without a key go to the
    less loaded of two random replicas (power of two choices, `rng`).

    **Bounds.** At most `max_jobs` jobs are remembered, least recently routed dropped first; a
    dropped job is placed again by its hash, which is where it was unless it had moved.
    """

    def __init__(self, *, load_factor: float = DEFAULT_LOAD_FACTOR,
                 min_move_load: int = DEFAULT_MIN_MOVE_LOAD, max_jobs: int = DEFAULT_MAX_JOBS,
                 rng: random.Random | None = None) -> None:
        super().__init__()
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor!r}")
        if min_move_load < 0:
            raise ValueError(f"min_move_load must be >= 0, got {min_move_load!r}")
        if max_jobs <= 0:
            raise ValueError(f"max_jobs must be positive, got {max_jobs!r}")
        self.load_factor = load_factor
        self.min_move_load = min_move_load
        self.max_jobs = max_jobs
        self._rng = rng if rng is not None else random.Random(0)
        self._replica_of_job: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        """Jobs remembered."""
        return len(self._replica_of_job)

    def replica_of(self, key: str) -> str | None:
        """The replica job `key` was last routed to, if remembered."""
        return self._replica_of_job.get(key)

    def choose(self, key: str | None, loads: Mapping[str, int], *,
               lookup: bool = False) -> RoutingDecision:
        _check_loads(loads)
        if key is None:
            return RoutingDecision(_power_of_two(loads, self._rng), "spread")
        ranked = rendezvous_rank(key, list(loads))
        remembered = self._replica_of_job.get(key)
        if remembered in loads:
            home, kind = remembered, "affinity"
        else:
            home, kind = ranked[0], "placed" if remembered is None else "rerouted"
        if lookup:
            return RoutingDecision(home, "lookup")
        if loads[home] > self._load_bound(loads):
            coolest = min(ranked, key=lambda r: loads[r])
            if coolest != home:
                return RoutingDecision(coolest, "moved")
        return RoutingDecision(home, kind)

    def routed(self, key: str | None, decision: RoutingDecision) -> None:
        self.add(decision.kind)
        if key is None or decision.kind == "lookup":
            return
        self._replica_of_job[key] = decision.replica_id
        self._replica_of_job.move_to_end(key)
        while len(self._replica_of_job) > self.max_jobs:
            self._replica_of_job.popitem(last=False)

    def forget(self, key: str) -> None:
        self._replica_of_job.pop(key, None)

    def _load_bound(self, loads: Mapping[str, int]) -> float:
        mean_load = sum(loads.values()) / len(loads)
        return max(float(self.min_move_load), self.load_factor * mean_load)


class RoundRobinRouter(_Counts):
    """Each request to the next replica in turn (by replica id), ignoring jobs and loads: the
    baseline that scatters a job's turns."""

    def __init__(self) -> None:
        super().__init__()
        self._next = itertools.count()

    def choose(self, key: str | None, loads: Mapping[str, int], *,
               lookup: bool = False) -> RoutingDecision:
        _check_loads(loads)
        if lookup and key is not None:
            return _hash_lookup(key, loads)
        replica_ids = sorted(loads)
        return RoutingDecision(replica_ids[next(self._next) % len(replica_ids)], "spread")

    def routed(self, key: str | None, decision: RoutingDecision) -> None:
        self.add(decision.kind)

    def forget(self, key: str) -> None:
        pass


class LeastLoadedRouter(_Counts):
    """Each request to the replica with the fewest requests in flight (ties: the lowest id),
    ignoring jobs: the load-balancing baseline."""

    def choose(self, key: str | None, loads: Mapping[str, int], *,
               lookup: bool = False) -> RoutingDecision:
        _check_loads(loads)
        if lookup and key is not None:
            return _hash_lookup(key, loads)
        return RoutingDecision(min(sorted(loads), key=lambda r: loads[r]), "spread")

    def routed(self, key: str | None, decision: RoutingDecision) -> None:
        self.add(decision.kind)

    def forget(self, key: str) -> None:
        pass


@dataclass(frozen=True)
class RouterSettings:
    """What every router may be built with: `seed` for its random choices; `load_factor` and
    `min_move_load` are the affinity router's load bound."""

    seed: int = 0
    load_factor: float = DEFAULT_LOAD_FACTOR
    min_move_load: int = DEFAULT_MIN_MOVE_LOAD


def _affinity(settings: RouterSettings) -> ReplicaRouter:
    return JobAffinityRouter(load_factor=settings.load_factor,
                             min_move_load=settings.min_move_load,
                             rng=random.Random(settings.seed))


def _round_robin(settings: RouterSettings) -> ReplicaRouter:
    return RoundRobinRouter()


def _least_loaded(settings: RouterSettings) -> ReplicaRouter:
    return LeastLoadedRouter()


ROUTERS: Registry[Callable[[RouterSettings], ReplicaRouter]] = Registry("router", {
    "affinity": _affinity,
    "round-robin": _round_robin,
    "least-loaded": _least_loaded,
})
ROUTER_NAMES: tuple[str, ...] = ROUTERS.names


def make_router(name: RouterName, *, seed: int = 0, load_factor: float = DEFAULT_LOAD_FACTOR,
                min_move_load: int = DEFAULT_MIN_MOVE_LOAD) -> ReplicaRouter:
    """The router called `name`; ValueError for an unknown one. `load_factor` and
    `min_move_load` are the affinity router's load bound."""
    return ROUTERS.load(name)(RouterSettings(seed, load_factor, min_move_load))


def _hash_lookup(key: str, loads: Mapping[str, int]) -> RoutingDecision:
    """A job operation under a router that keeps no jobs: the key's rendezvous-hash replica."""
    return RoutingDecision(rendezvous_rank(key, list(loads))[0], "lookup")


def _power_of_two(loads: Mapping[str, int], rng: random.Random) -> str:
    replica_ids = sorted(loads)
    if len(replica_ids) == 1:
        return replica_ids[0]
    first, second = rng.sample(replica_ids, 2)
    return second if loads[second] < loads[first] else first


def _check_loads(loads: Mapping[str, int]) -> None:
    if not loads:
        raise ValueError("no live replica to route to")
    if any(load < 0 or not math.isfinite(load) for load in loads.values()):
        raise ValueError(f"loads must be finite and >= 0, got {dict(loads)!r}")
