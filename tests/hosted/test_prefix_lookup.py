"""The hosted prefix index: kept in step with confirm, replace and delete; lookups by chain keys that
see only the caller's and published artifacts, answer a foreign key exactly as an unknown one, and
find what core's own index finds. The app runs in-process (TestClient) on SQLite and PostgreSQL."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from kvcdn_core.store import keys as chainkeys
from tests.support.hosted import API, bearer, sha256_of

C = chainkeys.CHUNK_TOKENS


def write_kv(path: Path, ids, reuse: str | None = None, model_id: str = "example/prefix") -> Path:
    """A valid `.kv` of two small full-attention layers holding ``ids`` (``reuse`` declared if given)."""
    import torch

    from kvcdn_core import artifact

    n = len(ids)
    tensors = {"token_ids": torch.tensor(list(ids), dtype=torch.int64)}
    layers = []
    for i in range(2):
        k, v = f"layers.{i}.key", f"layers.{i}.value"
        tensors[k] = torch.zeros(1, 1, n, 2)
        tensors[v] = torch.ones(1, 1, n, 2)
        layers.append({"index": i, "kind": "full_attention", "tensors": {"key": k, "value": v}})
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00Z",
        "model": {"id": model_id, "architecture": "Qwen3ForCausalLM", "family": "qwen"},
        "compute_dtype": "float32",
        "layers": layers,
        "quantization": None,
    }
    if reuse:
        manifest["reuse"] = reuse
    return artifact.write_artifact(path, manifest, tensors)


def root_of(path: Path) -> str:
    from kvcdn_core import artifact
    from kvcdn_core.artifact.manifest import manifest_of
    from kvcdn_core.store.pack import root_of as root

    return root(manifest_of(artifact.read_header(path)))


def query_body(root: str, ids, limit: int = 10, grant: bool = False) -> dict:
    """What a client sends: the keys of the query's full chunks, and of each chunk's first 16 tokens
    (never its token ids); with ``grant``, each chunk's steps too."""
    import base64

    ids = np.asarray(ids, dtype=np.int64)
    full = chainkeys.full_chain(root, ids)
    parents = [root, *full]
    blocks = [chainkeys.first_block(p, ids[i * C : (i + 1) * C]) for i, p in enumerate(parents)]
    body = {"root": root, "keys": full, "blocks": [b for b in blocks if b], "limit": limit}
    if grant:
        steps = [chainkeys.steps(p, ids[i * C : (i + 1) * C]) for i, p in enumerate(parents)]
        body.update(grant=True, steps=[base64.b64encode(x).decode() for x in steps if x])
    return body


@pytest.fixture
def hosted(monkeypatch, tmp_path, database_url):
    """The app in-process with two orgs; ``upload(org, path, name, ...)`` confirms an artifact."""
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme,beta")
    monkeypatch.setenv("KVCDN_DATABASE_URL", database_url)
    config = load_config(storage=str(tmp_path / "objects"))
    app = create_app(config)
    client = TestClient(app)
    keys = {org: derive_key(config.api_key_seed, org) for org in ("acme", "beta")}

    class Hosted:
        def __init__(self):
            self.app, self.client, self.keys = app, client, keys
            self.db = app.state.services.db_engine

        def upload(self, org, path, name, visibility="private", replace=False) -> str:
            r = client.post(
                f"{API}/artifacts/upload-url",
                headers=bearer(keys[org]),
                json={
                    "name": name,
                    "size_bytes": path.stat().st_size,
                    "sha256": sha256_of(path),
                    "visibility": visibility,
                },
            )
            assert r.status_code == 200, r.text
            plan = r.json()
            url = "/" + plan["url"].split("://", 1)[1].split("/", 1)[1]
            assert client.put(url, content=path.read_bytes()).status_code == 200
            r = client.post(
                f"{API}/artifacts/{plan['artifact_id']}/confirm-upload",
                headers=bearer(keys[org]),
                json={"replace": replace},
            )
            assert r.status_code == 200, r.text
            return plan["artifact_id"]

        def lookup(self, org, body) -> dict:
            r = client.post(f"{API}/prefix/lookup", headers=bearer(keys[org]), json=body)
            assert r.status_code == 200, r.text
            return r.json()

        def raw_lookup(self, org, body):
            return client.post(f"{API}/prefix/lookup", headers=bearer(keys[org]), json=body)

        def roots(self, org) -> list[dict]:
            r = client.get(f"{API}/prefix/roots", headers=bearer(keys[org]))
            assert r.status_code == 200, r.text
            return r.json()["roots"]

        def rows(self, artifact_id: str) -> int:
            from kvcdn_server.prefix import prefix_artifacts, prefix_nodes

            with self.db.connect() as c:
                nodes = c.execute(
                    sa.select(sa.func.count()).where(prefix_nodes.c.artifact_id == artifact_id)
                ).scalar_one()
                arts = c.execute(
                    sa.select(sa.func.count()).where(prefix_artifacts.c.artifact_id == artifact_id)
                ).scalar_one()
            return nodes + arts

        def edges(self) -> list[tuple[str, int]]:
            """(scope, artifacts) of every edge of the chunk tree."""
            from kvcdn_server.prefix import prefix_children

            with self.db.connect() as c:
                e = prefix_children.c
                return [tuple(r) for r in c.execute(sa.select(e.scope, e.artifacts).order_by(e.scope, e.artifacts))]

    with client:
        yield Hosted()


