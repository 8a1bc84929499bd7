"""Command behaviour that needs no server: refusals before any request, --to/--from a local
directory through core's LocalStorage, and one-line errors."""

import os

import pytest
from click.testing import CliRunner

from kvcdn_core.cli.app import make_cli

KEY = "kv_" + "ab" * 32


def run(*args, input=None):
    return CliRunner().invoke(make_cli(), [str(a) for a in args], input=input)


def api_requests(receiver):
    return [r for r in receiver.requests if r[1] != "/api/v1/telemetry"]


def record(artifact_id, **fields):
    """An artifact as the server shows it (every field it always sends)."""
    return {
        "artifact_id": artifact_id,
        "name": artifact_id,
        "visibility": "private",
        "status": "ready",
        "size_bytes": 1,
        "sha256": "0" * 64,
        "created_at": "2026-12-01T00:00:00Z",
        "confirmed_at": "2026-12-01T00:00:01Z",
        "confirmed_at_unix": 1796083201.0,
        "manifest": None,
        "customer_id": "org:acme",
        "dtype": None,
        "storage_dtype": None,
        "num_tokens": None,
        "num_layers": None,
        "quantized": False,
        **fields,
    }


@pytest.fixture
def endpoint(receiver, config_home, monkeypatch):
    monkeypatch.setenv("KVCDN_API_URL", receiver.url)
    monkeypatch.setenv("KVCDN_API_KEY", KEY)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    return receiver


@pytest.mark.parametrize("make", ["txt", "garbage-kv", "missing", "directory"])
def test_upload_refuses_before_any_request(endpoint, tmp_path, make):
    path = {
        "txt": tmp_path / "doc.txt",
        "garbage-kv": tmp_path / "doc.kv",
        "missing": tmp_path / "none.kv",
        "directory": tmp_path / "dir.kv",
    }[make]
    if make == "txt":
        path.write_text("hello")
    elif make == "garbage-kv":
        path.write_bytes(b"\x00" * 64)
    elif make == "directory":
        path.mkdir()
    result = run("upload", path, "--name", "x")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert api_requests(endpoint) == []


def test_unreadable_kv_is_refused(endpoint, kv_file, monkeypatch):
    real_access = os.access
    # the tests may run as root, who reads any file: make this one unreadable to the check itself
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(kv_file) else real_access(p, mode))
    result = run("upload", kv_file, "--name", "x")
    assert result.exit_code == 2 and "not readable" in result.stderr
    assert api_requests(endpoint) == []


def test_401_says_how_to_log_in(endpoint):
    endpoint.routes[("GET", "/api/v1/artifacts")] = lambda h: (
        401,
        {},
        {"error": "unauthorized", "message": "unknown API key"},
    )
    result = run("list")
    assert result.exit_code == 2
    assert "unknown API key" in result.stderr and "kvcdn login" in result.stderr and "api-key set" in result.stderr


def test_other_failures_say_what_the_server_said(endpoint):
    endpoint.routes[("GET", "/api/v1/quota")] = lambda h: (
        500,
        {},
        {"error": "internal_error", "message": "something broke"},
    )
    result = run("quota")
    assert result.exit_code == 2 and result.stderr == "error: quota: the server answered 500: something broke\n"


def test_list_follows_pagination(endpoint):
    pages = {None: (["a", "b"], "c1"), "c1": (["c"], "c2"), "c2": ([], None)}

    def listing(h):
        import urllib.parse

        cursor = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(h.path).query)).get("cursor")
        ids, nxt = pages[cursor]
        return 200, {}, {"artifacts": [record(i) for i in ids], "next_cursor": nxt}

    endpoint.routes[("GET", "/api/v1/artifacts")] = listing
    result = run("list", "--format", "ids")
    assert result.exit_code == 0 and result.stdout.split() == ["a", "b", "c"]
    headers = endpoint.requests[0][2]
    assert headers["Authorization"] == f"Bearer {KEY}"


