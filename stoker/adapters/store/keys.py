"""The one layout of every Redis key stoker writes: each repository reads and writes only keys named here."""

from __future__ import annotations

from stoker.core.cachekeys import CacheAddress
from stoker.core.media import ContentHash

PREFIX = "stoker"


def job_key(job_id: str) -> str:
    """Hash holding one job's record, fields written by whichever stage owns them."""
    return f"{PREFIX}:job:{job_id}"


def input_ref(index: int) -> str:
    """Field of a job's hash holding one input's record."""
    return f"input:{index}"


def frame_ref(index: int, frame: int) -> str:
    """Field holding one keyframe of a video input."""
    return f"input:{index}:frame:{frame}"


def band_ref(ref: str, band: int) -> str:
    """Field holding one band's outcome of a page OCR'd in bands (beside the page's own record, `ref`)."""
    return f"band:{ref}:{band}"


def bands_in_ref(ref: str) -> str:
    """Field counting how many bands of a page are in."""
    return f"bands:{ref}"


#: Field of a job's hash: when a stage last wrote one of its input records or bands (the reaper's sign of progress).
PROGRESS_FIELD = "ts:progress"


def deliveries_key(task_id: str) -> str:
    """How many times a task message was delivered to a worker."""
    return f"{PREFIX}:deliveries:{task_id}"


#: The interactive jobs held for the inference queue's watermarks, by when each hold lapses
#: (`coordination.HandoffHold`; a sorted set, under a name of its own: the earlier single flag was a string).
HANDOFF_HOLD_KEY = f"{PREFIX}:handoff:holders"


def tokens_key(job_id: str) -> str:
    """The job's tokenized prompt, ready for the model."""
    return f"{PREFIX}:job:{job_id}:tokens"


def done_channel(job_id: str) -> str:
    """Pub/sub channel announcing that a job reached a terminal status."""
    return f"{PREFIX}:job:{job_id}:{ENDED}"


def answer_key(job_id: str) -> str:
    """A Redis stream of the pieces of a job's answer, as a streaming backend produced them."""
    return f"{PREFIX}:job:{job_id}:answer"


def answer_channel(job_id: str) -> str:
    """Pub/sub channel announcing that a piece was added to a job's answer stream."""
    return f"{PREFIX}:job:{job_id}:piece"


def handed_off_channel(job_id: str) -> str:
    """Pub/sub channel announcing that a job's preprocessing ended: it was handed to inference."""
    return f"{PREFIX}:job:{job_id}:handed"


def settled_channel(job_id: str) -> str:
    """Pub/sub channel announcing that the Idempotency-Key claimed for a job id was settled: it names the job the
    claim made, or it was given up without one."""
    return f"{PREFIX}:job:{job_id}:settled"


#: Every job's announcements (ended, answer piece, key settled), for a listener that serves many waiting requests at
#: once.
ANNOUNCEMENT_PATTERNS = tuple(f"{PREFIX}:job:*:{event}" for event in ("done", "piece", "settled", "handed"))


def announced_job(channel: str) -> str:
    """The job an announcement channel belongs to."""
    return channel.split(":")[2]


#: What `done_channel` announces: the job ended (the last part of its channel's name).
ENDED = "done"


def announced_event(channel: str) -> str:
    """What an announcement channel announces: `done` (`ENDED`), `piece`, `settled` or `handed`."""
    return channel.rsplit(":", 1)[1]


#: Where input bytes live; the job store's scripts build blob keys from it too.
BLOB_PREFIX = f"{PREFIX}:blob:"
#: Suffix of the set of unfinished jobs holding a blob (beside the blob's own key).
BLOB_HOLDERS_SUFFIX = ":jobs"


def blob_key(digest: ContentHash) -> str:
    """Raw input bytes, addressed by content."""
    return f"{BLOB_PREFIX}{digest}"


def blob_holders_key(digest: ContentHash) -> str:
    """The unfinished jobs that use a blob: the last one to end deletes it."""
    return f"{BLOB_PREFIX}{digest}{BLOB_HOLDERS_SUFFIX}"


def job_blobs_key(job_id: str) -> str:
    """The content hashes of the blobs a job holds, let go when it ends."""
    return f"{PREFIX}:job:{job_id}:blobs"


def cache_key(address: CacheAddress, part: str = "value") -> str:
    """A cached stage result: stage : stage version : content BLAKE3 : parameter fingerprint : scope (: part).

    The scope is the tenant whose entry it is (or the one shared scope, when sharing is on).
    """
    a = address
    return f"{PREFIX}:cache:{a.stage}:{a.version}:{a.digest}:{a.fingerprint}:{a.scope}:{part}"


