"""A client's cache breakpoint travels with a request's sampling parameters, over the core's
wire format, to the scheduler's `Request`."""

from __future__ import annotations

import math

import msgspec
import pytest

from engine.core.engine_core import EngineCore
from engine.core.wire import CoreInput, EngineCoreRequest
from engine.sampling_params import CacheBreakpoint, SamplingParams
from tests.engine.core.conftest import SMALL_CONFIG, core_request

PROMPT = list(range(1, 41))


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(SMALL_CONFIG)


def _over_the_wire(request: EngineCoreRequest) -> EngineCoreRequest:
    """`request` as the core process receives it from the frontend."""
    received = msgspec.msgpack.Decoder(CoreInput).decode(msgspec.msgpack.encode(request))
    assert isinstance(received, EngineCoreRequest)
    return received


def test_the_breakpoint_reaches_the_schedulers_request(core) -> None:
    breakpoint_ = CacheBreakpoint(num_prompt_tokens=32, ttl_s=300.0)
    core.add_request(_over_the_wire(core_request("pinned", PROMPT, max_tokens=4,
                                                 cache_breakpoint=breakpoint_)))
    core.add_request(_over_the_wire(core_request("plain", PROMPT[:10], max_tokens=4)))
    core.step()
    by_id = {request.request_id: request for request in core.scheduler.running}
    assert by_id["pinned"].cache_breakpoint == breakpoint_
    assert by_id["plain"].cache_breakpoint is None
    while core.has_work():
        core.step()


def test_a_breakpoint_past_the_prompt_is_refused(core) -> None:
    past = CacheBreakpoint(num_prompt_tokens=len(PROMPT) + 1, ttl_s=300.0)
    with pytest.raises(ValueError, match="past the prompt's 40 tokens"):
        core.add_request(_over_the_wire(core_request("past", PROMPT, cache_breakpoint=past)))
    assert not core.has_work()


@pytest.mark.parametrize(("fields", "match"), [
    ({"num_prompt_tokens": 0, "ttl_s": 300.0}, "num_prompt_tokens"),
    ({"num_prompt_tokens": 16, "ttl_s": 0.0}, "ttl_s"),
    ({"num_prompt_tokens": 16, "ttl_s": math.inf}, "ttl_s"),
    ({"num_prompt_tokens": 16, "ttl_s": True}, "ttl_s"),
])
def test_a_malformed_breakpoint_is_refused(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        CacheBreakpoint(**fields)


def test_sampling_params_take_only_a_breakpoint() -> None:
    with pytest.raises(ValueError, match="must be a CacheBreakpoint"):
        SamplingParams(cache_breakpoint=(16, 300.0))  # type: ignore[arg-type]
    params = SamplingParams(cache_breakpoint=CacheBreakpoint(num_prompt_tokens=16, ttl_s=1.5))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    assert "cache_breakpoint" not in msgspec.to_builtins(SamplingParams())  # omitted by default