def test_local_directory_round_trip(config_home, kv_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    up = run("upload", kv_file, "--name", "manual", "--to", store)
    assert up.exit_code == 0, up.stderr
    assert up.stdout.strip() == "manual.kv" and (store / "manual.kv").read_bytes() == kv_file.read_bytes()
    listed = run("list", "--from", store, "--format", "ids")
    assert listed.stdout.split() == ["manual.kv"]
    got = run("download", "manual.kv", "--from", store, "--output", tmp_path / "back")
    assert got.exit_code == 0, got.stderr
    assert (tmp_path / "back.kv").read_bytes() == kv_file.read_bytes()  # the .kv suffix rule
    assert "appending '.kv'" in got.stderr
    again = run("download", "manual.kv", "--from", store, "--output", tmp_path / "back.kv")
    assert again.exit_code == 2 and "--force" in again.stderr
    refused = run("delete", "manual.kv", "--from", store)
    assert refused.exit_code == 2 and "--yes" in refused.stderr
    assert run("delete", "manual.kv", "--from", store, "--yes").exit_code == 0
    assert not (store / "manual.kv").exists()


def test_local_download_of_a_non_kv_leaves_nothing(config_home, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "bad.kv").write_bytes(b"\x01" * 40)
    out = tmp_path / "out"
    out.mkdir()
    result = run("download", "bad.kv", "--from", store, "--output", out / "bad.kv")
    assert result.exit_code == 1 and "not a valid .kv" in result.stderr  # a failed check
    assert os.listdir(out) == []


def test_hosted_backend_is_registered():
    from kvcdn_core.plugin_host.manager import PluginHost
    from kvcdn_hosted.storage import HostedStorage

    backends = PluginHost().storage_backends()
    assert backends["kvcdn"] is HostedStorage and backends["kvcdn+https"] is HostedStorage
    assert backends["file"].__name__ == "LocalStorage"


def test_cli_start_up_is_torch_free():
    import subprocess
    import sys

    code = (
        "import sys; from kvcdn_core.cli.app import make_cli; make_cli(); "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["list", "--help"], ["upload", "--help"], ["quota", "--help"]])
