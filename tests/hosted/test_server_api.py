"""``kvcdn serve`` with local storage, driven over HTTP: the API, API keys, OIDC tokens, isolation
and every refusal the hosted issue lists. Each refusal is also checked to have stored nothing."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import stat
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tests.support import services
from tests.support.budget import budget
from tests.support.hosted import API, bearer, confirm, mint_key, put_bytes, request_upload, sha256_of, upload


def stored(server) -> set[str]:
    """Artifact-related files in the server's storage (org records excluded)."""
    root = server.data_dir / "objects"
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and not p.relative_to(root).as_posix().startswith("orgs/")
    }


def error_of(r: httpx.Response) -> str:
    body = r.json()
    assert set(body) == {"error", "message"}, body
    return body["error"]


def hkdf_key(seed: bytes, info: str) -> str:
    return "kv_" + HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info.encode()).derive(seed).hex()


# -- basics, secrets and keys -----------------------------------------------------------------------


def test_health_and_openapi_document_every_route(local_server):
    assert httpx.get(f"{local_server.url}/health").json()["status"] == "ok"
    paths = httpx.get(f"{local_server.url}/openapi.json").json()["paths"]
    for route in (
        "/api/v1/whoami",
        "/api/v1/api-keys/verify",
        "/api/v1/quota",
        "/api/v1/admin/api-keys",
        "/api/v1/artifacts/upload-url",
        "/api/v1/artifacts/{artifact_id}/confirm-upload",
        "/api/v1/artifacts",
        "/api/v1/artifacts/{artifact_id}",
        "/api/v1/artifacts/{artifact_id}/download-url",
        "/api/v1/artifacts/{artifact_id}/infer",
        "/api/v1/orgs/{org}/projects/{project}/artifacts/{artifact_id}/infer",
        "/api/v1/telemetry",
    ):
        assert route in paths, route


def test_first_start_creates_private_secrets_and_says_how_to_mint(local_server):
    for name in ("api-key-seed", "admin-secret", "url-signing-key"):
        mode = stat.S_IMODE((local_server.data_dir / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    log = "".join(local_server.log)
    assert "mint an org API key" in log and "X-Kvcdn-Admin-Secret" in log
    assert local_server.admin_secret() not in log  # the secret itself is never printed


def test_api_key_is_the_documented_hkdf_and_verifies(local_server, new_org):
    slug = new_org("hkdf")
    key = mint_key(local_server.url, local_server.admin_secret(), slug)
    seed = (local_server.data_dir / "api-key-seed").read_text().strip().encode()
    assert key == hkdf_key(seed, f"kvcdn/api-key/v1/{slug}")
    who = httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(key)).json()
    assert who == {
        "customer_id": f"org:{slug}",
        "org": slug,
        "project": "default",
        "method": "api_key",
        "subject": None,
        "issuer": None,
        "email": None,
    }
    r = httpx.post(f"{local_server.url}{API}/api-keys/verify", json={"api_key": key})
    assert r.json() == {"customer_id": f"org:{slug}", "org": slug, "method": "api_key"}
    bad = key[:-1] + ("0" if key[-1] != "0" else "1")
    r = httpx.post(f"{local_server.url}{API}/api-keys/verify", json={"api_key": bad})
    assert r.status_code == 401 and error_of(r) == "unauthorized"


def test_admin_route_needs_the_secret(local_server):
    for headers in (
        {},
        {"X-Kvcdn-Admin-Secret": "wrong"},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {local_server.admin_secret()}"},
    ):
        r = httpx.post(f"{local_server.url}{API}/admin/api-keys", json={"org_slug": "x"}, headers=headers)
        assert r.status_code == 403 and error_of(r) == "forbidden"
    r = httpx.post(
        f"{local_server.url}{API}/admin/api-keys",
        json={"org_slug": "../Bad"},
        headers={"X-Kvcdn-Admin-Secret": local_server.admin_secret()},
    )
    assert r.status_code == 422 and error_of(r) == "validation_error"


def test_rotation_changes_one_org_only(local_server, new_org):
    a, b = new_org("rot-a"), new_org("rot-b")
    admin = {"X-Kvcdn-Admin-Secret": local_server.admin_secret()}
    key_a, key_b = (mint_key(local_server.url, local_server.admin_secret(), s) for s in (a, b))
    r = httpx.post(f"{local_server.url}{API}/admin/api-keys/rotate", json={"org_slug": a}, headers=admin)
    new_a = r.json()["api_key"]
    assert r.json()["generation"] == 2 and new_a != key_a
    seed = (local_server.data_dir / "api-key-seed").read_text().strip().encode()
    assert new_a == hkdf_key(seed, f"kvcdn/api-key/v1/{a}/r2")
    assert httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(key_a)).status_code == 401
    assert httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(new_a)).json()["org"] == a
    assert httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(key_b)).json()["org"] == b
    r = httpx.post(f"{local_server.url}{API}/admin/api-keys/rotate", json={"org_slug": "never-seen"}, headers=admin)
    assert r.status_code == 404


