"""Schemathesis against the server's own OpenAPI spec, bounded: every generated request gets a non-5xx answer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")

from tests.server.conftest import ServerProcess  # noqa: E402

MAX_EXAMPLES = 8  # per operation (~15 operations): bounded, so the run takes well under a minute


def _check_operation(operation, base_url: str) -> None:
    @given(case=operation.as_strategy())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def run(case) -> None:
        if isinstance(case.body, dict) and case.body.get("abort_all"):
            case.body["abort_all"] = False  # would abort other tests' requests on the shared server
        response = case.call(base_url=base_url, timeout=60)
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r}: {response.text}"
        )

    run()


def test_no_server_errors(server_dp1: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{server_dp1.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/loads"} <= {
        op.path for op in operations
    }
    for operation in operations:
        _check_operation(operation, server_dp1.url)
