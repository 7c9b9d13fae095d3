"""Policy specs: a policy with its options, a `module:Class` path, the `+tier` suffix, and
the lists `bench sim --policies` takes."""

from __future__ import annotations

import pytest

from eval.policy_specs import (
    ABLATION_LADDER,
    DEFAULT_POLICIES,
    PolicySpec,
    parse_policy_spec,
    policy_specs,
)
from eval.policy_variants import EVAL_POLICIES


@pytest.mark.parametrize(("text", "expected"), [
    ("fcfs", PolicySpec("fcfs", "fcfs")),
    (" continuum:max_plain_wait_s=5 ",
     PolicySpec("continuum:max_plain_wait_s=5", "continuum", (("max_plain_wait_s", "5"),))),
    ("continuum-af226d3:estimator=fixed-2s",
     PolicySpec("continuum-af226d3:estimator=fixed-2s", "continuum-af226d3",
                (("estimator", "fixed-2s"),))),
    ("continuum:estimator=fixed-2s:max_ttl_s=5",
     PolicySpec("continuum:estimator=fixed-2s:max_ttl_s=5", "continuum",
                (("estimator", "fixed-2s"), ("max_ttl_s", "5")))),
    ("tests.lab.bench.sabotaged_policy:SabotagedPolicy",
     PolicySpec("tests.lab.bench.sabotaged_policy:SabotagedPolicy",
                "tests.lab.bench.sabotaged_policy:SabotagedPolicy")),
    ("fcfs+tier", PolicySpec("fcfs+tier", "fcfs", host_tier=True)),
    ("continuum:estimator=fixed-2s+tier",
     PolicySpec("continuum:estimator=fixed-2s+tier", "continuum", (("estimator", "fixed-2s"),),
                host_tier=True)),
    ("continuum:estimator_state=a+b.json",
     PolicySpec("continuum:estimator_state=a+b.json", "continuum",
                (("estimator_state", "a+b.json"),))),
])
def test_policy_specs_parse(text: str, expected: PolicySpec) -> None:
    assert parse_policy_spec(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    (":estimator=fixed-2s", "names no policy"),
    ("continuum:estimator", "KEY=VALUE"),
    ("continuum:max_ttl_s=1:max_ttl_s=2", "given twice"),
    ("nosuch", "unknown scheduling policy 'nosuch'"),
    ("continuum:bogus=1", "unknown option 'bogus'"),
    ("continuum:estimator=nope", "option estimator .* expected one of"),
    ("fcfs:estimator=fixed-2s", "takes no options"),
    ("fcfs,continuum,fcfs", "'fcfs' is given twice"),
    (" , ", "names no policy"),
    ("fcfs+tiers", "unknown suffix '\\+tiers'; the only one is '\\+tier'"),
    ("continuum:estimator=fixed-2s+gpu", "unknown suffix '\\+gpu'"),
    ("fcfs+tier+tier", "one suffix at most"),
    ("+tier", "names no policy"),
    ("fcfs,fcfs+tier,fcfs+tier", "'fcfs\\+tier' is given twice"),
    ("continuum:bogus=1+tier", "unknown option 'bogus'"),
])
def test_bad_policy_specs_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy_specs(text)


def test_policy_lists() -> None:
    assert [s.label for s in policy_specs(None)] == DEFAULT_POLICIES.split(",")
    assert [s.label for s in policy_specs("ladder")] == ABLATION_LADDER.split(",")
    # A value holding commas goes through --policy, after the comma-separated ones.
    state = "continuum:estimator_state=a,b.json"
    specs = policy_specs("fcfs", [state])
    assert [s.label for s in specs] == ["fcfs", state]
    assert specs[1].options == (("estimator_state", "a,b.json"),)
    assert [s.label for s in policy_specs(None, [state])] == [state]
    # The eval-only policies go by name too, built from their paths.
    [oracle] = policy_specs("continuum-oracle:max_plain_wait_s=5")
    assert (oracle.name, oracle.policy) == ("continuum-oracle", EVAL_POLICIES["continuum-oracle"])
