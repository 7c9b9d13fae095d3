"""`continuum` with its rebuilds priced by a file instead of prefills timed at start-up, so
that tests (over HTTP too: `--scheduling-policy tests.continuum.priced:PRICED_CONTINUUM`)
get Eq. 2's TTLs exactly. Its one option beyond `continuum`'s: `prefill_profile`, a JSON file
of [num_tokens, seconds] points."""

from __future__ import annotations

from dataclasses import dataclass, field

from continuum.agent_policy import Strategies
from continuum.policy_options import ContinuumOptions
from continuum.presets import PolicyPreset, compose_continuum
from estimator.cost_model import PrefillCostModel, read_prefill_profile

PRICED_CONTINUUM_PATH = "tests.continuum.priced:PRICED_CONTINUUM"


@dataclass(frozen=True)
class PricedOptions(ContinuumOptions):
    prefill_profile: str = field(default="", metadata={"help": "the prefill profile file"})


def compose_priced(options: PricedOptions) -> Strategies:
    if not options.prefill_profile:
        raise ValueError("prefill_profile names no file")
    prefill_cost = PrefillCostModel.fit(read_prefill_profile(options.prefill_profile))
    return compose_continuum(options, prefill_cost=prefill_cost)


PRICED_CONTINUUM = PolicyPreset("continuum", PricedOptions, compose_priced)
