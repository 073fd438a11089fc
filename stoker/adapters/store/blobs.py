"""Input bytes, stored once under their content hash, held by the unfinished jobs that use them."""

from __future__ import annotations

import redis
from redis.client import Pipeline

from stoker.adapters.store.keys import BLOB_HOLDERS_SUFFIX, BLOB_PREFIX, blob_holders_key, blob_key, job_blobs_key
from stoker.core.media import ContentHash

# Hold bytes already stored (refreshing their lifetime); 0 when they are gone.
_HOLD = """
if redis.call('EXPIRE', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[1])
return 1
"""

# Store the bytes once (a repeat refreshes their lifetime) and note the job as one of their holders, atomically:
# a holder that ends at the same moment cannot delete bytes another job has just been promised.
_PUT = """
if redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2], 'NX') == false then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
if ARGV[3] ~= '' then
  redis.call('SADD', KEYS[2], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
"""

#: Lua: a job lets go of every blob it holds; a blob no unfinished job holds any more is deleted at once (its
#: stage results stay in the cache), so the store's memory returns to where it was once the jobs end. Blob keys are
#: built here from their one prefix (keys.BLOB_PREFIX): which blobs a job holds is only known inside the script.
RELEASE_BLOBS = f"""
local function release_blobs(held, job)
  for _, digest in ipairs(redis.call('SMEMBERS', held)) do
    local holders = '{BLOB_PREFIX}' .. digest .. '{BLOB_HOLDERS_SUFFIX}'
    redis.call('SREM', holders, job)
    if redis.call('SCARD', holders) == 0 then redis.call('DEL', '{BLOB_PREFIX}' .. digest) end
  end
  redis.call('DEL', held)
end
"""

_RELEASE = RELEASE_BLOBS + "release_blobs(KEYS[1], ARGV[1])\n"


class BlobRepository:
    """Raw input bytes by BLAKE3 hash: living until the last job holding them ends, at most `ttl_s` from their
    last upload."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self._put = client.register_script(_PUT)
        self._release = client.register_script(_RELEASE)
        self._hold = client.register_script(_HOLD)

    def put_blob(self, digest: ContentHash, data: bytes, job_id: str | None = None) -> None:
        """Store input bytes once, held by `job_id` until it ends; a repeat only refreshes their lifetime."""
        keys, args = self._put_call(digest, data, job_id)
        self._put(keys=keys, args=args)

    def queue_put(self, pipe: Pipeline[bytes], digest: ContentHash, data: bytes, job_id: str) -> None:
        """`put_blob`, queued onto `pipe` (the transaction that makes the job holding the bytes) as a bare
        `EVALSHA`: a store that forgot its scripts answers it NOSCRIPT, and `put_blob` then writes it alone."""
        keys, args = self._put_call(digest, data, job_id)
        pipe.evalsha(self._put.sha, len(keys), *keys, *args)  # type: ignore[attr-defined]

    def _put_call(
        self, digest: ContentHash, data: bytes, job_id: str | None
    ) -> tuple[list[str], list[bytes | int | str]]:
        keys = [blob_key(digest), blob_holders_key(digest), job_blobs_key(job_id or "")]
        return keys, [data, self.ttl_s, job_id or "", digest]

    def hold(self, digest: ContentHash, job_id: str) -> bool:
        """Hold bytes already stored for `job_id` until it ends; False if they are gone."""
        keys = [blob_key(digest), blob_holders_key(digest), job_blobs_key(job_id)]
        return bool(self._hold(keys=keys, args=[self.ttl_s, job_id, digest]))

    def release(self, job_id: str) -> None:
        """A job that will never end (it was not accepted after all) lets go of its blobs."""
        self._release(keys=[job_blobs_key(job_id)], args=[job_id])

    def holders(self, digest: ContentHash) -> set[str]:
        """The unfinished jobs holding a blob."""
        return {raw.decode() for raw in self.redis.smembers(blob_holders_key(digest))}

    def get_blob(self, digest: ContentHash) -> bytes | None:
        """Input bytes, or None when they expired."""
        return self._get_bytes(blob_key(digest))

    def _get_bytes(self, key: str) -> bytes | None:
        value = self.redis.get(key)
        return bytes(value) if value is not None else None