def client_of(hosted, org: str):
    """The hosted client's own lookup (one request, refined to the token), over the in-process app."""
    from kvcdn_hosted.storage import HostedStorage
    from kvcdn_wire.responses import parse

    client = HostedStorage(settings=None)
    client._lookup = lambda model, body: parse(model, hosted.lookup(org, body))  # type: ignore[method-assign]
    return client


def ids_of(seed: int, n: int, start: int = 0) -> list[int]:
    return (np.random.default_rng(seed).integers(1, 50_000, n) + 0 * start).tolist()


def test_the_index_follows_confirm_replace_and_delete(hosted, tmp_path):
    doc = ids_of(1, 700)
    a = write_kv(tmp_path / "a.kv", doc)
    root = root_of(a)
    first = hosted.upload("acme", a, "doc")
    # the root, two full chunks and a partial one; the artifact; the three edges between them
    assert hosted.rows(first) == 4 + 1
    assert hosted.edges() == [("org:acme", 1)] * 3
    found = hosted.lookup("acme", query_body(root, doc + [7, 8, 9]))
    assert found["matched_chunks"] == 2
    assert [(m["artifact_id"], m["matched_tokens"], m["exact"]) for m in found["matches"]] == [(first, 512, False)]
    assert found["next_chunks"] and found["matches"][0]["next_chunk"] == 0
    assert [(r["root"], r["artifacts"], r["model"]["id"]) for r in hosted.roots("acme")] == [
        (root, 1, "example/prefix")
    ]

    # replacing the name drops the old artifact's rows in the confirm's own transaction
    other = ids_of(2, 300)
    second = hosted.upload("acme", write_kv(tmp_path / "b.kv", other), "doc", replace=True)
    assert hosted.rows(first) == 0 and hosted.rows(second) == 3 + 1
    assert hosted.edges() == [("org:acme", 1)] * 2
    assert client_of(hosted, "acme").prefix_lookup(root, doc, 0, 10) == []
    assert [h.ref for h in client_of(hosted, "acme").prefix_lookup(root, other, 0, 10)] == [second]

    r = hosted.client.delete(f"{API}/artifacts/{second}", headers=bearer(hosted.keys["acme"]))
    assert r.status_code == 204
    assert hosted.rows(second) == 0 and hosted.edges() == []
    assert hosted.lookup("acme", query_body(root, other)) == {
        "root": root,
        "matched_chunks": 0,
        "chunk_tokens": C,
        "complete": True,
        "next_chunks": [],
        "matches": [],
        "grant": None,
    }
    assert hosted.roots("acme") == []


