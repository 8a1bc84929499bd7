"""The connector's save queue publishing to a real ``kvcdn serve`` (SQLite, local storage), through
the store's own chunk store (the backend's ``chunk_store`` capability, as the connector opens it):
only the chunks the service lacks are uploaded, another engine's lookup finds the saved prompt, a
refused save (over quota) is one warning line, and a service unreachable at start and again mid-run
is one warning line per outage, with the saves working again once it is back (same port, same data).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvcdn_vllm import lookup
from kvcdn_vllm.saver import SaveQueue, SaveTarget
from kvcdn_vllm.writer import SavedModel

from kvcdn_core import artifact, open_storage
from kvcdn_core.store.chunkstore import open_chunk_store
from tests.support import services
from tests.support.hosted import mint_key
from tests.support.storefiles import layer_pieces, write_kinds

FINGERPRINT = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": None}
ROOT = lookup.engine_root(FINGERPRINT, "float32")
SEED = "hosted-save-seed-" + "0" * 32
SECRET = "hosted-save-admin-" + "1" * 32
#: one seed and admin secret: the org's key is the same on every start of the server
SERVER_ENV = {"KVCDN_API_KEY_SEED": SEED, "KVCDN_ADMIN_SECRET": SECRET, "KVCDN_TELEMETRY": "0"}


@pytest.fixture
def client_env(monkeypatch):
    """The engine's side: no admin secret, no issuer; the API key is set per test."""
    for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL", "KVCDN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    return monkeypatch


class Saves:
    """A :class:`SaveQueue` on the service at ``url`` as the connector opens it, and what it said."""

    def __init__(self, url: str, capacity: int = 4, block_size: int | None = None):
        self.warnings: list[str] = []
        self.infos: list[str] = []
        self.reports: list = []
        self.backend = open_storage("kvcdn+" + url)
        done = lambda name, report: self.reports.append(report)  # noqa: E731
        model = SavedModel("example/tiny", None, "no-model", FINGERPRINT, None)
        target = SaveTarget("kvcdn+" + url, model, block_size)
        self.queue = SaveQueue(target, capacity, self.warnings.append, done, self.infos.append)

    def save(self, name: str, path: Path) -> None:
        """Hand over the layers of the artifact at ``path`` as the connector does, and wait for the save."""
        tensors = artifact.load_tensors(artifact.read_header(path))
        assert self.queue.save(name, tensors[artifact.TOKEN_IDS].tolist(), layer_pieces(tensors))
        self.queue.join()

    def close(self) -> None:
        self.queue.close()
        self.backend.close()


def kinds(path: Path, tokens: int, seed: int, prefix_of: dict | None = None) -> dict:
    return write_kinds(path, ["full_attention"] * 3, tokens, seed=seed, prefix_of=prefix_of)


def test_saves_upload_only_new_chunks_and_a_refused_save_is_one_line(tmp_path, client_env):
    env = {**SERVER_ENV, "KVCDN_QUOTA_ARTIFACTS": "2"}
    with services.kvcdn_server(tmp_path / "home", env=env) as server:
        client_env.setenv("KVCDN_API_KEY", mint_key(server.url, SECRET, "fleet"))
        saves = Saves(server.url)
        first = kinds(tmp_path / "turn1.kv", 512, 1)
        second = kinds(tmp_path / "turn2.kv", 700, 2, prefix_of=first)
        kinds(tmp_path / "other.kv", 300, 3)
        saves.save("turn1", tmp_path / "turn1.kv")
        saves.save("turn2", tmp_path / "turn2.kv")
        one, two = saves.reports
        assert (one.chunks, one.chunks_new) == (2, 2)
        assert (two.chunks, two.chunks_new) == (3, 1)  # turn 1's two chunks were on the service
        assert two.bytes_moved < one.bytes_moved
        # another engine's lookup finds the longest saved prefix
        finder = lookup.open_lookup("kvcdn+" + server.url, ROOT, print)
        ids = second[artifact.TOKEN_IDS].tolist()
        match = finder.lookup(ids[:650] + [1, 2])
        assert match is not None and (match.name, match.prefix_tokens) == ("turn2", 650)
        # a third artifact is over the org's quota: the service refuses it, one line, nothing raised
        saves.save("other", tmp_path / "other.kv")
        assert len(saves.warnings) == 1
        assert saves.warnings[0].startswith("not saving other: chunked upload failed (4")
        assert (saves.queue.saved, saves.queue.failed) == (2, 1)
        saves.close()
        finder.backend.close()


