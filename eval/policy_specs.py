"""Policy specs, as `bench sim --policies` and `python -m lab check-calibration --policy` take them:
a policy with its options, `NAME` or `NAME:KEY=VALUE[:KEY=VALUE...]`, optionally ending in
`+tier` (the same policy on an engine with a host KV tier). The spec as written labels a
run's rows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from engine.scheduler.options import option_items_to_dict
from engine.scheduler.policy_registry import POLICIES, check_policy_options
from eval.policy_variants import EVAL_POLICIES

DEFAULT_POLICIES = "fcfs,continuum-fixed,infercept,autellix,continuum"
# The paper's ablation, each rung adding one mechanism; `--policies ladder` runs it.
ABLATION_LADDER = "fcfs,job-fcfs,continuum-fixed,continuum,continuum-oracle"
HOST_TIER_SUFFIX = "tier"
# A `+word` at the end of a spec is a suffix (only `+tier` exists).
_SUFFIX = re.compile(r"\+([A-Za-z_-]*)$")


@dataclass(frozen=True)
class PolicySpec:
    """A policy with its options, as `--policies` names it: `label` is the spec as written,
    `options` the `KEY`, `VALUE` pairs in the order given, `host_tier` whether the engine
    has a host KV tier (the `+tier` suffix)."""

    label: str
    name: str
    options: tuple[tuple[str, str], ...] = ()
    host_tier: bool = False

    @property
    def policy(self) -> str:
        """What the engine's registry builds: the name, or the path of an eval-only policy
        (`EVAL_POLICIES`)."""
        return EVAL_POLICIES.get(self.name, self.name)


def parse_policy_spec(text: str) -> PolicySpec:
    """`NAME` or `NAME:KEY=VALUE[:KEY=VALUE...]`, optionally followed by `+tier`. NAME is a
    registry name, an eval-only policy's (`EVAL_POLICIES`), or else a `module:attribute`
    path (the segments before the first one holding
    `=`). ValueError for an empty name, an option without `=`, a key given twice, or another
    suffix than `+tier`; the options are not checked against the policy."""
    label = text.strip()
    base, host_tier = _split_suffix(label)
    segments = base.split(":")
    if segments[0].strip() in POLICIES or segments[0].strip() in EVAL_POLICIES:
        first_option = 1
    else:
        first_option = next((i for i, part in enumerate(segments) if "=" in part),
                            len(segments))
    name = ":".join(segments[:first_option]).strip()
    if not name:
        raise ValueError(f"policy spec {label!r} names no policy")
    try:
        options = option_items_to_dict(segments[first_option:])
    except ValueError as error:
        raise ValueError(f"policy spec {label!r}: {error}") from None
    return PolicySpec(label, name, tuple(options.items()), host_tier)


def _split_suffix(label: str) -> tuple[str, bool]:
    """The spec without its `+tier` suffix, and whether it had one; ValueError for another
    suffix."""
    suffix = _SUFFIX.search(label)
    if suffix is None:
        return label, False
    if suffix.group(1) != HOST_TIER_SUFFIX:
        raise ValueError(f"policy spec {label!r}: unknown suffix {suffix.group(0)!r}; the "
                         f"only one is '+{HOST_TIER_SUFFIX}' (a host KV tier)")
    base = label[:suffix.start()]
    if _SUFFIX.search(base) is not None:
        raise ValueError(f"policy spec {label!r}: one suffix at most")
    return base, True


def policy_specs(comma_separated: str | None, single: Sequence[str] = ()) -> list[PolicySpec]:
    """The specs of a comma-separated list (`ladder` stands for `ABLATION_LADDER`; None: the
    default list unless `single` names some) followed by the `single` ones, each checked
    against its policy's options. ValueError naming a bad spec, or a label given twice."""
    if comma_separated is None:
        comma_separated = "" if single else DEFAULT_POLICIES
    if comma_separated.strip() == "ladder":
        comma_separated = ABLATION_LADDER
    texts = [item for item in comma_separated.split(",") if item.strip()] + list(single)
    if not texts:
        raise ValueError("--policies names no policy")
    specs = [parse_policy_spec(text) for text in texts]
    labels = [spec.label for spec in specs]
    for spec in specs:
        if labels.count(spec.label) > 1:
            raise ValueError(f"policy spec {spec.label!r} is given twice")
        try:
            check_policy_options(spec.policy, dict(spec.options))
        except ValueError as error:
            raise ValueError(f"policy spec {spec.label!r}: {error}") from None
    return specs