def test_a_foreign_private_key_answers_exactly_as_an_unknown_one(hosted, tmp_path):
    secret = ids_of(3, 600)
    path = write_kv(tmp_path / "s.kv", secret)
    root = root_of(path)
    hosted.upload("beta", path, "secret")
    unknown = ids_of(4, 600)
    mine = hosted.raw_lookup("acme", query_body(root, secret))
    miss = hosted.raw_lookup("acme", query_body(root, unknown))
    assert mine.status_code == miss.status_code == 200
    assert mine.content == miss.content  # byte for byte: the same answer as a key nobody holds
    mine = hosted.raw_lookup("acme", query_body(root, secret, grant=True))
    miss = hosted.raw_lookup("acme", query_body(root, unknown, grant=True))
    assert mine.status_code == miss.status_code == 200
    assert mine.content == miss.content and mine.json()["grant"] is None  # a grant only for what it may read
    assert hosted.roots("acme") == []  # nor does the root of a foreign private artifact show
    # its owner finds it, and gets its grant (stored whole: no record, no objects)
    assert hosted.lookup("beta", query_body(root, secret))["matches"][0]["name"] == "secret"
    grant = hosted.lookup("beta", query_body(root, secret, grant=True))["grant"]
    assert grant["record"] is None and grant["objects"] == [] and grant["artifact_id"] != ""


def test_the_grant_is_the_best_match_only_and_only_when_asked(hosted, tmp_path):
    """Three artifacts share the query's first chunk; in its second, "near" shares 20 tokens, "far"
    40 and has the most tokens, "short" shares none and has the fewest. Asked with ``grant``, the
    answer carries the grant of "far" alone, which the query's 16-token steps rank first (by token
    count alone it would be "short", then "near"); not asked, it carries none. A published artifact
    of another org is granted the same way."""
    base = ids_of(60, C + 40)
    arts = {"short": base[:C] + ids_of(61, 10), "near": base[: C + 20] + ids_of(62, 100), "far": base + ids_of(63, 300)}
    made = {}
    for name, ids in arts.items():
        path = write_kv(tmp_path / f"{name}.kv", ids)
        made[name] = hosted.upload("beta", path, name, visibility="public")
    root = root_of(path)
    query = base + ids_of(64, 30)
    answer = hosted.lookup("acme", query_body(root, query, grant=True))
    assert answer["grant"]["artifact_id"] == made["far"] and len(answer["matches"]) == 3
    assert hosted.lookup("acme", query_body(root, query))["grant"] is None
    # without the steps, ranked by token count: the grant may then not be the client's pick
    unranked = {**query_body(root, query, grant=True), "steps": []}
    assert hosted.lookup("acme", unranked)["grant"]["artifact_id"] == made["short"]
    hits = client_of(hosted, "acme").prefix_lookup(root, query, 0, 1)
    assert [(h.ref, h.prefix_tokens) for h in hits] == [(made["far"], C + 40)]


def test_published_artifacts_are_found_by_everyone(hosted, tmp_path):
    shared = ids_of(5, 520)
    path = write_kv(tmp_path / "p.kv", shared)
    root = root_of(path)
    published = hosted.upload("beta", path, "public-doc", visibility="public")
    found = client_of(hosted, "acme").prefix_lookup(root, shared + [1, 2], 0, 10)
    assert [(h.ref, h.prefix_tokens) for h in found] == [(published, 520)]
    assert [r["root"] for r in hosted.roots("acme")] == [root]


def test_lookup_agrees_with_core_index(hosted, tmp_path):
    """The same artifacts in core's chunk-store index and in the hosted one: the hosted client's
    lookup (one request of chain keys, refined by the candidates' token ids in the next chunk)
    gives exactly core's hits."""
    import dataclasses
    from types import SimpleNamespace

    from kvcdn_core.plugin_host.registry import open_storage
    from kvcdn_core.store import index

    base = ids_of(6, 1024)
    corpus = {
        "base": base,
        "short": base[:300],
        "branch": base[:512] + ids_of(7, 400),
        "tail": base[:768] + ids_of(8, 20),
        "other": ids_of(9, 900),
        "state": base[:530],  # whole-prefix: found only when the query holds it whole
    }
    backend = open_storage(str(tmp_path / "core-store"))
    root = None
    for name, ids in corpus.items():
        reuse = "whole_prefix" if name == "state" else None
        path = write_kv(tmp_path / f"{name}.kv", ids, reuse=reuse)
        root = root_of(path)
        hosted.upload("acme", path, name)
        record = SimpleNamespace(
            name=name,
            root=root,
            reuse=reuse or "any_prefix",
            chunk_tokens=C,
            token_count=len(ids),
            model={"id": "example/prefix"},
            compute_dtype="float32",
            quantization=None,
        )
        index.add(backend, record, ids)
    queries = [
        base + [5, 6],
        base[:600],
        base[:512] + ids_of(7, 450),
        base[:768] + ids_of(8, 20) + [1],
        base[:780],
        base[:300],
        ids_of(9, 300),
        ids_of(10, 700),
        base[:100] + ids_of(11, 50),  # inside the first chunk
        base[:5] + ids_of(12, 400),
        base[:512] + ids_of(7, 37) + ids_of(13, 300),  # inside a chunk, past a block boundary
        base[:530],
    ]
    client = client_of(hosted, "acme")
    for q in queries:
        core = index.lookup(backend, root, q, 0, 10)
        remote = client.prefix_lookup(root, q, 0, 10)
        assert [dataclasses.replace(h, ref=None) for h in remote] == core, q[:3]
        assert all(h.ref for h in remote)