def embedding_key(model: str, scope: str, digest: str) -> str:
    """A picture's vision embeddings (after the connector) under one model's identity, in one cache scope (the
    tenant whose picture it was, or the shared scope), for the fleet."""
    return f"{PREFIX}:vision-embeddings:{model}:{scope}:{digest}"


#: The shared vision-embeddings store's bookkeeping: entries by when they were written, their sizes, the bytes
#: they hold together, and how many were evicted to stay under the size cap.
EMBEDDINGS_INDEX_KEY = f"{PREFIX}:vision-embeddings:index"
EMBEDDINGS_SIZES_KEY = f"{PREFIX}:vision-embeddings:sizes"
EMBEDDINGS_BYTES_KEY = f"{PREFIX}:vision-embeddings:bytes"
EMBEDDINGS_EVICTIONS_KEY = f"{PREFIX}:vision-embeddings:evictions"


def cache_pattern(stage: str | None = None) -> str:
    """A SCAN pattern matching every cached result (of one stage)."""
    return f"{PREFIX}:cache:{stage or '*'}:*"


def cache_lease_key(address: CacheAddress) -> str:
    """The single-flight lease of whoever is computing that result now."""
    a = address
    return f"{PREFIX}:lease:{a.stage}:{a.version}:{a.digest}:{a.fingerprint}:{a.scope}"


def api_key_key(key_id: str) -> str:
    """Hash holding one API key: its tenant, the hash of its secret (never the secret), created, revoked."""
    return f"{PREFIX}:apikey:{key_id}"


def tenant_rate_key(tenant: str) -> str:
    """A tenant's request-rate state: the theoretical arrival time of its next request (GCRA)."""
    return f"{PREFIX}:tenant:{tenant}:rate"


def tenant_jobs_key(tenant: str) -> str:
    """A tenant's unfinished jobs, scored by when their slot is given back even if no end is ever written."""
    return f"{PREFIX}:tenant:{tenant}:in-flight"


def tenant_usage_key(tenant: str) -> str:
    """Hash of what a tenant's unfinished jobs hold: per job `m:<id>` queue messages and `b:<id>` input bytes, their
    totals `messages` and `bytes`, and `cap`, the bytes it may store (written by the API, read by the workers)."""
    return f"{PREFIX}:tenant:{tenant}:usage"


def tenant_results_key(tenant: str) -> str:
    """A tenant's stored results: each job whose record holds one, scored by when that record expires (what its
    result-bytes quota counts, `tenants.RESULTS`)."""
    return f"{PREFIX}:tenant:{tenant}:results"


def tenant_result_bytes_key(tenant: str) -> str:
    """Hash of the bytes each of a tenant's stored results holds (`b:<id>`) and their total (`bytes`); kept with
    `tenant_results_key`, and expiring with it."""
    return f"{PREFIX}:tenant:{tenant}:result-bytes"


def tenant_index_key(tenant: str) -> str:
    """A tenant's jobs by when they were accepted (newest last), trimmed to the records' own lifetime."""
    return f"{PREFIX}:tenant:{tenant}:jobs"


def response_key(response_id: str, tenant: str) -> str:
    """A stored response of the Responses API (`previous_response_id`), readable only by the tenant that made it."""
    return f"{PREFIX}:response:{response_id}:{tenant}"


def idempotency_key(digest: str) -> str:
    """A tenant's idempotency key (by `core.idempotency.key_digest`): its claim, then the job it made."""
    return f"{PREFIX}:idempotency:{digest}"


def recent_request_key(digest: str) -> str:
    """The job a tenant's request without an Idempotency-Key made, by the request's digest, kept a short while so
    that a client's automatic retry of it gets that job back."""
    return f"{PREFIX}:recent:{digest}"


def callback_secret_key(tenant: str) -> str:
    """The secret a tenant's completion callbacks are signed with (HMAC-SHA256)."""
    return f"{PREFIX}:tenant:{tenant}:callback-secret"


def previous_callback_secret_key(tenant: str) -> str:
    """The secret a rotation replaced, kept (and still signing) until its grace period ends: the key expires then."""
    return f"{PREFIX}:tenant:{tenant}:callback-secret:previous"