def test_a_hosted_save_cuts_its_last_chunk_where_the_prompts_last_partial_block_starts(tmp_path, client_env):
    """As into a local chunk store: 700 tokens in blocks of 128, the last chunk cut at 640; the
    next turn (800 tokens), with rows 640-700 recomputed to other bits, references 512-640 and
    sends 640-768 as a piece of its own."""
    with services.kvcdn_server(tmp_path / "home", env=SERVER_ENV) as server:
        client_env.setenv("KVCDN_API_KEY", mint_key(server.url, SECRET, "cut"))
        saves = Saves(server.url, block_size=128)
        first = kinds(tmp_path / "turn1.kv", 700, 1)
        saves.save("turn1", tmp_path / "turn1.kv")
        recomputed = {name: t.clone() for name, t in first.items()}
        for i in range(3):
            for role in ("key", "value"):
                recomputed[f"layers.{i}.{role}"][..., 640:700, :] += 1e-6
        kinds(tmp_path / "turn2.kv", 800, 2, prefix_of=recomputed)
        saves.save("turn2", tmp_path / "turn2.kv")
        store = open_chunk_store(saves.backend)
        one, two = (store.record(name).chunks[2] for name in ("turn1", "turn2"))  # tokens 512-768
        assert [p.tokens for p in one.pieces] == [128, 60]
        assert two.pieces[0].digest == one.pieces[0].digest
        assert [p.tokens for p in two.pieces] == [128, 128]
        assert saves.warnings == []
        saves.close()


def test_saves_of_a_conversation_build_each_turn_on_the_stored_pieces_of_the_last(tmp_path, client_env):
    """Every turn of a conversation saved as the connector saves it: each turn's first new chunk is
    built on the previous turn's stored partial chunk, so the service holds every row once (only the
    final turn's objects and every turn's tail), and every turn's tensors come back bitwise."""
    import random

    rng = random.Random(0)
    with services.kvcdn_server(tmp_path / "home", env=SERVER_ENV) as server:
        client_env.setenv("KVCDN_API_KEY", mint_key(server.url, SECRET, "chat"))
        saves = Saves(server.url)
        paths, tensors, tokens = [], None, 0
        for t in range(6):
            tokens += rng.randint(100, 300)
            paths.append(tmp_path / f"turn{t}.kv")
            tensors = kinds(paths[-1], tokens, 10 + t, prefix_of=tensors)
            saves.save(f"turn{t}", paths[-1])
        assert saves.warnings == [] and all(r.chunks_pieced >= 1 for r in saves.reports[1:])
        store = open_chunk_store(saves.backend)
        records = [store.record(f"turn{t}") for t in range(6)]
        kept = {p.name for p in (tmp_path / "home" / "kvcdn" / "server" / "objects" / "chunks").iterdir()}
        assert kept == set(records[-1].digests) | {r.tail.digest for r in records}
        for t, path in enumerate(paths):
            store.get(f"turn{t}", tmp_path / "got.kv")
            got, sent = (artifact.load_tensors(artifact.read_header(p)) for p in (tmp_path / "got.kv", path))
            assert got.keys() == sent.keys() and all(torch.equal(got[n], sent[n]) for n in sent)
        saves.close()


def test_a_service_down_at_start_and_mid_run_is_one_warning_line_per_outage(tmp_path, client_env):
    from kvcdn_server.apikeys import derive_key

    port = services.free_port()
    url = f"http://127.0.0.1:{port}"
    key = derive_key(SEED.encode(), "fleet")
    client_env.setenv("KVCDN_API_KEY", key)
    saves = Saves(url)  # the engine starts while the service is down
    kinds(tmp_path / "base.kv", 300, 1)
    for i in range(2):
        saves.save(f"early{i}", tmp_path / "base.kv")
    assert len(saves.warnings) == 1 and saves.warnings[0].startswith("not saving early0: ")
    assert "counted, not logged" in saves.warnings[0]
    home = tmp_path / "home"
    with services.kvcdn_server(home, env=SERVER_ENV, port=port) as server:
        assert mint_key(server.url, SECRET, "fleet") == key
        saves.save("up", tmp_path / "base.kv")
        assert saves.infos == ["saving to the store works again; 2 saves failed meanwhile"]
    for i in range(3):  # the service went away mid-run
        saves.save(f"down{i}", tmp_path / "base.kv")
    assert len(saves.warnings) == 2 and saves.warnings[1].startswith("not saving down0: ")
    with services.kvcdn_server(home, env=SERVER_ENV, port=port):  # back, with its data
        saves.save("back", tmp_path / "base.kv")
        assert saves.infos[1:] == ["saving to the store works again; 3 saves failed meanwhile"]
        names = [listed.name for listed in open_chunk_store(saves.backend).listing()]
    assert names == ["back", "up"]
    assert (saves.queue.saved, saves.queue.failed, saves.queue.skipped) == (2, 5, 0)
    assert len(saves.warnings) == 2
    saves.close()