def test_a_longer_match_behind_more_than_limit_ties_is_found(hosted, tmp_path):
    """More than ``limit`` small artifacts share the query's first 20 tokens of a chunk, and one
    larger artifact shares 25: the lookup finds the larger one, as core's index does (a refinement
    that took only the ``limit`` smallest artifacts past the last common 16-token block missed it)."""
    from types import SimpleNamespace

    from kvcdn_core.plugin_host.registry import open_storage
    from kvcdn_core.store import index

    base, common = ids_of(20, C), ids_of(21, 40)
    corpus = {f"small-{i}": base + common[:20] + [60_000 + i] for i in range(4)}
    corpus["large"] = base + common[:25] + ids_of(22, 300)
    backend = open_storage(str(tmp_path / "core-store"))
    root = None
    for name, ids in corpus.items():
        path = write_kv(tmp_path / f"{name}.kv", ids)
        root = root_of(path)
        hosted.upload("acme", path, name)
        record = SimpleNamespace(
            name=name,
            root=root,
            reuse="any_prefix",
            chunk_tokens=C,
            token_count=len(ids),
            model={"id": "example/prefix"},
            compute_dtype="float32",
            quantization=None,
        )
        index.add(backend, record, ids)
    query = base + common[:25] + ids_of(23, 100)
    remote = client_of(hosted, "acme").prefix_lookup(root, query, 0, 3)
    assert [(h.name, h.prefix_tokens) for h in remote] == [("large", C + 25)]
    assert [(h.name, h.prefix_tokens) for h in index.lookup(backend, root, query, 0, 3)] == [("large", C + 25)]