def test_hosted_help_loads_no_pydantic_nor_httpx(args):
    """The wire contract's routes and codes are standard library: a command's --help (and start-up)
    does not pay for the response models or the HTTP client."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom kvcdn_core.cli.app import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('pydantic', 'httpx', 'kvcdn_wire.responses') if m in sys.modules], file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


def test_api_key_verify_of_a_rejected_key_is_a_failed_check(endpoint):
    endpoint.routes[("POST", "/api/v1/api-keys/verify")] = lambda h: (
        401,
        {},
        {"error": "unauthorized", "message": "invalid API key"},
    )
    result = run("api-key", "verify")
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "rejects the API key" in result.stderr and "kvcdn login" not in result.stderr
    endpoint.routes[("POST", "/api/v1/api-keys/verify")] = lambda h: (
        200,
        {},
        {"org": "acme", "customer_id": "org:acme", "method": "api_key"},
    )
    assert run("api-key", "verify").exit_code == 0


def _grant(url):
    return {
        "artifact_id": "11111111-1111-4111-8111-111111111111",
        "method": "PUT",
        "url": url + "/put",
        "headers": {"Content-Type": "application/octet-stream"},
        "expires_at": "2026-12-01T00:15:00Z",
        "multipart": None,
    }


def test_upload_url_is_not_sent_twice(endpoint, kv_file, monkeypatch):
    """A POST that may have been processed (a 503 after it arrived) is not retried: no second reservation."""
    from kvcdn_hosted import client

    monkeypatch.setattr(client, "BACKOFF_BASE_S", 0.001)
    endpoint.routes[("POST", "/api/v1/artifacts/upload-url")] = lambda h: (
        503,
        {},
        {"error": "busy", "message": "busy"},
    )
    result = run("upload", kv_file, "--name", "x")
    assert result.exit_code == 2 and endpoint.count("POST", "/api/v1/artifacts/upload-url") == 1
    # A 429 says the request was not processed: that one is sent again.
    answers = [
        (429, {"Retry-After": "0"}, {"error": "rate_limited", "message": "slow down"}),
        (403, {}, {"error": "quota_exceeded", "message": "quota"}),
    ]
    endpoint.routes[("POST", "/api/v1/artifacts/upload-url")] = lambda h: answers.pop(0)
    assert run("upload", kv_file, "--name", "x").exit_code == 2 and answers == []


def test_a_retried_confirm_that_finds_the_upload_confirmed_succeeds(endpoint, kv_file, monkeypatch):
    """The first confirm's answer is lost (a 504 from a proxy); the retry's 409 already_confirmed is success."""
    import hashlib
    import json

    from kvcdn_hosted import client, storage

    monkeypatch.setattr(client, "BACKOFF_BASE_S", 0.001)
    monkeypatch.setattr(storage, "CONFIRM_POLL_S", 0.01)
    grant = _grant(endpoint.url)
    aid = grant["artifact_id"]
    data = kv_file.read_bytes()
    shown = record(
        aid,
        name="x",
        status="confirming",  # what the server shows while the first confirm still runs
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
    )
    timeouts = []
    real_request = client.HostedClient.request

    def spy(self, method, path, **kwargs):
        if path.endswith("/confirm-upload"):
            timeouts.append(kwargs.get("timeout"))
        return real_request(self, method, path, **kwargs)

    monkeypatch.setattr(client.HostedClient, "request", spy)
    confirms = [
        (504, {}, {"error": "gateway_timeout", "message": "upstream timed out"}),
        (409, {}, {"error": "already_confirmed", "message": "being or has been confirmed"}),
    ]
    reads = []

    def describe(h):
        reads.append(1)
        if len(reads) > 1:  # the first confirm finishes while the client waits
            shown["status"] = "ready"
        return 200, {}, dict(shown)

    endpoint.routes[("POST", "/api/v1/artifacts/upload-url")] = lambda h: (200, {}, grant)
    endpoint.routes[("PUT", "/put")] = lambda h: (200, {}, {})
    endpoint.routes[("POST", f"/api/v1/artifacts/{aid}/confirm-upload")] = lambda h: confirms.pop(0)
    endpoint.routes[("GET", f"/api/v1/artifacts/{aid}")] = describe
    result = run("upload", kv_file, "--name", "x", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["artifact_id"] == aid and confirms == [] and len(reads) == 2
    assert timeouts == [storage.confirm_timeout(len(data))]
    assert storage.confirm_timeout(10 << 30) > 500  # a 10 GiB object gets minutes, not 60 s


def test_an_upload_url_refused_503_database_unavailable_is_sent_again(endpoint, kv_file, monkeypatch):
    """That code says the server changed nothing (its database was away): a POST is sent again."""
    import hashlib

    grant = _grant(endpoint.url)
    aid = grant["artifact_id"]
    data = kv_file.read_bytes()
    confirmed = record(aid, name="x", sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    answers = [(503, {"Retry-After": "0"}, {"error": "database_unavailable", "message": "try again"})] * 2 + [
        (200, {}, grant)
    ]
    endpoint.routes[("POST", "/api/v1/artifacts/upload-url")] = lambda h: answers.pop(0)
    endpoint.routes[("PUT", "/put")] = lambda h: (200, {}, {})
    endpoint.routes[("POST", f"/api/v1/artifacts/{aid}/confirm-upload")] = lambda h: (200, {}, confirmed)
    result = run("upload", kv_file, "--name", "x")
    assert result.exit_code == 0, result.output
    assert answers == [] and endpoint.count("POST", "/api/v1/artifacts/upload-url") == 3


def test_a_confirm_handed_back_after_an_outage_is_confirmed_again(endpoint, kv_file, monkeypatch):
    """The confirm's last transaction failed and so did its hand-back: 503, then the retry finds it
    still confirming (409) until its lease runs out and it shows as pending again: confirm again."""
    import hashlib

    from kvcdn_hosted import storage

    monkeypatch.setattr(storage, "CONFIRM_POLL_S", 0.01)
    grant = _grant(endpoint.url)
    aid = grant["artifact_id"]
    data = kv_file.read_bytes()
    shown = record(aid, name="x", sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    confirms = [
        (503, {"Retry-After": "0"}, {"error": "database_unavailable", "message": "try again"}),
        (409, {}, {"error": "confirm_in_progress", "message": "being confirmed"}),
        (200, {}, {**shown, "status": "ready"}),
    ]
    states = ["confirming", "confirming", "pending"]
    endpoint.routes[("POST", "/api/v1/artifacts/upload-url")] = lambda h: (200, {}, grant)
    endpoint.routes[("PUT", "/put")] = lambda h: (200, {}, {})
    endpoint.routes[("POST", f"/api/v1/artifacts/{aid}/confirm-upload")] = lambda h: confirms.pop(0)
    endpoint.routes[("GET", f"/api/v1/artifacts/{aid}")] = lambda h: (200, {}, {**shown, "status": states.pop(0)})
    result = run("upload", kv_file, "--name", "x")
    assert result.exit_code == 0, result.output
    assert confirms == [] and states == []


def test_credentials_over_plain_http_to_a_remote_host_warn_once(config_home, monkeypatch):
    from kvcdn_hosted import client
    from kvcdn_hosted.config import load_settings

    assert client.insecure_remote("http://kv.example.com") and client.insecure_remote("http://10.0.0.5:8080")
    assert not client.insecure_remote("https://kv.example.com") and not client.insecure_remote("http://127.0.0.1:8")
    assert not client.insecure_remote("http://localhost:8080") and not client.insecure_remote("http://[::1]:8")
    monkeypatch.setenv("KVCDN_API_KEY", KEY)
    monkeypatch.setenv("KVCDN_API_URL", "http://192.0.2.1:9")
    monkeypatch.setattr(client, "_warned_plain_http", set())
    from kvcdn_core import KvcdnWarning

    with client.HostedClient(load_settings()) as c, pytest.warns(KvcdnWarning) as seen:
        c._warn_plain_http()
        c._warn_plain_http()
    assert len(seen) == 1 and "plain http" in str(seen[0].message)


def test_long_listing_of_a_plain_store_reads_each_header(config_home, kv_file, tmp_path):
    """`list --long` showed QUANT none for a quantized artifact in a local store: it never read one."""
    from kvcdn_core import artifact, quantizer_for
    from kvcdn_core.quant.codec import quantize_cache

    store = tmp_path / "store"
    store.mkdir()
    header = artifact.read_header(kv_file)
    result = quantize_cache(header.manifest, artifact.load_tensors(header), quantizer_for("int8")())
    artifact.write_artifact(store / "small.kv", result.manifest, result.tensors)
    (store / "plain.kv").write_bytes(kv_file.read_bytes())
    (store / "junk.kv").write_bytes(b"\x01" * 40)
    listed = run("list", "--from", store, "--long")
    assert listed.exit_code == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert rows["small.kv"][-3:-1] == ["float32", "int8"]
    assert rows["plain.kv"][-3:-1] == ["float32", "none"]
    assert rows["junk.kv"][-3:-1] == ["-", "-"]  # no readable header: unknown, not "none"


def test_upload_names_the_artifact_after_its_file_by_default(config_home, kv_file, tmp_path):
    store = tmp_path / "store"
    up = run("upload", kv_file, "--to", store)  # kv_file is doc.kv
    assert up.exit_code == 0, up.stderr
    assert up.stdout.strip() == "doc.kv" and (store / "doc.kv").read_bytes() == kv_file.read_bytes()


def test_download_into_an_existing_directory_writes_inside_it(config_home, kv_file, tmp_path):
    store, folder = tmp_path / "store", tmp_path / "into"
    folder.mkdir()
    assert run("upload", kv_file, "--name", "manual", "--to", store).exit_code == 0
    got = run("download", "manual.kv", "--from", store, "--output", folder)
    assert got.exit_code == 0, got.stderr
    assert got.stdout.strip() == str(folder / "manual.kv")
    assert (folder / "manual.kv").read_bytes() == kv_file.read_bytes()
    assert not (tmp_path / "into.kv").exists() and "appending" not in got.stderr
    again = run("download", "manual.kv", "--from", store, "--output", folder)
    assert again.exit_code == 2 and "--force" in again.stderr and again.stderr.count("\n") == 1


def test_download_checks_its_output_before_any_request(endpoint, tmp_path):
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "copy.kv"
    got = run("download", "some-id", "--output", target)
    assert got.exit_code == 2 and got.stderr.count("\n") == 1
    assert f"cannot write '{target}'" in got.stderr and "is not a directory" in got.stderr
    assert api_requests(endpoint) == []


@pytest.mark.parametrize(
    "status, body",
    [(404, b"<html><body><h1>Not Found</h1><p>The page is not here.</p></body></html>"), (200, b"<html>hi</html>")],
)
def test_a_server_that_is_not_kvcdn_is_named_as_such(endpoint, status, body):
    endpoint.routes[("GET", "/api/v1/artifacts")] = lambda h: (status, {"Content-Type": "text/html"}, body)
    result = run("list")
    assert result.exit_code == 2
    assert result.stderr == f"error: list: not a kvcdn server (HTTP {status} from {endpoint.url}/api/v1/artifacts)\n"


def test_delete_and_download_speak_json(config_home, kv_file, tmp_path, monkeypatch):
    """Every command that reports has --format json; delete, download and login had none."""
    import json

    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    assert run("upload", kv_file, "--to", store).exit_code == 0
    got = run("download", "doc.kv", "--from", store, "--output", tmp_path / "back.kv", "--format", "json")
    assert got.exit_code == 0, got.stderr
    data = json.loads(got.stdout)
    assert data["path"] == str(tmp_path / "back.kv") and data["size_bytes"] == kv_file.stat().st_size
    gone = run("delete", "doc.kv", "--from", store, "--yes", "--format", "json")
    assert gone.exit_code == 0, gone.stderr
    assert json.loads(gone.stdout) == {"artifact_id": "doc.kv", "deleted": True}
    assert "--format" in run("login", "--help").stdout


def test_infer_q_is_the_old_spelling_of_question(endpoint):
    """-q is --quiet everywhere else: infer takes --question, and -q still works one release with a warning."""
    answer = {
        "artifact_id": "abc",
        "tokens": [1],
        "token_count": 1,
        "text": " yes",
        "model": "m",
        "reused_tokens": 4,
        "question_tokens": 2,
    }
    endpoint.routes[("POST", "/api/v1/artifacts/abc/infer")] = lambda h: (200, {}, answer)
    old = run("infer", "abc", "-q", "Why?", "--n", "1")
    assert old.exit_code == 0, old.stderr
    assert "warning: infer -q is deprecated" in old.stderr and old.stdout.strip() == "yes"
    missing = run("infer", "abc")
    assert missing.exit_code == 2 and "--question" in missing.stderr


def test_hosted_commands_leave_their_errors_to_cores_handler(endpoint):
    """One error handler: a hosted command's error reaches core's command group, which writes the one
    line every kvcdn command writes (the hosted commands had a second handler, with its own wording)."""
    import click

    from kvcdn_core import KvcdnError
    from kvcdn_hosted.commands import quota

    endpoint.routes[("GET", "/api/v1/quota")] = lambda h: (500, {}, {"error": "internal_error", "message": "broke"})
    bare = CliRunner().invoke(click.Group(commands=[quota]), ["quota"])
    assert isinstance(bare.exception, KvcdnError) and bare.stderr == ""
    through_core = run("quota")
    assert through_core.exit_code == 2 and through_core.stderr == "error: quota: the server answered 500: broke\n"


def test_an_unexpected_answer_is_one_line_from_cores_handler(endpoint):
    """A listing whose entries are not objects: one line naming the error, exit 2, no traceback."""
    endpoint.routes[("GET", "/api/v1/artifacts")] = lambda h: (200, {}, {"artifacts": ["a\nb"], "next_cursor": None})
    result = run("list")
    assert result.exit_code == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
