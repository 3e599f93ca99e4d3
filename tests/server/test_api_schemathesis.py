"""Property-based API tests from the OpenAPI document (schemathesis) against the live server.

Every operation gets generated requests, valid and invalid; none may answer 5xx, and every error
must be in OpenAI's shape. The last test checks that at least 500 cases ran.

The document is built at import (schemathesis' lazy fixture loader does not work with pytest 9),
from an app with the live server's settings; a test checks that the server serves the same one.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from flashtier.server.app import create_app
from flashtier.server.http.anthropic_errors import is_messages_path
from flashtier.server.config.settings import build_settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = 90  # per operation (14 now, 7 with bodies): still over the 500 cases asserted below
CASES: dict[str, int] = {}


SPEC = create_app(build_settings(None, {}), lambda s: None).openapi()  # type: ignore[arg-type,return-value]
schema = schemathesis.openapi.from_dict(SPEC)


def test_served_spec_is_the_tested_spec(live_server):
    import httpx

    assert httpx.get(live_server.url + "/openapi.json").json() == json.loads(json.dumps(SPEC))


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    CASES[case.operation.label] = CASES.get(case.operation.label, 0) + 1
    response = case.call(base_url=server.url, timeout=30)
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                              content_type_conformance, response_schema_conformance])
    if response.status_code >= 400:
        body = json.loads(response.content)
        if is_messages_path(case.path):  # Anthropic's shape on the Messages API
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert "Traceback" not in response.text


def test_enough_cases_ran():
    if not CASES:
        pytest.skip("the schemathesis tests were deselected")
    print("schemathesis cases:", CASES)
    assert sum(CASES.values()) >= 500, CASES