@pytest.mark.parametrize(
    "method,route",
    [
        ("GET", "/whoami"),
        ("GET", "/quota"),
        ("GET", "/artifacts"),
        ("POST", "/artifacts/upload-url"),
        ("POST", "/artifacts/00000000-0000-4000-8000-000000000000/confirm-upload"),
        ("DELETE", "/artifacts/00000000-0000-4000-8000-000000000000"),
        ("POST", "/artifacts/00000000-0000-4000-8000-000000000000/infer"),
    ],
)
def test_routes_refuse_missing_or_malformed_credentials(local_server, method, route):
    for headers in (
        {},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer kv_" + "0" * 64},
        {"Authorization": "Bearer not-a-jwt"},
    ):
        r = httpx.request(method, f"{local_server.url}{API}{route}", headers=headers, json={})
        assert r.status_code == 401, (headers, r.text)
        assert error_of(r) == "unauthorized" and r.headers["www-authenticate"] == "Bearer"


# -- OIDC tokens ---------------------------------------------------------------------------------------


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_oidc_token_identifies_the_subject_namespaced_by_issuer(local_server, oidc_issuer, alice_token):
    who = httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(alice_token)).json()
    expected = "oidc:" + hashlib.sha256(f"{oidc_issuer.url}\0alice".encode()).hexdigest()[:32]
    assert who["customer_id"] == expected and who["method"] == "oidc" and who["subject"] == "alice"
    assert who["issuer"] == oidc_issuer.url and who["email"] == "alice@example.test" and who["org"] is None


def test_token_from_the_auth_code_pkce_flow_is_accepted(local_server, oidc_issuer):
    import secrets

    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    redirect = f"http://127.0.0.1:{services.free_port()}/callback"
    authorize = httpx.URL(
        f"{oidc_issuer.url}/auth",
        params={
            "client_id": "kvcdn-cli",
            "response_type": "code",
            "redirect_uri": redirect,
            "state": "s1",
            "scope": "openid email kvcdn",
            "code_challenge": challenge,
            "code_challenge_method": "S256",
        },
    )
    back = httpx.URL(services.browser_authorize(str(authorize), "bob"))
    assert back.params["state"] == "s1"
    token = httpx.post(
        f"{oidc_issuer.url}/token",
        data={
            "grant_type": "authorization_code",
            "code": back.params["code"],
            "redirect_uri": redirect,
            "client_id": "kvcdn-cli",
            "code_verifier": verifier,
        },
    ).json()["access_token"]
    who = httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(token)).json()
    assert who["subject"] == "bob" and who["method"] == "oidc"


def test_forged_and_foreign_tokens_are_refused(local_server, oidc_issuer, other_issuer, alice_token):
    claims = jwt.decode(alice_token, options={"verify_signature": False})
    header = jwt.get_unverified_header(alice_token)
    own_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks = httpx.get(f"{oidc_issuer.url}/jwks").json()["keys"]
    public_pem = jwt.PyJWK(jwks[0]).key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = f"{_b64({'alg': 'HS256', 'typ': 'JWT', 'kid': header['kid']})}.{_b64(claims)}"
    hs_with_public_key = (
        signing_input
        + "."
        + base64.urlsafe_b64encode(hmac.new(public_pem, signing_input.encode(), "sha256").digest())
        .rstrip(b"=")
        .decode()
    )
    forged = {
        "alg none": f"{_b64({'alg': 'none', 'typ': 'JWT', 'kid': header['kid']})}.{_b64(claims)}.",
        "alg none, no kid": f"{_b64({'alg': 'none'})}.{_b64(claims)}.",
        "HS256 keyed with the public key": hs_with_public_key,
        "unknown kid": jwt.encode(claims, own_key, algorithm="RS256", headers={"kid": "not-in-jwks"}),
        "right kid, wrong key": jwt.encode(claims, own_key, algorithm="RS256", headers={"kid": header["kid"]}),
        "tampered claims": alice_token.split(".")[0]
        + "."
        + _b64({**claims, "sub": "bob"})
        + "."
        + alice_token.split(".")[2],
        "wrong audience": services.device_flow_token(oidc_issuer.url, "alice", resource=services.OTHER_RESOURCE)[
            "access_token"
        ],
        "wrong issuer": services.device_flow_token(other_issuer.url, "alice")["access_token"],
    }
    for what, token in forged.items():
        r = httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(token))
        assert r.status_code == 401, (what, r.text)
        assert error_of(r) == "unauthorized"


