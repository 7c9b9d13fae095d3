"""Property-based fuzz of every endpoint with schemathesis, against a live server on the tiny
model: the responses match the OpenAPI document (statuses, content types, headers, bodies),
schema-invalid requests are rejected, nothing answers 5xx, and every error is an OpenAI error
body. `FUZZ_MAX_EXAMPLES` sets the examples per operation (the full run in
`docs/benchmarks.md` uses 300).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from engine.entrypoints.openai.serving import ServerSettings
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "25"))
ERROR_TYPES = {"invalid_request_error", "rate_limit_error", "server_error"}


@pytest.fixture(scope="module")
def fuzzed_server() -> Iterator[ServerThread]:
    """Short contexts and outputs, so that fuzzed generations stay cheap."""
    running = start_server(
        max_model_len=256, num_kv_blocks=64,
        settings=ServerSettings(served_model_name="tiny", max_output_tokens=32,
                                max_request_body_bytes=64 * 1024),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: ServerThread) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(fuzzed_server.base_url + "/openapi.json")


OPERATIONS = ["health", "version", "listModels", "retrieveModel", "metrics",
              "createCompletion", "createChatCompletion", "createResponse", "retrieveResponse",
              "deleteResponse", "listInputItems", "cancelResponse", "retrieveJob", "deleteJob"]


def test_the_schema_names_every_operation(api_schema: schemathesis.BaseSchema) -> None:
    documented = [result.ok().definition.raw["operationId"]
                  for result in api_schema.get_all_operations()]
    assert sorted(documented) == sorted(OPERATIONS)


@schemathesis.check
def openai_error_format(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                        case: schemathesis.Case) -> bool | None:
    """Every 4xx and 5xx body is `{"error": {"message", "type", "param", "code"}}`."""
    if response.status_code < 400:
        return None
    body = response.json()
    error = body["error"]
    assert set(body) == {"error"} and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] in ERROR_TYPES, body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body
    return True


# Only the generation endpoints take input that a schema can make invalid.
CASES = [*((operation, GenerationMode.POSITIVE) for operation in OPERATIONS),
         ("createCompletion", GenerationMode.NEGATIVE),
         ("createChatCompletion", GenerationMode.NEGATIVE),
         ("createResponse", GenerationMode.NEGATIVE)]


@pytest.mark.parametrize(("operation_id", "mode"), CASES,
                         ids=[f"{operation}-{mode.value}" for operation, mode in CASES])
def test_every_endpoint_answers_by_its_schema(
    api_schema: schemathesis.BaseSchema, operation_id: str, mode: GenerationMode
) -> None:
    operation = api_schema.find_operation_by_id(operation_id)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: schemathesis.Case) -> None:
        # Schema-valid requests may still break a rule across fields (prompt + max_tokens
        # within the context, min_tokens <= max_tokens, best_of == n, tool_choice needs
        # tools): those get a 400.
        case.call_and_validate(timeout=60, additional_checks=[openai_error_format],
                               excluded_checks=[positive_data_acceptance])

    fuzz()


def test_the_engine_is_unharmed_after_the_fuzz(fuzzed_server: ServerThread) -> None:
    stats = fuzzed_server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks
    completion = fuzzed_server.client().completions.create(
        model="tiny", prompt="still here", max_tokens=4, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4


def test_the_schema_states_the_limits_and_the_job_extension(fuzzed_server: ServerThread
                                                            ) -> None:
    with fuzzed_server.http() as http:
        document = http.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["n"]["anyOf"] == [{"type": "integer", "minimum": 1, "maximum": 16},
                                        {"type": "null"}]  # null: the default
    # 0 is allowed with echo (the prompt alone).
    assert {"type": "integer", "minimum": 0, "maximum": 32} in completion["max_tokens"]["anyOf"]
    token_prompt = [variant for variant in completion["prompt"]["anyOf"]
                    if variant.get("items", {}).get("type") == "integer"]
    assert token_prompt[0]["items"]["maximum"] == 271  # the tiny vocabulary
    for name in ("job_id", "is_last_step", "tool_name", "this_func_call"):
        assert name in completion and name in schemas["ChatCompletionRequest"]["properties"]
    operation = document["paths"]["/v1/chat/completions"]["post"]
    assert set(operation["responses"]) == {"200", "400", "404", "413", "429", "503"}
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert "HTTPValidationError" not in schemas


def test_a_wrong_method_answers_405_listing_every_allowed_one(fuzzed_server: ServerThread
                                                              ) -> None:
    with fuzzed_server.http() as http:
        response = http.put("/v1/jobs/some-job")
    assert response.status_code == 405
    assert response.headers["Allow"] == "DELETE, GET"
    assert response.json()["error"]["message"] == (
        "Method not allowed (PUT /v1/jobs/some-job); allowed: DELETE, GET")
