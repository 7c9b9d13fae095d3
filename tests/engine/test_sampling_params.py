import msgspec
import pytest

from engine.sampling_params import SamplingParams


def test_defaults_and_greedy() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16 and params.n == 1 and not params.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop strings"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_invalid_parameters_raise_value_error(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_round_trips_through_msgpack_and_validates_on_decode() -> None:
    params = SamplingParams(temperature=0.5, stop=("END",), stop_token_ids=(2,), seed=7)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    bad = msgspec.msgpack.encode({"temperature": 9.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


def test_is_immutable() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.max_tokens = 3  # type: ignore[misc]
