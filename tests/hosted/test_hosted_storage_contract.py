"""The hosted endpoint as a storage backend passes the storage contract against a real ``kvcdn serve``.

Keys are artifact names in the caller's tenant; the backend stores only `.kv` artifacts and does
not offer rename, both declared, and the suite checks the declared refusals too. Each check runs
for a fresh org (an empty store), opened through ``kvcdn+http://`` as any user would.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import threading

import httpx
import pytest

from kvcdn_core import open_storage
from kvcdn_core.testing import assert_storage_contract
from kvcdn_hosted.storage import HostedStorage
from tests.support import services
from tests.support.budget import budget
from tests.support.hosted import API, bearer, mint_key, upload

#: the suite puts a dozen objects per check, one of them over 3 MiB
ROOMY = {"KVCDN_QUOTA_ARTIFACTS": "100", "KVCDN_QUOTA_STORAGE_BYTES": str(256 << 20)}
_orgs = itertools.count()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def roomy(request, tmp_path_factory, oidc_issuer):
    """``(server, database URL)``: ``kvcdn serve`` with room for the suite, on each kind of database."""
    home = tmp_path_factory.mktemp("storage-server")
    if request.param == "postgresql":
        database = request.getfixturevalue("postgres_server").new_database("storage")
    else:
        database = f"sqlite:///{home / 'state.db'}"
    env = {"KVCDN_ISSUER_URL": oidc_issuer.url, "KVCDN_DATABASE_URL": database, **ROOMY}
    with services.kvcdn_server(home, [], env) as server:
        yield server, database


@pytest.fixture
def roomy_server(roomy):
    return roomy[0]


def hosted_store(server, monkeypatch, prefix: str = "store") -> HostedStorage:
    """A backend over a fresh org's (empty) artifacts, opened from its URI with the org's key."""
    monkeypatch.setenv("KVCDN_API_KEY", mint_key(server.url, server.admin_secret(), f"{prefix}-{next(_orgs)}"))
    store = open_storage(server.url.replace("http://", "kvcdn+http://"))
    assert isinstance(store, HostedStorage)
    return store


def test_hosted_storage_passes_the_storage_contract(roomy_server, monkeypatch):
    assert_storage_contract(lambda: hosted_store(roomy_server, monkeypatch))


def test_keys_are_the_names_users_see(roomy_server, monkeypatch, small_kv):
    """What the backend puts is an artifact named by its key, listed and downloadable as usual;
    an artifact uploaded the usual way reads back under its name."""
    store = hosted_store(roomy_server, monkeypatch, "names")
    key = store.settings.api_key
    store.put_file("team/doc.kv", small_kv)
    listed = httpx.get(f"{roomy_server.url}{API}/artifacts", headers=bearer(key)).json()["artifacts"]
    assert [(a["name"], a["sha256"]) for a in listed] == [
        ("team/doc.kv", hashlib.sha256(small_kv.read_bytes()).hexdigest())
    ]
    upload(roomy_server.url, key, small_kv, name="plain.kv")  # the raw API, as another client would
    assert store.read_bytes("plain.kv") == small_kv.read_bytes()
    assert [o.key for o in store.list("team/")] == ["team/doc.kv"]


def test_names_shared_by_plain_uploads_read_as_the_last_and_delete_together(roomy_server, monkeypatch, tmp_path):
    from tests.support.hosted import write_synthetic_kv

    store = hosted_store(roomy_server, monkeypatch, "shared")
    key = store.settings.api_key
    first = write_synthetic_kv(tmp_path / "1.kv", tokens=8, seed=1)
    second = write_synthetic_kv(tmp_path / "2.kv", tokens=8, seed=2)
    upload(roomy_server.url, key, first, name="same.kv")
    upload(roomy_server.url, key, second, name="same.kv")
    assert store.read_bytes("same.kv") == second.read_bytes()
    assert [o.key for o in store.list("")] == ["same.kv"]
    store.delete("same.kv")
    assert httpx.get(f"{roomy_server.url}{API}/artifacts", headers=bearer(key)).json()["artifacts"] == []


def test_racing_replacements_leave_exactly_one_artifact(roomy, monkeypatch, tmp_path):
    """The server deletes the others of a name in the confirm's own transaction, so writers racing
    on one name never leave two artifacts nor none, on SQLite and on PostgreSQL, and the quota of
    the replaced ones is given back."""
    roomy_server = roomy[0]
    from tests.support.hosted import write_synthetic_kv

    store = hosted_store(roomy_server, monkeypatch, "race")
    sources = [write_synthetic_kv(tmp_path / f"{n}.kv", tokens=16, seed=n) for n in range(6)]
    barrier = threading.Barrier(len(sources))
    errors: list[BaseException] = []

    def put(path):
        try:
            barrier.wait()
            store.put_file("contended.kv", path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    pool = [threading.Thread(target=put, args=(p,)) for p in sources]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=budget(120))
    assert not errors, errors
    listed = httpx.get(f"{roomy_server.url}{API}/artifacts", headers=bearer(store.settings.api_key)).json()
    assert len(listed["artifacts"]) == 1, listed
    assert store.read_bytes("contended.kv") in {p.read_bytes() for p in sources}
    only = listed["artifacts"][0]
    assert reserved(roomy[1], tenant_of(roomy[1], only["artifact_id"])) == (1, only["size_bytes"])


def test_deletes_racing_replacements_of_one_name_neither_fail_nor_leak(roomy, monkeypatch, tmp_path):
    """Deletes and replacing confirms of one name take the tenant's locks in one order: no deadlock
    (a 500 on PostgreSQL), at most one artifact left, and the quota reservation matches what is left."""
    from tests.support.hosted import write_synthetic_kv

    store = hosted_store(roomy[0], monkeypatch, "delrace")
    sources = [write_synthetic_kv(tmp_path / f"{n}.kv", tokens=16, seed=n) for n in range(4)]
    store.put_file("contended.kv", sources[0])
    listing = f"{roomy[0].url}{API}/artifacts"
    first = httpx.get(listing, headers=bearer(store.settings.api_key)).json()["artifacts"][0]
    tenant = tenant_of(roomy[1], first["artifact_id"])
    barrier = threading.Barrier(len(sources) * 2)
    errors: list[BaseException] = []

    def run(call):
        try:
            barrier.wait()
            call()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    calls = [lambda p=p: store.put_file("contended.kv", p) for p in sources]
    calls += [lambda: store.delete("contended.kv")] * len(sources)
    pool = [threading.Thread(target=run, args=(call,)) for call in calls]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=budget(120))
    assert not errors, errors
    left = httpx.get(listing, headers=bearer(store.settings.api_key)).json()["artifacts"]
    assert len(left) <= 1, left
    assert reserved(roomy[1], tenant) == (len(left), sum(a["size_bytes"] for a in left))
    if left:
        assert store.read_bytes("contended.kv") in {p.read_bytes() for p in sources}


def database_rows(database: str, query):
    import sqlalchemy as sa

    from kvcdn_server.db import database_url

    engine = sa.create_engine(database_url(database))
    try:
        with engine.connect() as c:
            return c.execute(query).all()
    finally:
        engine.dispose()


def tenant_of(database: str, artifact_id: str) -> str:
    import sqlalchemy as sa

    from kvcdn_server.db import artifacts

    return database_rows(database, sa.select(artifacts.c.tenant).where(artifacts.c.id == artifact_id))[0][0]


def reserved(database: str, tenant: str) -> tuple[int, int]:
    """The tenant's quota reservation (artifacts, bytes), as upload-url checks it."""
    import sqlalchemy as sa

    from kvcdn_server.db import usage

    row = database_rows(database, sa.select(usage.c.artifacts, usage.c.bytes).where(usage.c.tenant == tenant))[0]
    return int(row[0]), int(row[1])


def test_a_server_refuses_a_backend_that_cannot_hold_its_objects(roomy_server, tmp_path):
    """``kvcdn serve --storage kvcdn+http://...`` stops with one line: uploads are raw bytes first."""
    result = subprocess.run(
        [
            *services.kvcdn_executable(),
            "serve",
            "--port",  # any free port: the default may be held by another test or program
            "0",
            "--storage",
            roomy_server.url.replace("http://", "kvcdn+http://"),
        ],
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "d")},
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: storage '{roomy_server.url.replace('http://', 'kvcdn+http://')}' cannot hold a server's objects: "
        "it must store any bytes and rename"
    ]
