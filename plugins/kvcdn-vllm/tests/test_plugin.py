"""The plugin without vLLM: it imports and registers its command where vLLM is absent, and the
scheduler-side pieces (settings, catalog) need no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvcdn_vllm.settings import Settings
from kvcdn_vllm.tier import WRITE_QUEUE_BYTES


def kvcdn(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "kvcdn_core", *args], capture_output=True, text=True, timeout=120, **kwargs
    )


def test_plugin_is_listed_and_imports_without_vllm_or_torch():
    probe = (
        "import sys, kvcdn_vllm, kvcdn_vllm.plugin, kvcdn_vllm.catalog, kvcdn_vllm.source, kvcdn_vllm.serve;"
        "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr
    listed = kvcdn("plugins", "--format", "json")
    assert listed.returncode == 0
    assert "vllm" in listed.stdout and "kvcdn-vllm" in listed.stdout


def test_vllm_serve_dry_run_builds_the_server_command(tmp_path):
    done = kvcdn(
        "vllm-serve",
        "--model",
        "some/model",
        "--source",
        str(tmp_path),
        "--min-tokens",
        "256",
        "--format",
        "json",
        "--dry-run",
        "--",
        "--max-model-len",
        "4096",
    )
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)["argv"]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KvcdnConnector" and config["kv_connector_module_path"] == "kvcdn_vllm"
    assert config["kv_connector_extra_config"] == {"source": str(tmp_path), "save": False, "min_tokens": 256}
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[-2:] == ["--max-model-len", "4096"]


def test_vllm_serve_with_a_chunk_store_passes_its_keys(tmp_path):
    done = kvcdn(
        "vllm-serve",
        "--model",
        "m",
        "--store",
        str(tmp_path),
        "--tier-memory-bytes",
        "1048576",
        "--save-queue",
        "2",
        "--tier-write-queue-bytes",
        "65536",
        "--save",
        "--format",
        "json",
        "--dry-run",
    )
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)["argv"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert config == {
        "store": str(tmp_path),
        "tier_memory_bytes": 1048576,
        "tier_write_queue_bytes": 65536,
        "save_queue": 2,
        "save": True,
    }
    Settings.parse(config, 16)  # what the command writes, the connector reads
    both = kvcdn("vllm-serve", "--model", "m", "--store", str(tmp_path), "--source", str(tmp_path), "--dry-run")
    assert both.returncode == 2 and "one of the two" in both.stderr and "Traceback" not in both.stderr


def test_vllm_serve_refuses_a_missing_source_in_one_line(tmp_path):
    done = kvcdn("vllm-serve", "--model", "m", "--source", str(tmp_path / "missing"), "--dry-run")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: source directory '{tmp_path / 'missing'}' does not exist"]


def test_settings_defaults_and_refusals():
    assert Settings.parse({"source": "/srv/kv"}, 128) == Settings("/srv/kv", False, 128)
    assert Settings.parse({"source": "s3://b/p", "save": "true", "min_tokens": 64}, 16) == Settings(
        "s3://b/p", True, 64
    )
    tiered = Settings.parse({"store": "s3://b/s", "save": True, "tier_memory_bytes": 1 << 20}, 16)
    assert (tiered.source, tiered.store, tiered.tier_memory_bytes, tiered.tier_disk_bytes) == (
        None,
        "s3://b/s",
        1 << 20,
        16 << 30,
    )
    assert tiered.tier_directory.endswith("vllm-tier") and tiered.save_queue == 4
    assert tiered.tier_write_queue_bytes == WRITE_QUEUE_BYTES  # as before the key existed: 1 GiB
    bounded = Settings.parse({"store": "s", "tier_write_queue_bytes": "65536"}, 16)
    assert bounded.tier_write_queue_bytes == 65536
    for extra, message in (
        ({}, "needs 'source'"),
        ({"source": "d", "store": "s"}, "one of the two"),
        ({"store": "s", "tier_disk_bytes": -1}, "tier_disk_bytes"),
        ({"store": "s", "save_queue": 0}, "save_queue"),
        ({"store": "s", "tier_write_queue_bytes": 0}, "'tier_write_queue_bytes' must be at least 1"),
        ({"store": "s", "tier_write_queue_bytes": "1G"}, "'tier_write_queue_bytes' must be an integer"),
        ({"store": "s", "tier_write_queue": 1}, "did you mean 'tier_write_queue_bytes'"),
        ({"source": "d", "save": 1}, "'save'"),
        ({"source": "d", "min_tokens": 0}, "min_tokens"),
        ({"source": "d", "sorce": "x"}, "unknown"),
    ):
        with pytest.raises(ValueError, match=message):
            Settings.parse(extra, 16)
