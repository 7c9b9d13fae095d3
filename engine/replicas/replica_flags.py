"""The replica settings of `continuum serve` (`--replicas N` and how requests are routed),
read from the parsed flags by `engine.replicas.launch` and `engine.replicas.ray_app`."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import setting
from engine.replicas.routing import DEFAULT_LOAD_FACTOR, DEFAULT_MIN_MOVE_LOAD, RouterName


@dataclass(frozen=True)
class ReplicaFlags:
    """The declaration of the replica flags (`engine.engine_args.flags`); the application
    they make is `engine.replicas.ray_app.ReplicaAppSettings`, which checks them."""

    replicas: int | None = field(default=None, metadata=setting(
        "N replicas on Ray Serve (default: one engine)", group="replicas"))
    router: RouterName = field(default="affinity", metadata=setting(
        "affinity: a job's turns to one replica", group="replicas"))
    address: str | None = field(default=None, metadata=setting(
        "Ray cluster, e.g. auto (default: a local one)", group="replicas"))
    replica_cpus: float = field(default=1.0, metadata=setting(
        "CPUs each replica reserves", group="replicas"))
    replica_gpus: float | None = field(default=None, metadata=setting(
        "GPUs per replica (default: 1 on cuda, else 0)", group="replicas"))
    route_load_factor: float = field(default=DEFAULT_LOAD_FACTOR, metadata=setting(
        "affinity: a job leaves a replica over this times the mean load", group="replicas",
        metavar="X"))
    route_min_move_load: int = field(default=DEFAULT_MIN_MOVE_LOAD, metadata=setting(
        "affinity: ... and over this many requests", group="replicas"))
