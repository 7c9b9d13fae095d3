import msgspec
import pytest

from engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams


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
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"logit_bias": ((1, 100.5),)}, "logit_bias value"),
        ({"logit_bias": ((1, float("nan")),)}, "logit_bias value"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token id"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "more than once"),
        ({"logit_bias": ((1, 1.0, 2.0),)}, "pairs"),
        ({"logit_bias": tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS_ENTRIES + 1))},
         "over the limit"),
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


def test_prompt_logprobs_and_logit_bias_round_trip_through_msgpack() -> None:
    biases = tuple((i, (-1.0) ** i * i / 3) for i in range(MAX_LOGIT_BIAS_ENTRIES))
    params = SamplingParams(prompt_logprobs=0, logit_bias=biases)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params and decoded.prompt_logprobs == 0
    assert isinstance(decoded.logit_bias, tuple) and decoded.logit_bias[2] == (2, 2 / 3)
    bad = msgspec.msgpack.encode({"logit_bias": [[3, 500.0]]})
    with pytest.raises(msgspec.ValidationError, match="logit_bias"):
        msgspec.msgpack.decode(bad, type=SamplingParams)