def test_a_node_with_more_children_than_one_answer_holds(hosted, caplog, monkeypatch):
    """40 artifacts go on past one chunk, each its own way (more children than an answer lists):
    the query's next 16 tokens pick the one it shares them with, and the match is exact. A query
    sharing fewer than 16 tokens with all of them (5 with one, 2 with another) gets an answer
    marked incomplete; the client asks again with the keys of its first 1 to 15 tokens there, and
    finds the one sharing 5 (asked with a grant, as the engine asks, it does not ask again, and
    says nothing). When more than 32 share the query's next 16 tokens, the answer stays
    incomplete: the client says so once in the log and in its hits."""
    import threading
    import uuid

    from kvcdn_hosted import storage
    from kvcdn_server import prefix

    monkeypatch.setattr(storage, "_INCOMPLETE_SAID", threading.Event())  # said once per process
    base = ids_of(40, C)
    root = chainkeys.root_key({"architecture": "Qwen3ForCausalLM"}, chainkeys.representation("float32", None))
    arts = {f"a{i:02d}": base + ids_of(100 + i, 300) for i in range(prefix.MAX_CHILDREN + 8)}
    ids_by_name = {}
    with hosted.db.begin() as c:
        for name, ids in arts.items():
            entry = prefix.entry_from_ids(root, "any_prefix", ids, {"id": "m"}, "float32", None)
            ids_by_name[name] = str(uuid.uuid4())
            prefix.index_artifact(c, ids_by_name[name], "org:acme", name, entry)
    client = client_of(hosted, "acme")
    for name, ids in arts.items():
        found = client.prefix_lookup(root, ids[: C + 40] + [0] * 50, 0, 10)
        assert [(h.ref, h.prefix_tokens) for h in found] == [(ids_by_name[name], C + 40)], name
    answer = hosted.lookup("acme", query_body(root, base + [0] * 50))
    assert answer["matched_chunks"] == 1 and answer["complete"] is False
    # 5 tokens shared with the child a first answer leaves out (the last by key), 2 with another:
    # found through the head rows, in a second request
    node = chainkeys.full_chain(root, base)[0]
    last = max(arts, key=lambda name: chainkeys.first_block(node, arts[name][C : C + 16]))
    other = "a07" if last != "a07" else "a08"
    query = base + arts[last][C : C + 5] + [0] * 50
    query[C + 5 : C + 7] = [50_001, 50_002]
    assert arts[other][C : C + 2] != query[C : C + 2]
    found = client.prefix_lookup(root, query, 0, 10)
    assert [(h.ref, h.prefix_tokens, h.complete) for h in found] == [(ids_by_name[last], C + 5, True)]
    # asked with a grant (the engine's lookup: no second request), the same answer is no miss worth
    # a line: a match under 16 more tokens is less than one of its blocks
    hits, _ = client.prefix_lookup_grant(root, base + [0] * 50, 1)
    assert [(h.prefix_tokens, h.complete) for h in hits] == [(C, True)]
    assert "may be missed" not in caplog.text

    # 40 more sharing a13's first 16 tokens after the chunk, then each its own way
    more = {f"b{i:02d}": base + arts["a13"][C : C + 16] + ids_of(300 + i, 100) for i in range(prefix.MAX_CHILDREN + 8)}
    with hosted.db.begin() as c:
        for name, ids in more.items():
            entry = prefix.entry_from_ids(root, "any_prefix", ids, {"id": "m"}, "float32", None)
            prefix.index_artifact(c, str(uuid.uuid4()), "org:acme", name, entry)
    found = client.prefix_lookup(root, base + arts["a13"][C : C + 16] + [0] * 50, 0, 10)
    assert found and all(not h.complete and h.prefix_tokens == C + 16 for h in found)
    assert caplog.text.count("may be missed") == 1
    client.prefix_lookup(root, base + arts["a13"][C : C + 16] + [1] * 50, 0, 10)
    assert caplog.text.count("may be missed") == 1  # once per process


def test_head_rows_follow_a_node_growing_wide_and_its_children_leaving(hosted):
    """A node's children get head rows once it has 17 (those before too), each new child then
    gets its own, and a child's rows leave with its last artifact (not before)."""
    import uuid

    from kvcdn_server import prefix

    base = ids_of(70, C)
    root = chainkeys.root_key({"architecture": "Qwen3ForCausalLM"}, chainkeys.representation("float32", None))

    def heads() -> int:
        with hosted.db.connect() as c:
            return c.execute(sa.select(sa.func.count()).select_from(prefix.prefix_heads)).scalar_one()

    made = []
    for i in range(prefix.HEADS_FROM + 2):
        entry = prefix.entry_from_ids(root, "any_prefix", base + ids_of(400 + i, 40), {"id": "m"}, "float32", None)
        made.append(str(uuid.uuid4()))
        with hosted.db.begin() as c:
            prefix.index_artifact(c, made[-1], "org:acme", f"h{i:02d}", entry)
        assert heads() == (15 * (i + 1) if i + 1 >= prefix.HEADS_FROM else 0), i
    with hosted.db.begin() as c:
        prefix.drop_artifact(c, made[0])
    assert heads() == 15 * (prefix.HEADS_FROM + 1)
    # a child two artifacts pass through keeps its rows until the second leaves
    entry = prefix.entry_from_ids(root, "any_prefix", base + ids_of(401, 40), {"id": "m"}, "float32", None)
    copy = str(uuid.uuid4())
    with hosted.db.begin() as c:
        prefix.index_artifact(c, copy, "org:acme", "h01-copy", entry)
    assert heads() == 15 * (prefix.HEADS_FROM + 1)
    with hosted.db.begin() as c:
        prefix.drop_artifact(c, made[1])
    assert heads() == 15 * (prefix.HEADS_FROM + 1)
    with hosted.db.begin() as c:
        prefix.drop_artifact(c, copy)
    assert heads() == 15 * prefix.HEADS_FROM


