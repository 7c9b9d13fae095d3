"""The replica flags of `continuum serve` (`--replicas N` and how requests are routed), read
by `engine.replicas.launch` and `engine.replicas.ray_app`."""

from __future__ import annotations

import argparse

from engine.replicas.routing import DEFAULT_LOAD_FACTOR, DEFAULT_MIN_MOVE_LOAD, ROUTER_NAMES


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas (Ray Serve; needs the 'ray' extra)")
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve N engine replicas on Ray Serve behind one endpoint "
                            "(default: one engine, no Ray)")
    group.add_argument("--router", default="affinity", choices=ROUTER_NAMES,
                       help="how requests pick a replica: a job's turns to one replica "
                            "(affinity), round-robin, or least-loaded (default: %(default)s)")
    group.add_argument("--address", default=None,
                       help="the Ray cluster to join, e.g. 'auto' or 'ray://head:10001' "
                            "(default: start a local Ray)")
    group.add_argument("--replica-cpus", type=float, default=1.0,
                       help="CPUs each replica reserves in Ray (default: %(default)s)")
    group.add_argument("--replica-gpus", type=float, default=None,
                       help="GPUs each replica reserves in Ray (default: 1 with --device "
                            "cuda, else 0)")
    group.add_argument("--route-load-factor", type=float, default=DEFAULT_LOAD_FACTOR,
                       help="affinity: a job moves off its replica when that replica has more "
                            "than this times the mean requests in flight (default: "
                            "%(default)s)")
    group.add_argument("--route-min-move-load", type=int, default=DEFAULT_MIN_MOVE_LOAD,
                       help="affinity: ... and more than this many (default: %(default)s)")
