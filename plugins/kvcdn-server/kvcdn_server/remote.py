"""``infer`` answered by a vLLM OpenAI-compatible server (``--infer-engine URL``) whose kvcdn
connector loads the artifact's KV from this server's chunks.

This server keeps what only it may do: it authenticates and authorizes the caller (the route's 404),
checks the limits (``n``, the question's bytes, the artifact's context tokens from its header, then
the question's tokens with the model's own tokenizer: no model weights load here), admits the
request (the same slots and fair share as the in-process engine), and times it out or cancels it. It
also decides what the engine can load: the connector loads a record of its own chain root only (the
model's fingerprint, the engine's compute dtype, unquantized; anything else it recomputes). The
engine runs in this server's compute dtype, so an artifact computed in another is refused here with
the in-process engine's ``422 dtype_mismatch``; any other root (a quantized artifact, another chunk
size) is answered by the in-process engine, exactly as without the option, as an artifact stored
whole is. Then it sends the engine one streamed completion of the artifact's token ids followed by
the question's, with ``kv_transfer_params.kvcdn_grant``: the artifact's chunk record and a
short-lived signed GET URL per object. The connector loads exactly those chunks through those URLs
and does no lookup of its own for the request, so the engine needs no credential of any tenant
(docs/vllm.md, "The hosted infer"). Closing the stream (timeout, client gone) makes vLLM abort the
request: the engine stops within one decoded token.
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx

from kvcdn_server.errors import ApiError
from kvcdn_server.inference import InferenceEngine, InferResult
from kvcdn_server.lru import Lru
from kvcdn_wire import ErrorCode

#: token ids of artifacts kept (an artifact id's bytes never change), in bytes at 8 per token
TOKEN_IDS_BUDGET = 64 << 20


class RemoteEngine:
    """Hands ``infer`` to the vLLM server at ``url``; ``local`` lends its limits, slots and pool."""

    def __init__(self, url: str, local: InferenceEngine, transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self.local = local
        self._client = httpx.Client(transport=transport, timeout=httpx.Timeout(local.timeout, connect=10.0))
        self._models = Lru(1 << 62, local.limits.max_models)
        self._token_ids = Lru(TOKEN_IDS_BUDGET)
        self._lock = threading.Lock()

    @functools.cached_property
    def dtype(self) -> str:
        """The compute dtype the engine must run: this server's (``--infer-dtype``, ``auto`` resolved
        as the in-process engine resolves it)."""
        from kvcdn_core import runtime

        device = self.local.limits.device
        return runtime.resolve_dtype(
            self.local.limits.dtype, runtime.resolve_device("auto") if device == "auto" else device
        )

    def loads(self, manifest: dict, root: str) -> bool:
        """Whether the engine loads the chunked artifact of ``manifest`` and chain ``root``; a 4xx
        here when the in-process engine would refuse it too, before any engine is asked (the
        limits, the model, the dtype); False when only the in-process engine can load it."""
        from kvcdn_core.store import keys

        self.local.check_context(int(manifest.get("tokens") or 0))
        model_ref = self.local.policy.resolve(manifest.get("model_id"))
        if manifest.get("dtype") != self.dtype:
            raise ApiError(
                422,
                ErrorCode.DTYPE_MISMATCH,
                f"the artifact was computed in {manifest.get('dtype')}; this server computes in {self.dtype}",
            )
        *_, fingerprint = self._model(model_ref)
        return root == keys.root_key(fingerprint, keys.representation(self.dtype, None))

    def run(
        self,
        tenant: str,
        artifact_id: str,
        manifest: dict,
        fetch_path: Callable,
        grant: Callable[[], dict],
        question: str,
        n: int,
        disconnected: Callable[[], bool] | None = None,
    ) -> InferResult:
        """Answer one request: the checks that need no engine, then a slot, then the engine."""
        self.local.check_request(question, n)
        self.local.check_context(int(manifest.get("tokens") or 0))
        model_id = manifest.get("model_id")
        model_ref = self.local.policy.resolve(model_id)
        return self.local.run_in_slot(
            tenant,
            lambda cancel: self._infer(artifact_id, model_id, model_ref, fetch_path, grant, question, n, cancel),
            disconnected,
        )

    def _infer(self, artifact_id, model_id, model_ref, fetch_path, grant, question, n, cancel) -> InferResult | None:
        if cancel.is_set():
            return None
        adapter, tokenizer, _ = self._model(model_ref)
        question_ids = adapter.encode_continuation(tokenizer, question)
        if len(question_ids) > self.local.limits.max_question_tokens:
            raise ApiError(
                413,
                ErrorCode.QUESTION_TOO_LONG,
                f"the question is {len(question_ids)} tokens; this server takes at most "
                f"{self.local.limits.max_question_tokens}",
            )
        if not question_ids:
            raise ApiError(422, ErrorCode.ARTIFACT_INCOMPATIBLE, "the question has no tokens")
        context_ids = self._context_ids(artifact_id, fetch_path)
        if cancel.is_set():
            return None
        body = {
            "prompt": context_ids + question_ids,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,  # n tokens exactly, as the in-process engine decodes them
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "kv_transfer_params": {"kvcdn_grant": grant()},
        }
        tokens, cached = self._stream(body, cancel)
        if tokens is None:
            return None
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        return InferResult(tokens, text, model_id, cached, len(question_ids))

    def _stream(self, body: dict, cancel: threading.Event) -> tuple[list[int] | None, int]:
        """The completion's token ids and the prompt tokens the engine had cached (loaded by the
        connector); ``None`` once cancelled. Cancelling closes the upstream stream at once, even
        while the engine is still computing the prompt: vLLM aborts a request whose client left."""
        tokens: list[int] = []
        cached = 0
        finished = threading.Event()
        try:
            with self._client.stream("POST", f"{self.url}/v1/completions", json=body) as reply:
                # run_in_slot sets ``cancel`` when it answers, whatever the answer: this ends then
                threading.Thread(target=_cut_when_set, args=(cancel, finished, reply), daemon=True).start()
                if reply.status_code != 200:
                    reply.read()
                    raise ApiError(
                        502,
                        ErrorCode.ENGINE_UNAVAILABLE,
                        f"the inference engine refused the request (HTTP {reply.status_code}: {_detail(reply)})",
                    )
                for line in reply.iter_lines():
                    if cancel.is_set():
                        return None, 0
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    for choice in event.get("choices") or ():
                        tokens.extend(choice.get("token_ids") or ())
                    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens") or cached)
        except ApiError:
            raise
        except (httpx.HTTPError, OSError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
            if cancel.is_set():  # the stream closed under the reader: the request was cancelled
                return None, 0
            what = "did not answer" if isinstance(exc, (httpx.HTTPError, OSError)) else "sent an unreadable answer"
            raise ApiError(
                502, ErrorCode.ENGINE_UNAVAILABLE, f"the inference engine {what} ({type(exc).__name__})"
            ) from None
        finally:
            finished.set()
        if cancel.is_set():
            return None, 0
        return tokens, cached

    def _model(self, model_ref: str):
        """The adapter, tokenizer and fingerprint of an allowed model (config and tokenizer files,
        no weights)."""
        with self._lock:
            found = self._models.get(model_ref)
            if found is None:
                from transformers import AutoTokenizer

                from kvcdn_core import adapter_for, architecture_of, fingerprint, read_config, resolve_model_dir

                model_dir = resolve_model_dir(model_ref, None, weights=False)
                config = read_config(model_dir)
                found = (
                    adapter_for(architecture_of(config), config)(),
                    AutoTokenizer.from_pretrained(model_dir),
                    fingerprint(model_dir, weights=False),
                )
                self._models.put(model_ref, found, 1)
            return found

    def _context_ids(self, artifact_id: str, fetch_path: Callable) -> list[int]:
        from kvcdn_core import artifact

        ids = self._token_ids.get(artifact_id)
        if ids is None:
            with fetch_path() as path:
                ids = artifact.read_token_ids(path)
            self._token_ids.put(artifact_id, ids, 8 * len(ids))
        return ids

    def close(self) -> None:
        self._client.close()


def _cut_when_set(cancel: threading.Event, finished: threading.Event, reply: httpx.Response) -> None:
    """Once ``cancel`` is set, shut down the socket of a stream still being read: the reader,
    blocked on it, wakes up, and the engine sees its client leave (closing the socket from another
    thread would do neither)."""
    cancel.wait()
    if finished.is_set():
        return
    stream = reply.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _detail(reply: httpx.Response) -> str:
    """The first line of an engine's error message, short."""
    try:
        message: Any = reply.json()
        message = (message.get("error") or {}).get("message") or message.get("message") or message
    except ValueError:
        message = reply.text
    return str(message).splitlines()[0][:200] if str(message) else "no message"
