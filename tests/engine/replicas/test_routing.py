"""The replica routers: rendezvous placement, job affinity under a load bound, the
load-balancing baselines, and their refusals of bad input."""

from __future__ import annotations

import math
import random

import pytest

from engine.replicas.routing import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_MIN_MOVE_LOAD,
    ROUTER_NAMES,
    JobAffinityRouter,
    LeastLoadedRouter,
    RoundRobinRouter,
    RoutingDecision,
    make_router,
    rendezvous_rank,
)

REPLICAS = ["r0", "r1", "r2", "r3", "r4"]
KEYS = [f"job-{i}" for i in range(2000)]


def idle(replica_ids: list[str] = REPLICAS) -> dict[str, int]:
    return dict.fromkeys(replica_ids, 0)


def route(router: JobAffinityRouter, key: str | None, loads: dict[str, int]) -> RoutingDecision:
    decision = router.choose(key, loads)
    router.routed(key, decision)
    return decision


def test_rendezvous_rank_is_a_stable_order_of_the_replicas() -> None:
    ranked = rendezvous_rank("job-7", REPLICAS)
    assert sorted(ranked) == REPLICAS
    assert rendezvous_rank("job-7", list(reversed(REPLICAS))) == ranked
    # Keys spread over every replica, none taking much more than its share.
    best = [rendezvous_rank(key, REPLICAS)[0] for key in KEYS]
    assert all(0.7 < best.count(r) / (len(KEYS) / len(REPLICAS)) < 1.3 for r in REPLICAS)


def test_a_replica_leaving_moves_only_its_own_keys_and_joining_takes_a_share() -> None:
    before = {key: rendezvous_rank(key, REPLICAS)[0] for key in KEYS}
    without_r2 = [r for r in REPLICAS if r != "r2"]
    after = {key: rendezvous_rank(key, without_r2)[0] for key in KEYS}
    moved = {key for key in KEYS if after[key] != before[key]}
    assert moved == {key for key in KEYS if before[key] == "r2"}
    # A moved key goes to its second choice.
    assert all(after[key] == rendezvous_rank(key, REPLICAS)[1] for key in moved)
    joined = {key: rendezvous_rank(key, [*REPLICAS, "r5"])[0] for key in KEYS}
    taken = [key for key in KEYS if joined[key] != before[key]]
    assert all(joined[key] == "r5" for key in taken)
    assert 0.5 < len(taken) / (len(KEYS) / 6) < 1.5


def test_a_jobs_turns_stick_to_the_replica_it_was_placed_on() -> None:
    router = JobAffinityRouter()
    first = route(router, "job-1", idle())
    assert first == RoutingDecision(rendezvous_rank("job-1", REPLICAS)[0], "placed")
    # Loads change, within the bound: the job stays where its KV is.
    loads = {r: 3 for r in REPLICAS} | {first.replica_id: 7}
    for _ in range(3):
        assert route(router, "job-1", loads) == RoutingDecision(first.replica_id, "affinity")
    assert router.replica_of("job-1") == first.replica_id and len(router) == 1
    assert router.counts == {"placed": 1, "affinity": 3}


def test_an_overloaded_home_moves_the_job_to_the_least_loaded_replica() -> None:
    router = JobAffinityRouter()
    home = route(router, "job-1", idle()).replica_id
    # Mean 4.8, bound max(8, 1.5 x 4.8) = 8: a home at 8 keeps the job ...
    at_bound = {r: 4 for r in REPLICAS} | {home: 8}
    assert router.choose("job-1", at_bound) == RoutingDecision(home, "affinity")
    # ... at 12 (mean 5.6, bound 8.4) it moves to the coolest replica, which becomes its home.
    coolest = next(r for r in REPLICAS if r != home)
    over = {r: 4 for r in REPLICAS} | {home: 12, coolest: 2}
    moved = route(router, "job-1", over)
    assert moved == RoutingDecision(coolest, "moved")
    assert router.replica_of("job-1") == coolest
    assert route(router, "job-1", idle()) == RoutingDecision(coolest, "affinity")
    assert router.counts == {"placed": 1, "moved": 1, "affinity": 1}


def test_the_load_bound_scales_with_the_mean_load() -> None:
    router = JobAffinityRouter(load_factor=1.5, min_move_load=0)
    home = route(router, "job-1", idle()).replica_id
    busy = {r: 20 + i for i, r in enumerate(REPLICAS)} | {home: 31}  # bound >= 33
    assert router.choose("job-1", busy).kind == "affinity"
    busier = busy | {home: 45}  # mean at most 27.4, bound at most 41.1
    coolest = min(REPLICAS, key=lambda r: busier[r])
    assert router.choose("job-1", busier) == RoutingDecision(coolest, "moved")
    # A new job whose own replica is over the bound starts on the least-loaded one.
    key = next(k for k in KEYS if rendezvous_rank(k, REPLICAS)[0] == home)
    assert router.choose(key, busier) == RoutingDecision(coolest, "moved")


def test_a_job_whose_replica_is_gone_is_placed_again_among_the_live_ones() -> None:
    router = JobAffinityRouter()
    home = route(router, "job-1", idle()).replica_id
    live = [r for r in REPLICAS if r != home]
    decision = route(router, "job-1", idle(live))
    assert decision == RoutingDecision(rendezvous_rank("job-1", live)[0], "rerouted")
    assert router.replica_of("job-1") == decision.replica_id
    assert route(router, "job-1", idle()).kind == "affinity"


