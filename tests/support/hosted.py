"""Small HTTP helpers for tests that talk to ``kvcdn serve`` directly (no kvcdn client involved)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx

API = "/api/v1"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def mint_key(base_url: str, admin_secret: str, slug: str) -> str:
    r = httpx.post(
        f"{base_url}{API}/admin/api-keys", json={"org_slug": slug}, headers={"X-Kvcdn-Admin-Secret": admin_secret}
    )
    assert r.status_code == 200, r.text
    return r.json()["api_key"]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def request_upload(
    base_url: str,
    token: str,
    path: Path,
    name: str | None = None,
    visibility: str = "private",
    manifest: dict | None = None,
    sha256: str | None = None,
    size: int | None = None,
) -> httpx.Response:
    body = {
        "name": name if name is not None else Path(path).name,
        "size_bytes": size if size is not None else Path(path).stat().st_size,
        "sha256": sha256 or sha256_of(path),
        "visibility": visibility,
    }
    if manifest is not None:
        body["manifest"] = manifest
    return httpx.post(f"{base_url}{API}/artifacts/upload-url", json=body, headers=bearer(token))


def put_bytes(plan: dict, data: bytes) -> dict | None:
    """Send ``data`` as ``plan`` (an upload-url answer) says; return the confirm body."""
    if plan["multipart"] is None:
        r = httpx.put(plan["url"], content=data, headers=plan["headers"], timeout=60)
        assert r.status_code == 200, r.text
        return None
    parts = []
    mp = plan["multipart"]
    for part in mp["parts"]:
        start = (part["part_number"] - 1) * mp["part_size"]
        r = httpx.put(part["url"], content=data[start : start + part["size"]], timeout=60)
        assert r.status_code == 200, r.text
        parts.append({"part_number": part["part_number"], "etag": r.headers["ETag"]})
    return {"parts": parts}


def confirm(base_url: str, token: str, artifact_id: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{base_url}{API}/artifacts/{artifact_id}/confirm-upload", json=body or {}, headers=bearer(token), timeout=60
    )


def upload(base_url: str, token: str, path: Path, **kwargs) -> dict:
    """upload-url, PUT (single or multipart), confirm; return the confirmed artifact object."""
    r = request_upload(base_url, token, path, **kwargs)
    assert r.status_code == 200, r.text
    plan = r.json()
    body = put_bytes(plan, Path(path).read_bytes())
    done = confirm(base_url, token, plan["artifact_id"], body)
    assert done.status_code == 200, done.text
    return done.json()


def write_synthetic_kv(
    path: Path, tokens: int = 8, width: int = 8, model_id: str = "example/not-allowed", seed: int = 0
) -> Path:
    """A complete `.kv` (2 full-attention layers) written by core's writer, of any size."""
    import torch

    from kvcdn_core import artifact

    g = torch.Generator().manual_seed(seed)
    tensors = {"token_ids": torch.arange(tokens, dtype=torch.int64)}
    layers = []
    for i in range(2):
        k, v = f"layers.{i}.key", f"layers.{i}.value"
        tensors[k] = torch.randn(1, 2, tokens, width, generator=g)
        tensors[v] = torch.randn(1, 2, tokens, width, generator=g)
        layers.append({"index": i, "kind": "full_attention", "tensors": {"key": k, "value": v}})
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00Z",
        "model": {"id": model_id, "architecture": "Qwen3ForCausalLM", "family": "qwen"},
        "compute_dtype": "float32",
        "layers": layers,
        "quantization": None,
    }
    return artifact.write_artifact(path, manifest, tensors)
