"""An independent check of AWS SigV4 query-string signatures (presigned S3 URLs), as S3 does it.

moto checks no signatures, so tests recompute them: a presigned URL is valid for a request only if
that request carries every header the URL signed, with the signed values.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qsl, quote, urlsplit


def sigv4_query_valid(url: str, method: str, headers: dict[str, str], secret: str) -> bool:
    """Whether a request of ``method`` to ``url`` with exactly ``headers`` (besides ``Host``)
    matches the URL's ``X-Amz-Signature`` under the secret key ``secret``."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = dict(query)["X-Amz-Signature"]
    signed = dict(query)["X-Amz-SignedHeaders"].split(";")
    all_headers = {"host": parts.netloc, **{k.lower(): v for k, v in headers.items()}}
    if any(name not in all_headers for name in signed):
        return False
    canonical_query = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query) if k != "X-Amz-Signature"
    )
    canonical = "\n".join(
        [
            method,
            parts.path,
            canonical_query,
            "".join(f"{name}:{' '.join(all_headers[name].split())}\n" for name in signed),
            ";".join(signed),
            "UNSIGNED-PAYLOAD",
        ]
    )
    date, scope = dict(query)["X-Amz-Date"], dict(query)["X-Amz-Credential"].split("/", 1)[1]
    to_sign = "\n".join(["AWS4-HMAC-SHA256", date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for piece in scope.split("/"):
        key = hmac.new(key, piece.encode(), hashlib.sha256).digest()
    return hmac.compare_digest(hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest(), given)
