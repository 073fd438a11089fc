"""Vision embeddings, once per picture for the whole fleet: what a vision-language model's encoder and connector
made of a picture, kept by (content hash, model identity, cache scope) in two tiers.

- `local`: this inference worker's memory, an LRU bounded in bytes (cachetools' `LRUCache` with the tensors'
  sizes as their weights);
- `shared`: the cache Redis, where every worker of the fleet finds what any of them computed; bounded in bytes
  (the oldest entries go first, counted as evictions) and by a TTL.

The cache scope is the stage cache's (`stoker.core.tenancy.cache_scope`): the tenant that sent the picture, so one
tenant's pictures never answer, or speed up, another's; or one scope for all when `STOKER_CACHE_SHARED` is on.

The model identity is a hash of what makes the embeddings: the model's config and processor files, the weights
files' safetensors headers, sizes and a sample of their bytes, the dtype they run in and the decode parameters
the tensors were prepared under. It is equal on every host that serves the same files, and never depends on
where or when they were written. Entries are safetensors bytes, never pickle. The cache is never a dependency: a
store that fails costs the recomputation (logged and counted), nothing else.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import redis
from cachetools import LRUCache

from stoker.adapters.metrics import (
    VISION_EMBEDDING_EVICTIONS,
    VISION_EMBEDDING_LOOKUPS,
    VISION_EMBEDDING_STORE_FAILURES,
)
from stoker.adapters.store.keys import (
    EMBEDDINGS_BYTES_KEY,
    EMBEDDINGS_EVICTIONS_KEY,
    EMBEDDINGS_INDEX_KEY,
    EMBEDDINGS_SIZES_KEY,
    embedding_key,
)

log = logging.getLogger(__name__)

#: The model's files that shape its embeddings besides the weights: its config and its processors' configs.
_CONFIG_FILES = ("config.json", "preprocessor_config.json", "processor_config.json")
#: Bytes of each weights file hashed at its start, middle and end: fine-tuned weights of the same architecture
#: have the same header and size, and differ in nearly every tensor.
_SAMPLE_BYTES = 1 << 20
_TENSOR_NAME = "embeddings"

# Write one entry, forget entries older than the TTL (Redis has expired them: not evictions), then evict the oldest
# until the store is under its cap. KEYS: entry, index, sizes, bytes, evictions; ARGV: data, ttl, cap, now.
_PUT = """
local size = string.len(ARGV[1])
local ttl, cap, now = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if size > cap then return -1 end
local function forget(key)
  local had = tonumber(redis.call('HGET', KEYS[3], key) or '0')
  redis.call('HDEL', KEYS[3], key)
  redis.call('ZREM', KEYS[2], key)
  return redis.call('DECRBY', KEYS[4], had)
end
forget(KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
local total = redis.call('INCRBY', KEYS[4], size)
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl, 'LIMIT', 0, 64)) do
  total = forget(key)
end
local evicted = 0
while total > cap do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  redis.call('DEL', oldest)
  total = forget(oldest)
  evicted = evicted + 1
