"""schemathesis against ``kvcdn serve``'s own ``/openapi.json``: no request it can build gets a 5xx.

Requests carry a valid org API key and the admin secret, so they get past authentication into the
routes' own validation. Bounded: 20 examples per operation, on a server of its own.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support import services
from tests.support.budget import budget
from tests.support.hosted import mint_key


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory, hosted_model):
    with services.kvcdn_server(tmp_path_factory.mktemp("schemathesis"), ["--models", str(hosted_model)]) as server:
        yield server


@pytest.fixture(scope="module")
def credentials(fuzzed_server):
    admin = fuzzed_server.admin_secret()
    return {"Authorization": f"Bearer {mint_key(fuzzed_server.url, admin, 'fuzz')}", "X-Kvcdn-Admin-Secret": admin}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_server_error(fuzzed_server, credentials, mode):
    # schemathesis' own pytest loader (from_fixture) does not run under this pytest; drive
    # hypothesis with each operation's strategy instead.
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    errors, exercised = [], 0
    for operation in operations:

        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(mode))
        def call(case):
            response = case.call(base_url=fuzzed_server.url, headers=credentials, timeout=budget(60))
            if response.status_code >= 500:
                errors.append(f"{case.as_curl_command()} -> {response.status_code} {response.text[:200]}")

        try:
            call()
            exercised += 1
        except Unsatisfiable:  # an operation without parameters has no invalid variant
            assert mode is GenerationMode.NEGATIVE
    assert not errors, "\n".join(errors[:10])
    assert exercised == len(operations) if mode is GenerationMode.POSITIVE else exercised >= len(operations) // 2
