"""Input bytes, stored once under their content hash."""

from __future__ import annotations

import redis

from stoker.adapters.store.keys import blob_key
from stoker.core.media import ContentHash


class BlobRepository:
    """Raw input bytes by BLAKE3 hash, living `ttl_s` from their last upload."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s

    def put_blob(self, digest: ContentHash, data: bytes) -> None:
        """Store input bytes once; a repeat only refreshes their lifetime."""
        key = blob_key(digest)
        if not self.redis.set(key, data, ex=self.ttl_s, nx=True):
            self.redis.expire(key, self.ttl_s)

    def get_blob(self, digest: ContentHash) -> bytes | None:
        """Input bytes, or None when they expired."""
        return self._get_bytes(blob_key(digest))

    def _get_bytes(self, key: str) -> bytes | None:
        value = self.redis.get(key)
        return bytes(value) if value is not None else None