#: Pub/sub channel on which every cancelled job's id is announced (inference consumers drop it before the device).
CANCELLED_CHANNEL = f"{PREFIX}:cancelled"
#: Ended jobs whose completion callback is due, scored by when (the reaper hands them to a worker).
CALLBACKS_DUE_KEY = f"{PREFIX}:callbacks-due"
#: Tenants with unfinished jobs, scored by the queue messages those fan out into (the n of the fair share).
BUSY_TENANTS_KEY = f"{PREFIX}:tenants:busy"
#: Every job not yet terminal, scored by when the reaper should next look at it.
ACTIVE_KEY = f"{PREFIX}:active"
#: Lease held by the one reaper that acts at a time.
REAPER_LEASE_KEY = f"{PREFIX}:reaper"
CACHE_STATS_KEY = f"{PREFIX}:cache-stats"
#: Per queue: messages drained, ever (workers count, the API turns it into rates).
DRAINED_KEY = f"{PREFIX}:drained"
#: Jobs accepted, and finished per terminal status, ever.
JOB_COUNTS_KEY = f"{PREFIX}:jobs-by-status"
#: Per queue: jobs refused at admission because of it.
REFUSED_KEY = f"{PREFIX}:refused"
#: The inference device's accounting (busy seconds).
DEVICE_KEY = f"{PREFIX}:device"
#: The fingerprint of the workers' whole preprocessing configuration, as they last published it.
PIPELINE_IDENTITY_KEY = f"{PREFIX}:pipeline-identity"
#: Ids of every API key ever created (revoked ones included).
API_KEYS_KEY = f"{PREFIX}:apikeys"
#: A job's in-flight slot is given back this long after its deadline even if no terminal status was written
#: (every job gets one, from a worker, the watchdog or the reaper: this only bounds a leak).
IN_FLIGHT_GRACE_S = 600
#: Ids of inference consumers that hold jobs (each beats `consumer_alive_key` while it lives).
CONSUMERS_KEY = f"{PREFIX}:consumers"


def consumer_alive_key(consumer: str) -> str:
    """Present while an inference consumer lives: it renews the key's short lifetime every beat."""
    return f"{PREFIX}:consumer:{consumer}:alive"


def consumer_jobs_key(consumer: str) -> str:
    """The jobs an inference consumer holds now (waiting, prepared, on the device or being written)."""
    return f"{PREFIX}:consumer:{consumer}:jobs"


#: CPU seconds spent per worker kind, as each worker process accounts for itself.
CPU_KEY = f"{PREFIX}:cpu"
#: A simulated device shared by several processes: whoever holds this runs a batch.
DEVICE_LOCK_KEY = f"{PREFIX}:device:lock"
#: The device's recent idle gaps between batches while work waited (seconds, newest first, capped).
DEVICE_GAPS_KEY = f"{PREFIX}:device:gaps"


def file_key(file_id: str) -> str:
    """A stored file's record (its bytes live in the file storage, `stoker.adapters.files`)."""
    return f"{PREFIX}:file:{file_id}"


def tenant_files_key(tenant: str) -> str:
    """A tenant's files by creation time (a sorted set: the listing, and the expiry sweep)."""
    return f"{PREFIX}:files:{tenant}"


def tenant_file_bytes_key(tenant: str) -> str:
    """The bytes a tenant's stored files hold together (its stored-bytes quota for files)."""
    return f"{PREFIX}:files:{tenant}:bytes"


def batch_key(batch_id: str) -> str:
    """A batch's record and its feeding progress (a hash)."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_pending_key(batch_id: str) -> str:
    """A batch's lines fed and not yet collected: job id → its custom_id and line."""
    return f"{PREFIX}:batch:{batch_id}:pending"


def batch_output_key(batch_id: str) -> str:
    """A batch's finished lines for the output file: custom_id → its output line (set once)."""
    return f"{PREFIX}:batch:{batch_id}:output"


def batch_errors_key(batch_id: str) -> str:
    """A batch's failed or unrun lines for the error file: custom_id → its error line (set once)."""
    return f"{PREFIX}:batch:{batch_id}:errors"


def tenant_batches_key(tenant: str) -> str:
    """A tenant's batches by creation time (a sorted set: the paginated listing)."""
    return f"{PREFIX}:batches:{tenant}"


def tenant_live_batches_key(tenant: str) -> str:
    """A tenant's batches not yet ended (a set: its cap on batches running at once)."""
    return f"{PREFIX}:batches:{tenant}:live"


def tenant_file_holds_key(tenant: str) -> str:
    """Room in a tenant's stored-files quota held by its uploads in flight: upload's file id → the bytes it holds
    and until when (a hash; a hold not renewed lapses, so a process that died mid-upload holds nothing for long)."""
    return f"{PREFIX}:files:{tenant}:holds"


#: Every file whose expiry is due, by when (a sorted set the expiry sweep reads), across tenants.
FILES_EXPIRY_KEY = f"{PREFIX}:files:expiry"
#: Batches that are not over yet: the batch feeder's work list.
ACTIVE_BATCHES_KEY = f"{PREFIX}:batches:active"
#: The lease of the one API process that feeds batches at a time.
BATCH_FEEDER_LEASE_KEY = f"{PREFIX}:batch-feeder"
#: Batch lines fed and done, by outcome: counters for /v1/stats and the metrics.
BATCH_COUNTS_KEY = f"{PREFIX}:batch-lines"