@pytest.mark.parametrize(
    "body",
    [
        {"root": "zz" * 32, "keys": []},
        {"root": "ab" * 32, "keys": ["ab" * 31]},
        {"root": "ab" * 32, "keys": ["AB" * 32]},
        {"root": "ab" * 32, "keys": ["ab" * 32] * 513},
        {"root": "ab" * 32, "partial": ["ab" * 32] * 256},
        {"root": "ab" * 32, "blocks": ["ab" * 32] * 514},
        {"root": "ab" * 32, "blocks": ["ab"]},
        {"root": "ab" * 32, "limit": 0},
        {"root": "ab" * 32, "tokens": [1, 2, 3]},
        {"root": "ab" * 32, "grant": True, "steps": ["abc="]},
        {"root": "ab" * 32, "grant": True, "steps": ["AAAA" * 23]},
        {"root": "ab" * 32, "grant": True, "steps": ["not base64!"]},
        {"root": "ab" * 32, "grant": True, "steps": ["AAAAAA=="] * 514},
    ],
)
def test_bad_lookups_are_refused_in_one_line(hosted, body):
    r = hosted.raw_lookup("acme", body)
    assert r.status_code == 422 and r.json()["error"] == "validation_error"
    assert "\n" not in r.json()["message"]


def test_the_longest_query_fits_one_request(hosted):
    """512 full-chunk keys, 513 block keys and 513 chunks' steps (a 131,072-token query asking for
    a grant) are over the 64 KiB of other JSON bodies: the lookup route takes them; one key more is
    refused in one line."""
    import base64

    rng = np.random.default_rng(50)
    keys = [rng.bytes(32).hex() for _ in range(1025)]
    steps = base64.b64encode(rng.bytes(64)).decode()  # 16 four-byte key prefixes per chunk
    body = {"root": keys[0], "keys": keys[:512], "blocks": keys[512:], "limit": 50, "grant": True}
    body["steps"] = [steps] * 513
    r = hosted.raw_lookup("acme", body)
    assert r.status_code == 200 and r.json()["matched_chunks"] == 0, r.text
    r = hosted.raw_lookup("acme", {**body, "keys": keys[:513]})
    assert r.status_code == 422 and "\n" not in r.json()["message"]


def test_lookup_needs_a_credential(hosted):
    assert hosted.client.post(f"{API}/prefix/lookup", json={"root": "ab" * 32}).status_code == 401
    assert hosted.client.get(f"{API}/prefix/roots").status_code == 401


def test_foreign_and_unknown_keys_take_the_same_time(hosted, tmp_path):
    """Timing: lookups of keys held only in another tenant's private artifacts against lookups of
    keys nobody holds, interleaved (one of each in turn, so a busy machine's load falls on both
    alike), compared by the medians of batches. Both run the same statements against the same
    index seeks (a lookup reads only the caller's and the public scope, where neither key is), so
    their times differ only by noise; the bound (medians within a factor of 1.5) is wide enough
    that no load pattern breaks it yet far below what a real difference would show: a scope that
    leaked (reading the foreign rows and then filtering them) costs the row reads of 16 chunks."""
    foreign_bodies, unknown_bodies = [], []
    for i in range(4):
        ids = ids_of(100 + i, 16 * C)
        path = write_kv(tmp_path / f"f{i}.kv", ids)
        root = root_of(path)
        for j in range(3):  # several artifacts behind each key: a scan would show
            hosted.upload("beta", path, f"f{i}-{j}")
        foreign_bodies.append(query_body(root, ids))
        unknown_bodies.append(query_body(root, ids_of(200 + i, 16 * C)))
    # warm both paths first
    for body in foreign_bodies + unknown_bodies:
        hosted.raw_lookup("acme", body)

    def batch(bodies) -> float:
        start = time.perf_counter()
        for body in bodies:
            assert hosted.raw_lookup("acme", body).json()["matches"] == []
        return time.perf_counter() - start

    foreign, unknown = [], []
    for round_ in range(30):
        pair = [(foreign, foreign_bodies), (unknown, unknown_bodies)]
        if round_ % 2:
            pair.reverse()
        for into, bodies in pair:
            into.append(batch(bodies))
    ratio = statistics.median(foreign) / statistics.median(unknown)
    assert 1 / 1.5 < ratio < 1.5, (ratio, foreign, unknown)