end
if evicted > 0 then redis.call('INCRBY', KEYS[5], evicted) end
return evicted
"""


def model_identity(model_dir: str | Path, **extra: Any) -> str:
    """What identifies the embeddings a model directory makes (equal on every host with the same files)."""
    root = Path(model_dir)
    described: dict[str, Any] = {"extra": extra, "configs": {}, "weights": {}}
    for name in _CONFIG_FILES:
        if (root / name).is_file():
            described["configs"][name] = json.loads((root / name).read_text())
    for weights in sorted(root.glob("*.safetensors")):
        described["weights"][weights.name] = _weights_identity(weights)
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return blake3.blake3(text.encode()).hexdigest()[:32]


def _weights_identity(path: Path) -> str:
    """A safetensors file's header (names, dtypes, shapes, offsets), size, and its bytes at three places."""
    size = path.stat().st_size
    digest = blake3.blake3(str(size).encode())
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        digest.update(f.read(header_len))
        for at in (0, size // 2, max(size - _SAMPLE_BYTES, 0)):
            f.seek(at)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def embeddings_to_bytes(tensor: Any) -> bytes:
    """One picture's embeddings as safetensors bytes (any dtype torch has, bfloat16 included)."""
    from safetensors.torch import save  # heavy (torch): only the inference worker stores embeddings

    return bytes(save({_TENSOR_NAME: tensor.detach().to("cpu").contiguous()}))


def embeddings_from_bytes(data: bytes) -> Any:
    """The inverse of `embeddings_to_bytes`: the same tensor, on the CPU."""
    from safetensors.torch import load

    return load(data)[_TENSOR_NAME]


#: An entry of this worker's LRU: (cache scope, content hash).
_Entry = tuple[str, str]


class _BoundedLRU(LRUCache[_Entry, Any]):
    """cachetools' LRU, weighed in bytes, counting what it drops to stay under its cap."""

    def popitem(self) -> tuple[_Entry, Any]:
        item = super().popitem()
        VISION_EMBEDDING_EVICTIONS.labels("local").inc()
        return item


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


class SharedEmbeddings:
    """The fleet's vision embeddings in the cache Redis: bounded in bytes and by a TTL, never a dependency."""

    def __init__(self, client: redis.Redis[bytes], *, max_bytes: int, ttl_s: int) -> None:
        self.redis = client
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._put = client.register_script(_PUT)

    def get(self, model: str, scope: str, digest: str) -> bytes | None:
        """The stored bytes, or None (also when the store fails)."""
        try:
            raw = self.redis.get(embedding_key(model, scope, digest))
        except redis.RedisError as exc:
            VISION_EMBEDDING_STORE_FAILURES.labels("read").inc()
            log.warning("vision embeddings store read failed, recomputing: %s", exc)
            return None
        return bytes(raw) if raw is not None else None

    def put(self, model: str, scope: str, digest: str, data: bytes) -> None:
        """Store the bytes, evicting the oldest entries past the cap; a failure is logged and counted."""
        keys = [embedding_key(model, scope, digest), EMBEDDINGS_INDEX_KEY, EMBEDDINGS_SIZES_KEY, EMBEDDINGS_BYTES_KEY]
        keys.append(EMBEDDINGS_EVICTIONS_KEY)
        try:
            evicted = int(self._put(keys=keys, args=[data, self.ttl_s, self.max_bytes, time.time()]))
        except redis.RedisError as exc:
            VISION_EMBEDDING_STORE_FAILURES.labels("write").inc()
            log.warning("vision embeddings store write failed: %s", exc)
            return
        if evicted > 0:
            VISION_EMBEDDING_EVICTIONS.labels("shared").inc(evicted)

    def evictions(self) -> int:
        """Entries evicted to stay under the cap, ever (by every worker)."""
        return int(self.redis.get(EMBEDDINGS_EVICTIONS_KEY) or 0)


class EmbeddingCache:
    """A picture's vision embeddings under one model identity, in one cache scope: this worker's LRU first, then the
    shared store."""

    def __init__(self, identity: str, *, local_bytes: int, shared: SharedEmbeddings | None) -> None:
        self.identity = identity
        self.shared = shared
        self._local: _BoundedLRU | None = _BoundedLRU(local_bytes, getsizeof=_nbytes) if local_bytes > 0 else None

    def get(self, digest: str, scope: str) -> Any | None:
        """The embeddings (a CPU tensor), or None when neither tier has them in this scope."""
        if self._local is not None:
            found = self._local.get((scope, digest))
            VISION_EMBEDDING_LOOKUPS.labels("local", "hit" if found is not None else "miss").inc()
            if found is not None:
                return found
        if self.shared is None:
            return None
        raw = self.shared.get(self.identity, scope, digest)
        VISION_EMBEDDING_LOOKUPS.labels("shared", "hit" if raw is not None else "miss").inc()
        if raw is None:
            return None
        tensor = self._decoded(digest, raw)
        if tensor is not None:
            self._remember((scope, digest), tensor)
        return tensor

    def put(self, digest: str, scope: str, tensor: Any) -> None:
        """Keep freshly computed embeddings in both tiers, in this scope."""
        cpu = tensor.detach().to("cpu")
        self._remember((scope, digest), cpu)
        if self.shared is not None:
            self.shared.put(self.identity, scope, digest, embeddings_to_bytes(cpu))

    def _remember(self, entry: _Entry, tensor: Any) -> None:
        if self._local is not None and _nbytes(tensor) <= self._local.maxsize:
            self._local[entry] = tensor

    @staticmethod
    def _decoded(digest: str, raw: bytes) -> Any | None:
        try:
            return embeddings_from_bytes(raw)
        except Exception as exc:  # safetensors raises its own error type, or KeyError for another layout
            VISION_EMBEDDING_STORE_FAILURES.labels("decode").inc()
            log.warning("stored vision embeddings of %s unreadable, recomputing: %r", digest[:12], exc)
            return None


#: What builds a model's embedding cache from its identity (None: no caching).
CacheFactory = Callable[[str], EmbeddingCache | None]
