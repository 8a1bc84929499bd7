"""Fixtures of the hosted tests: a real OIDC issuer, moto's S3 server and ``kvcdn serve`` processes.

Everything listens on 127.0.0.1 and is torn down after the session. CI needs
``npm ci --prefix tests/support/oidc_issuer`` and the test extras of kvcdn-server.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.support import hosted, services  # noqa: E402
from tests.support.hosted import write_synthetic_kv  # noqa: E402

#: httpx's 5 s default is too short for a loaded 2-core CI machine (a first inference loads torch
#: and a model); the tests' own direct calls get this instead unless they pass a timeout.
HTTP_TIMEOUT = 60.0


@pytest.fixture(scope="session", autouse=True)
def _patient_httpx():
    import functools

    import httpx

    with pytest.MonkeyPatch.context() as mp:
        for verb in ("get", "post", "put", "patch", "delete", "head", "request", "stream"):
            original = getattr(httpx, verb)

            @functools.wraps(original)
            def call(*args, _original=original, **kwargs):
                kwargs.setdefault("timeout", HTTP_TIMEOUT)
                return _original(*args, **kwargs)

            mp.setattr(httpx, verb, call)
        yield


S3_BUCKET = "kvcdn-test"
#: Small per-tenant quotas; every test mints its own org, so each starts from zero.
QUOTA_ENV = {"KVCDN_QUOTA_ARTIFACTS": "3", "KVCDN_QUOTA_STORAGE_BYTES": str(8 << 20)}
_orgs = itertools.count()


@pytest.fixture(scope="session")
def oidc_issuer():
    """The node oidc-provider issuer (RS256 JWT access tokens, device flow, PKCE)."""
    with services.oidc_issuer() as issuer:
        yield issuer


@pytest.fixture(scope="session")
def other_issuer():
    """A second, unrelated issuer: its tokens must never be accepted."""
    with services.oidc_issuer() as issuer:
        yield issuer


@pytest.fixture(scope="session")
def moto_s3():
    with services.moto_s3(S3_BUCKET) as s3:
        yield s3


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session; tests take a fresh database each."""
    with services.postgres() as pg:
        yield pg


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """An empty database of each kind the server supports."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return request.getfixturevalue("postgres_server").new_database()


@pytest.fixture(scope="session")
def hosted_model(qwen3_dir):
    """The tiny Qwen3 model the servers are allowed to load."""
    return qwen3_dir


@pytest.fixture(scope="session")
def local_server(tmp_path_factory, oidc_issuer, hosted_model):
    """``kvcdn serve`` with the embedded defaults (local storage), the test issuer and the tiny model."""
    env = {"KVCDN_ISSUER_URL": oidc_issuer.url, "KVCDN_JWT_LEEWAY": "0", **QUOTA_ENV}
    with services.kvcdn_server(
        tmp_path_factory.mktemp("server-home"), ["--models", str(hosted_model), "--infer-concurrency", "2"], env
    ) as server:
        yield server


@pytest.fixture(scope="session")
def s3_replicas(tmp_path_factory, moto_s3, postgres_server, oidc_issuer, hosted_model):
    """Two ``kvcdn serve`` replicas on one PostgreSQL database and one bucket, sharing their secrets
    through the environment."""
    env = {
        **moto_s3.env,
        "KVCDN_ISSUER_URL": oidc_issuer.url,
        "KVCDN_S3_PART_SIZE": str(5 << 20),
        "KVCDN_DATABASE_URL": postgres_server.new_database("replicas"),
        "KVCDN_API_KEY_SEED": "s3-replica-seed-" + "0" * 32,
        "KVCDN_ADMIN_SECRET": "s3-admin-" + "1" * 32,
        "KVCDN_URL_SIGNING_KEY": "s3-url-key-" + "2" * 32,
        "KVCDN_ORGS_REFRESH": "0.2",
        **QUOTA_ENV,
    }
    args = ["--storage", f"s3://{S3_BUCKET}/replicated", "--models", str(hosted_model)]
    with (
        services.kvcdn_server(tmp_path_factory.mktemp("replica-a"), args, env) as a,
        services.kvcdn_server(tmp_path_factory.mktemp("replica-b"), args, env) as b,
    ):
        yield a, b, env["KVCDN_ADMIN_SECRET"]


@pytest.fixture
def new_org():
    """A fresh org slug per call, so quotas and listings start empty."""

    def make(prefix: str = "org") -> str:
        return f"{prefix}-{next(_orgs)}"

    return make


@pytest.fixture
def org_key(local_server, new_org):
    """``org_key(prefix) -> kv_ key`` of a freshly registered org on the local server."""

    def make(prefix: str = "org") -> str:
        return hosted.mint_key(local_server.url, local_server.admin_secret(), new_org(prefix))

    return make


# Access tokens are minted per test: the issuer's live 300 s, and a session-wide token expired
# before a late test used it (the order of tests is not fixed: one worker per core).
@pytest.fixture
def alice_token(oidc_issuer):
    return services.device_flow_token(oidc_issuer.url, "alice")["access_token"]


@pytest.fixture
def bob_token(oidc_issuer):
    return services.device_flow_token(oidc_issuer.url, "bob")["access_token"]


@pytest.fixture(scope="session")
def small_kv(tmp_path_factory):
    """A small valid `.kv` artifact whose model is not on the server (for storage-only tests)."""
    return write_synthetic_kv(tmp_path_factory.mktemp("kv") / "small.kv", tokens=8)