def test_requests_without_a_key_go_to_the_less_loaded_of_two_random_replicas() -> None:
    router = JobAffinityRouter(rng=random.Random(3))
    loads = {"r0": 9, "r1": 2, "r2": 5}
    chosen = [route(router, None, loads) for _ in range(300)]
    assert {d.kind for d in chosen} == {"spread"}
    # Two draws out of three never both miss the two cooler replicas.
    assert {d.replica_id for d in chosen} == {"r1", "r2"}
    assert router.choose(None, {"r0": 9, "r1": 2}) == RoutingDecision("r1", "spread")
    assert router.choose(None, {"solo": 4}) == RoutingDecision("solo", "spread")
    assert len(router) == 0 and router.counts == {"spread": 300}


def test_a_lookup_goes_to_the_jobs_replica_and_never_places_or_moves() -> None:
    router = JobAffinityRouter()
    unseen = router.choose("job-9", idle(), lookup=True)
    assert unseen == RoutingDecision(rendezvous_rank("job-9", REPLICAS)[0], "lookup")
    router.routed("job-9", unseen)
    assert router.replica_of("job-9") is None and len(router) == 0
    home = route(router, "job-1", idle()).replica_id
    overloaded = idle() | {home: 100}
    assert router.choose("job-1", overloaded, lookup=True) == RoutingDecision(home, "lookup")
    assert router.counts == {"lookup": 1, "placed": 1}


def test_a_forgotten_job_is_placed_again() -> None:
    router = JobAffinityRouter()
    route(router, "job-1", idle())
    router.forget("job-1")
    router.forget("never-seen")
    assert router.replica_of("job-1") is None
    assert route(router, "job-1", idle()).kind == "placed"


def test_at_most_max_jobs_are_remembered_least_recently_routed_first_dropped() -> None:
    router = JobAffinityRouter(max_jobs=2)
    for key in ("a", "b"):
        route(router, key, idle())
    route(router, "a", idle())  # "b" is now the least recently routed
    route(router, "c", idle())
    assert len(router) == 2
    assert router.replica_of("b") is None and router.replica_of("a") is not None
    assert route(router, "b", idle()).kind == "placed"


@pytest.mark.parametrize("loads", [{}, {"r0": -1}, {"r0": 1, "r1": math.nan},
                                   {"r0": math.inf}])
@pytest.mark.parametrize("name", ROUTER_NAMES)
def test_bad_loads_are_refused(name: str, loads: dict[str, float]) -> None:
    router = make_router(name)
    with pytest.raises(ValueError, match=r"no live replica|finite and >= 0"):
        router.choose("job-1", loads)
    assert router.counts == {}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"load_factor": 0.5}, "load_factor"), ({"load_factor": math.nan}, "load_factor"),
    ({"min_move_load": -1}, "min_move_load"), ({"max_jobs": 0}, "max_jobs"),
])
def test_bad_affinity_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobAffinityRouter(**kwargs)


def test_round_robin_cycles_over_the_replicas_in_id_order_whatever_the_key() -> None:
    router = RoundRobinRouter()
    loads = {"r2": 0, "r0": 50, "r1": 3}
    chosen = []
    for key in ["job-1", "job-1", None, "job-2", "job-1", "job-1"]:
        decision = router.choose(key, loads)
        router.routed(key, decision)
        chosen.append(decision)
    assert [d.replica_id for d in chosen] == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert {d.kind for d in chosen} == {"spread"}
    assert router.choose("job-1", loads, lookup=True) == RoutingDecision(
        rendezvous_rank("job-1", sorted(loads))[0], "lookup")
    assert router.counts == {"spread": 6}


def test_least_loaded_picks_the_minimum_and_breaks_ties_by_id() -> None:
    router = LeastLoadedRouter()
    assert router.choose("job-1", {"r2": 1, "r0": 4, "r1": 3}) == RoutingDecision("r2", "spread")
    assert router.choose(None, {"r2": 1, "r1": 1, "r0": 4}) == RoutingDecision("r1", "spread")
    decision = router.choose("job-1", {"r0": 0, "r1": 5}, lookup=True)
    assert decision.kind == "lookup"
    router.routed("job-1", decision)
    assert router.counts == {"lookup": 1}


def test_make_router_builds_each_named_router_with_its_bound() -> None:
    affinity = make_router("affinity", seed=4, load_factor=2.0, min_move_load=3)
    assert isinstance(affinity, JobAffinityRouter)
    assert (affinity.load_factor, affinity.min_move_load) == (2.0, 3)
    default = make_router("affinity")
    assert isinstance(default, JobAffinityRouter)
    assert (default.load_factor, default.min_move_load) == (DEFAULT_LOAD_FACTOR,
                                                            DEFAULT_MIN_MOVE_LOAD)
    assert isinstance(make_router("round-robin"), RoundRobinRouter)
    assert isinstance(make_router("least-loaded"), LeastLoadedRouter)
    with pytest.raises(ValueError, match="unknown router 'random'"):
        make_router("random")  # type: ignore[arg-type]