def test_expired_token_is_refused(local_server, oidc_issuer):
    token = services.device_flow_token(oidc_issuer.url, "bob", resource=services.SHORT_RESOURCE)["access_token"]
    exp = jwt.decode(token, options={"verify_signature": False})["exp"]
    time.sleep(max(0.0, exp - time.time()) + 1.1)
    r = httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(token))
    assert r.status_code == 401 and "expired" in r.json()["message"]


# -- uploads, downloads, listing ----------------------------------------------------------------------


def test_upload_list_download_delete_round_trip(local_server, org_key, qwen3_artifact):
    key = org_key("flow")
    before = stored(local_server)
    art = upload(
        local_server.url,
        key,
        qwen3_artifact,
        name="sample.kv",
        manifest={"architecture": "Qwen3ForCausalLM", "layers": 2},
    )
    assert art["status"] == "ready" and art["sha256"] == sha256_of(qwen3_artifact)
    assert art["manifest"]["architecture"] == "Qwen3ForCausalLM" and art["manifest"]["layers"] == 2
    from kvcdn_core.artifact import read_manifest

    assert art["manifest"]["tokens"] == read_manifest(qwen3_artifact)["token_count"]
    listing = httpx.get(f"{local_server.url}{API}/artifacts", headers=bearer(key)).json()
    assert [a["artifact_id"] for a in listing["artifacts"]] == [art["artifact_id"]] and listing["next_cursor"] is None
    got = httpx.get(f"{local_server.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(key)).json()
    assert got == art
    d = httpx.post(f"{local_server.url}{API}/artifacts/{art['artifact_id']}/download-url", headers=bearer(key)).json()
    assert d["sha256"] == art["sha256"] and d["size_bytes"] == qwen3_artifact.stat().st_size
    body = httpx.get(d["download_url"])
    assert body.status_code == 200 and body.content == qwen3_artifact.read_bytes()
    quota = httpx.get(f"{local_server.url}{API}/quota", headers=bearer(key)).json()
    assert quota["usage"]["artifacts"] == 1 and quota["usage"]["storage_bytes"] == d["size_bytes"]
    r = httpx.delete(f"{local_server.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(key))
    assert r.status_code == 204 and r.content == b""
    assert httpx.get(f"{local_server.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(key)).status_code == 404
    assert httpx.get(d["download_url"]).status_code == 404
    assert stored(local_server) == before


def test_pagination(local_server, org_key, small_kv):
    key = org_key("page")
    ids = sorted(upload(local_server.url, key, small_kv, name=f"n{i}.kv")["artifact_id"] for i in range(3))
    first = httpx.get(f"{local_server.url}{API}/artifacts", params={"limit": 2}, headers=bearer(key)).json()
    assert [a["artifact_id"] for a in first["artifacts"]] == ids[:2] and first["next_cursor"]
    second = httpx.get(
        f"{local_server.url}{API}/artifacts", params={"limit": 2, "cursor": first["next_cursor"]}, headers=bearer(key)
    ).json()
    assert [a["artifact_id"] for a in second["artifacts"]] == ids[2:] and second["next_cursor"] is None
    for params in ({"limit": 0}, {"limit": 501}, {"cursor": "../x"}):
        r = httpx.get(f"{local_server.url}{API}/artifacts", params=params, headers=bearer(key))
        assert r.status_code == 422, params


def test_public_artifact_downloads_without_credentials(local_server, org_key, small_kv):
    owner, other = org_key("pub"), org_key("pub-other")
    art = upload(local_server.url, owner, small_kv, visibility="public")
    r = httpx.post(f"{local_server.url}{API}/artifacts/{art['artifact_id']}/download-url")
    assert r.status_code == 200 and httpx.get(r.json()["download_url"]).content == small_kv.read_bytes()
    anonymous = httpx.get(f"{local_server.url}{API}/artifacts/{art['artifact_id']}").json()
    assert anonymous["visibility"] == "public" and "customer_id" not in anonymous  # the owner stays private
    assert (
        "customer_id"
        not in httpx.get(f"{local_server.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(other)).json()
    )
    mine = httpx.get(f"{local_server.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(owner)).json()
    assert mine["customer_id"].startswith("org:pub-")
    # Readable by all, but only the owner deletes it.
    r = httpx.delete(f"{local_server.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(other))
    assert r.status_code == 404
    # A credential that does not verify is refused, not treated as anonymous.
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/{art['artifact_id']}/download-url", headers=bearer("kv_" + "f" * 64)
    )
    assert r.status_code == 401


def test_tenant_b_cannot_touch_tenant_a_private_artifact(local_server, org_key, bob_token, qwen3_artifact):
    a, b = org_key("iso-a"), org_key("iso-b")
    art = upload(local_server.url, a, qwen3_artifact)
    aid = art["artifact_id"]
    pending = request_upload(local_server.url, a, qwen3_artifact).json()  # a pending upload of A's
    for intruder in (b, bob_token):
        h = bearer(intruder)
        assert aid not in json.dumps(httpx.get(f"{local_server.url}{API}/artifacts", headers=h).json())
        for method, route, body in [
            ("GET", f"/artifacts/{aid}", None),
            ("POST", f"/artifacts/{aid}/download-url", None),
            ("POST", f"/artifacts/{aid}/infer", {"question": "x", "n": 1}),
            ("POST", f"/orgs/any/projects/any/artifacts/{aid}/infer", {"question": "x", "n": 1}),
            ("POST", f"/artifacts/{aid}/confirm-upload", {}),
            ("POST", f"/artifacts/{pending['artifact_id']}/confirm-upload", {}),
            ("DELETE", f"/artifacts/{aid}", None),
            ("DELETE", f"/artifacts/{pending['artifact_id']}", None),
        ]:
            r = httpx.request(method, f"{local_server.url}{API}{route}", headers=h, json=body)
            if intruder == b and "/orgs/any/" in route:
                assert r.status_code == 403, r.text  # an API key's org is checked first
                continue
            assert r.status_code == 404, (method, route, r.text)
            assert error_of(r) == "not_found"
    # A's artifact and pending upload are intact.
    r = httpx.post(f"{local_server.url}{API}/artifacts/{aid}/download-url", headers=bearer(a))
    assert httpx.get(r.json()["download_url"]).content == qwen3_artifact.read_bytes()
    put_bytes(pending, qwen3_artifact.read_bytes())
    assert confirm(local_server.url, a, pending["artifact_id"]).status_code == 200


def test_signed_urls_refuse_tampering_and_expiry(local_server, org_key, small_kv):
    key = org_key("sig")
    plan = request_upload(local_server.url, key, small_kv).json()
    data = small_kv.read_bytes()
    url = httpx.URL(plan["url"])
    params = dict(url.params)
    tampered = {
        "signature": {**params, "sig": "0" * 64},
        "size": {**params, "size": str(int(params["size"]) + 1)},
        "expiry pushed later": {**params, "expires": str(int(params["expires"]) + 3600)},
        "op": {**params, "op": "get"},
        "missing signature": {k: v for k, v in params.items() if k != "sig"},
    }
    for what, query in tampered.items():
        r = httpx.put(url.copy_with(params=query), content=data)
        assert r.status_code == 403 and error_of(r) == "invalid_signature", what
    other_id = url.path.replace(plan["artifact_id"], "00000000-0000-4000-8000-000000000000")
    r = httpx.put(url.copy_with(path=other_id), content=data)
    assert r.status_code == 403 and error_of(r) == "invalid_signature"
    # The same URL used for a GET is refused too.
    assert httpx.get(url).status_code == 403
    # A correctly signed URL past its expiry (signed here with the server's key) is refused.
    from kvcdn_server.signing import UrlSigner

    signer = UrlSigner((local_server.data_dir / "url-signing-key").read_text().strip().encode())
    obj = url.path.split("/blobs/")[1]
    expired = url.copy_with(query=signer.query("put", obj, len(data), int(time.time()) - 5).encode())
    r = httpx.put(expired, content=data)
    assert r.status_code == 403 and error_of(r) == "url_expired"
    assert confirm(local_server.url, key, plan["artifact_id"]).status_code == 409  # nothing was stored
    assert httpx.put(url, content=data).status_code == 200


@pytest.mark.parametrize(
    "name",
    [
        "/abs.kv",
        "a//b.kv",
        "a/",
        "./a.kv",
        "a/./b.kv",
        "../up.kv",
        "..",
        "bad\x00name",
        "tab\tname",
        "back\\slash",
        " lead",
        "",
        "x" * 256,
        "del\x7f",
    ],
)
def test_bad_names_are_refused(local_server, org_key, small_kv, name):
    key = org_key("names")
    before = stored(local_server)
    r = request_upload(local_server.url, key, small_kv, name=name)
    assert r.status_code == 422 and error_of(r) == "invalid_name", r.text
    assert stored(local_server) == before


def test_oversized_bodies_are_refused(local_server, org_key, small_kv):
    key = org_key("big")
    before = stored(local_server)
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/upload-url",
        headers=bearer(key),
        content=b'{"name": "' + b"x" * (70 * 1024) + b'"}',
    )
    assert r.status_code == 413 and error_of(r) == "payload_too_large"

    def chunked():
        yield b'{"name": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{local_server.url}{API}/artifacts/upload-url", headers=bearer(key), content=chunked())
    assert r.status_code == 413
    r = request_upload(local_server.url, key, small_kv, size=(60 << 30))
    assert r.status_code == 413 and error_of(r) == "payload_too_large"
    r = httpx.post(
        f"{local_server.url}{API}/telemetry", json={"event": "command", "kvcdn_version": "0.1.0", "command": "x" * 9000}
    )
    assert r.status_code == 413
    # A blob body longer than signed: refused while streaming, nothing kept.
    plan = request_upload(local_server.url, key, small_kv).json()
    data = small_kv.read_bytes()

    def longer():
        yield data
        yield b"extra bytes"

    r = httpx.put(plan["url"], content=longer())
    assert r.status_code == 413 and error_of(r) == "payload_too_large"
    r = httpx.put(plan["url"], content=data + b"x")
    assert r.status_code == 413
    r = httpx.put(plan["url"], content=data[:-1])
    assert r.status_code == 422 and error_of(r) == "size_mismatch"
    assert {p for p in stored(local_server) - before if not p.endswith(".pending.json")} == set()
    assert not [p for p in (local_server.data_dir / "objects").rglob("*.tmp")]


def test_invalid_json_and_unknown_fields(local_server, org_key):
    key = org_key("json")
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/upload-url",
        headers={**bearer(key), "content-type": "application/json"},
        content=b"{nope",
    )
    assert r.status_code == 400 and error_of(r) == "invalid_json"
    r = httpx.post(f"{local_server.url}{API}/artifacts/upload-url", headers=bearer(key), json=[1, 2])
    assert r.status_code == 400
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/upload-url",
        headers=bearer(key),
        json={"name": "a.kv", "size_bytes": 1, "sha256": "0" * 64, "owner": "org:someone-else"},
    )
    assert r.status_code == 422 and error_of(r) == "validation_error"


@pytest.mark.parametrize("case", ["sha256", "not_kv", "manifest", "tokens_alias"])
def test_confirm_refuses_bytes_that_do_not_match(local_server, org_key, small_kv, tmp_path, case):
    key = org_key("confirm")
    before = stored(local_server)
    data = small_kv.read_bytes()
    if case == "sha256":
        plan = request_upload(local_server.url, key, small_kv, sha256="ab" * 32).json()
        expected = "sha256_mismatch"
    elif case == "not_kv":
        data = b"\x00" * len(data)
        junk = tmp_path / "junk.kv"
        junk.write_bytes(data)
        plan = request_upload(local_server.url, key, junk).json()
        expected = "not_a_kv_artifact"
    elif case == "manifest":
        plan = request_upload(local_server.url, key, small_kv, manifest={"architecture": "LlamaForCausalLM"}).json()
        expected = "manifest_mismatch"
    else:
        plan = request_upload(local_server.url, key, small_kv, manifest={"token_count": 9999}).json()
        expected = "manifest_mismatch"
    put_bytes(plan, data)
    r = confirm(local_server.url, key, plan["artifact_id"])
    assert r.status_code == 422 and error_of(r) == expected, r.text
    assert stored(local_server) == before
    listing = httpx.get(f"{local_server.url}{API}/artifacts", headers=bearer(key)).json()
    assert listing["artifacts"] == []


def test_confirm_states(local_server, org_key, small_kv):
    key = org_key("states")
    plan = request_upload(local_server.url, key, small_kv).json()
    r = confirm(local_server.url, key, plan["artifact_id"])
    assert r.status_code == 409 and error_of(r) == "upload_incomplete"
    put_bytes(plan, small_kv.read_bytes())
    assert confirm(local_server.url, key, plan["artifact_id"]).status_code == 200
    r = confirm(local_server.url, key, plan["artifact_id"])
    assert r.status_code == 409 and error_of(r) == "already_confirmed"
    # The upload URL, still within its expiry, cannot change the confirmed artifact.
    r = httpx.put(plan["url"], content=b"\x00" * small_kv.stat().st_size)
    assert r.status_code == 409
    d = httpx.post(f"{local_server.url}{API}/artifacts/{plan['artifact_id']}/download-url", headers=bearer(key))
    assert httpx.get(d.json()["download_url"]).content == small_kv.read_bytes()
    for bad in ("not-a-uuid", "..%2F..%2Fetc", "00000000-0000-4000-8000-000000000000"):
        assert confirm(local_server.url, key, bad).status_code == 404


def test_quota_at_upload_url(local_server, org_key, small_kv):
    key = org_key("quota")
    before = stored(local_server)
    plans = [request_upload(local_server.url, key, small_kv) for _ in range(3)]
    assert all(p.status_code == 200 for p in plans)
    r = request_upload(local_server.url, key, small_kv)  # pending uploads hold their place
    assert r.status_code == 403 and error_of(r) == "quota_exceeded"
    q = httpx.get(f"{local_server.url}{API}/quota", headers=bearer(key)).json()
    assert q["limits"]["artifacts"] == 3 and q["usage"]["pending_artifacts"] == 3
    for p in plans:
        assert (
            httpx.delete(
                f"{local_server.url}{API}/artifacts/{p.json()['artifact_id']}", headers=bearer(key)
            ).status_code
            == 204
        )
    r = request_upload(local_server.url, key, small_kv, size=(8 << 20) + 1)
    assert r.status_code == 403 and error_of(r) == "quota_exceeded"
    assert stored(local_server) == before
    # Another org's quota is its own.
    assert request_upload(local_server.url, org_key("quota-other"), small_kv).status_code == 200


def test_quota_holds_under_concurrent_upload_url_requests(local_server, org_key, small_kv):
    """16 upload-url requests at once on one server: exactly the quota's worth are granted."""
    from concurrent.futures import ThreadPoolExecutor

    key = org_key("quota-race")
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: request_upload(local_server.url, key, small_kv), range(16)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] * 3 + [403] * 13, statuses
    q = httpx.get(f"{local_server.url}{API}/quota", headers=bearer(key)).json()
    assert q["usage"]["pending_artifacts"] == 3
    for r in answers:
        if r.status_code == 200:
            httpx.delete(f"{local_server.url}{API}/artifacts/{r.json()['artifact_id']}", headers=bearer(key))


def test_older_clients_org_and_project(local_server, new_org, small_kv):
    slug = new_org("legacy")
    key = mint_key(local_server.url, local_server.admin_secret(), slug)
    ok = httpx.get(
        f"{local_server.url}{API}/whoami", headers={**bearer(key), "X-Kvcdn-Org": slug, "X-Kvcdn-Project": "whatever"}
    )
    assert ok.status_code == 200 and ok.json()["project"] == "default"
    r = httpx.get(f"{local_server.url}{API}/artifacts", params={"org": "someone-else"}, headers=bearer(key))
    assert r.status_code == 403 and error_of(r) == "forbidden"
    r = httpx.get(f"{local_server.url}{API}/whoami", headers={**bearer(key), "X-Kvcdn-Org": "someone-else"})
    assert r.status_code == 403


def test_telemetry_is_schema_checked(local_server):
    event = {
        "event": "command",
        "kvcdn_version": "0.1.0",
        "command": "upload",
        "ok": True,
        "duration_ms": 12.5,
        "props": {"size_bucket": "1MB"},
    }
    r = httpx.post(f"{local_server.url}{API}/telemetry", json=event)
    assert r.status_code == 204 and r.content == b""
    deadline = time.time() + budget(5)
    while time.time() < deadline and not any('"telemetry"' in line for line in local_server.log):
        time.sleep(0.05)
    line = next(line for line in local_server.log if '"telemetry"' in line)
    assert json.loads(line)["telemetry"]["command"] == "upload"
    for bad in (
        {**event, "secret": "x"},
        {"event": "Bad Event", "kvcdn_version": "0.1.0"},
        {"kvcdn_version": "0.1.0"},
        {**event, "props": {f"k{i}": i for i in range(21)}},
    ):
        r = httpx.post(f"{local_server.url}{API}/telemetry", json=bad)
        assert r.status_code == 422, bad
