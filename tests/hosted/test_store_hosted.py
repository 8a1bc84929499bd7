"""``kvcdn store --store kvcdn://`` against a real ``kvcdn serve``: the chunk-store commands through
the hosted chunk routes, reporting bytes moved and saved as a local chunk store does."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tests.hosted.test_chunked import write_kv

PER_TOKEN = 2 * 2 * 2 * 4 * 4  # layers x (key, value) x heads x width x float32 bytes


def test_store_put_get_ls_inspect_rm_against_a_real_server(tmp_path, monkeypatch):
    from kvcdn_core.cli.app import make_cli
    from tests.support import services
    from tests.support.hosted import mint_key

    # 256-token chunks (the default): two files sharing a 512-token prefix
    first = write_kv(tmp_path / "first.kv", 600, base_tokens=900, width=4)
    second = write_kv(tmp_path / "second.kv", 900, base_tokens=900, width=4)
    with services.kvcdn_server(tmp_path / "home") as server:
        key = mint_key(server.url, server.admin_secret(), "storer")
        for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("KVCDN_TELEMETRY", "0")
        monkeypatch.setenv("KVCDN_API_URL", server.url)
        monkeypatch.setenv("KVCDN_API_KEY", key)

        def run(*args):
            return CliRunner().invoke(make_cli(), [str(a) for a in args])

        def kv(*args):
            result = run(*args, "--store", "kvcdn://", "--format", "json")
            assert result.exit_code == 0, (result.stdout, result.stderr)
            return json.loads(result.stdout)

        def refused(*args) -> str:
            result = run(*args, "--store", "kvcdn://")
            assert result.exit_code == 2, (result.stdout, result.stderr)
            assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
            return result.stderr

        one = kv("store", "put", first, "--name", "doc")
        assert (one["chunks"], one["chunks_new"], one["chunks_shared"], one["bytes_saved"]) == (3, 3, 0, 0)
        # only what the server lacks moves: conv's chunk 2 (tokens 512-768) is built on doc's stored
        # partial chunk (tokens 512-600) as its first piece, so only tokens 600-900 and the tail move
        two = kv("store", "put", second, "--name", "conv")
        assert (two["chunks"], two["chunks_new"], two["chunks_shared"], two["chunks_pieced"]) == (4, 2, 2, 1)
        assert two["bytes_saved"] == 600 * PER_TOKEN
        assert two["bytes_moved"] == (900 - 600) * PER_TOKEN + 900 * 8  # its own rows and its tail
        assert "exists in the store" in refused("store", "put", first, "--name", "doc")
        again = kv("store", "put", first, "--name", "doc", "--force")  # everything already there
        assert again["bytes_moved"] == 0 and again["chunks_new"] == 0

        got = kv("store", "get", "conv", "-o", tmp_path / "conv.kv")
        assert (tmp_path / "conv.kv").read_bytes() == second.read_bytes()
        assert got["bytes_fetched"] > 0 and got["file_bytes"] == second.stat().st_size
        listed = {r["name"]: r for r in kv("store", "ls")}
        assert sorted(listed) == ["conv", "doc"]
        assert (listed["doc"]["chunks"], listed["doc"]["shared_chunks"], listed["doc"]["tokens"]) == (3, 3, 600)
        assert (listed["conv"]["chunks"], listed["conv"]["shared_chunks"], listed["conv"]["tokens"]) == (4, 3, 900)
        shown = kv("store", "inspect", "conv")  # chunk 2 shows as its two pieces, the first doc's
        assert shown["name"] == "conv" and shown["shared_chunks"] == 3
        rows = [(r["chunk"], r["tokens"], r["shared_with"]) for r in shown["chunks"] if r["chunk"] is not None]
        assert rows == [
            (0, [0, 256], 1),
            (1, [256, 512], 1),
            (2, [512, 600], 1),
            (2, [600, 768], 0),
            (3, [768, 900], 0),
        ]

        # the server checks and collects its own chunks: refused in one line that says why
        assert "hosted service" in refused("store", "check")
        assert "hosted service" in refused("store", "gc")

        assert kv("store", "rm", "doc") == {"name": "doc", "removed": True}
        assert [r["name"] for r in kv("store", "ls")] == ["conv"]
        assert "no artifact 'doc'" in refused("store", "get", "doc", "-o", tmp_path / "gone.kv")
        kv("store", "get", "conv", "-o", tmp_path / "again.kv")
        assert (tmp_path / "again.kv").read_bytes() == second.read_bytes()
