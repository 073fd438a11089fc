"""The job record's Lua scripts: each write that must happen once, or not at all once the job moved on, is one
script run by the store (the repositories in `job_*` register the ones they run).
"""

from __future__ import annotations

import hashlib

from stoker.adapters.store.blobs import RELEASE_BLOBS
from stoker.adapters.store.keys import CANCELLED_CHANNEL
from stoker.adapters.store.tenants import DROP_JOB, RESULTS
from stoker.core.jobs import TERMINAL

#: Lua: the terminal statuses (written once, never changed), from the core's one list.
TERMINAL_LUA = "local TERMINAL = {" + ", ".join(f"{status} = true" for status in sorted(TERMINAL)) + "}\n"

# An input record is written only while its job is still preprocessing: once the prompt was built from the
# records, a stage finishing late must not change what the job says it used. `rev` counts the writes, and the
# progress stamp says when the last one was (the reaper re-sends a preprocessing job that stopped moving).
# Nor once the job ended (cancelled while a stage ran): no half-written record.
PUT_INPUT = (
    TERMINAL_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then return 0 end
if TERMINAL[redis.call('HGET', KEYS[1], 'status')] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[1], 'rev', 1)
return 1
"""
)

# Lua: a job's writes as it goes to inference: its request stored, its stamps and status, a new look by the
# reaper (`HAND_OFF` after its checks; `CREATE` for a new job that skips preprocessing).
_HAND_OVER = """
local function hand_over(job, tokens, active, id, request, now, ttl, channel)
  redis.call('SET', tokens, request, 'EX', ttl)
  redis.call('HSETNX', job, 'ts:started', now)
  redis.call('HSET', job, 'ts:preprocessed', now, 'status', 'inferring')
  redis.call('ZADD', active, 'XX', now, id)  -- the reaper re-plans it now: redrive time, deadline
  redis.call('PUBLISH', channel, '')  -- a chat waiting for its inputs to settle starts its answer now
end
"""

# The one hand-over from preprocessing to inference. 'stale': a record changed since the prompt was built.
HAND_OFF = (
    TERMINAL_LUA
    + _HAND_OVER
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then
  return 'done'
end
if TERMINAL[redis.call('HGET', KEYS[1], 'status')] then return 'done' end
if ARGV[5] == '0' and (redis.call('HGET', KEYS[1], 'rev') or '0') ~= ARGV[1] then return 'stale' end
hand_over(KEYS[1], KEYS[2], KEYS[3], ARGV[6], ARGV[2], ARGV[3], ARGV[4], ARGV[7])
return 'ok'
"""
)

# A terminal status is written once: whoever comes second (a late batch, the reaper, the watchdog) changes nothing.
# What the job held of its tenant's limits (in-flight slot, queue messages, stored bytes) is given back with it,
# and the result it keeps (ARGV[4] bytes; 0: none, or no tenant to charge) is charged to the tenant for as long as
# the record lives (`RESULTS`).
FINISH = (
    DROP_JOB
    + RESULTS
    + RELEASE_BLOBS
    + TERMINAL_LUA
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or TERMINAL[status] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
drop(KEYS[6], KEYS[7], KEYS[8], ARGV[1], ARGV[3])
if tonumber(ARGV[4]) > 0 then hold_result(KEYS[11], KEYS[12], KEYS[1], ARGV[1], tonumber(ARGV[4])) end
release_blobs(KEYS[10], ARGV[1])
if redis.call('HEXISTS', KEYS[1], 'callback') == 1 then  -- its client asked to be told: due now
  local clock = redis.call('TIME')
  redis.call('ZADD', KEYS[9], tonumber(clock[1]) + tonumber(clock[2]) / 1000000, ARGV[1])
end
-- announced only where a client waits on it (`watched`): an API process wakes for no job nobody waits on; the
-- announcement is the ended record (its fields and values in turn, `ended_job`), so a waiter answers without a read
if redis.call('HEXISTS', KEYS[1], 'watched') == 1 then
  redis.call('PUBLISH', KEYS[4], cjson.encode(redis.call('HGETALL', KEYS[1])))
end
"""
    # a cancelled job is announced to the inference consumers too, which drop it if they hold it
    + f"if ARGV[2] == 'cancelled' then redis.call('PUBLISH', '{CANCELLED_CHANNEL}', ARGV[1]) end\n"
    + "return 1\n"
)

# A job deleted gives back its result's charge (`RESULTS`).
DROP_RESULT = RESULTS + "drop_result(KEYS[1], KEYS[2], ARGV[1])\n"

# One band of a page OCR'd in bands (`stoker.runtime.stages.ocr`): kept beside the page's record while the job is still
# preprocessing; the answer is how many of the page's bands are in, so the one that brings in the last joins them.
# A band that comes in is progress too, stamped like an input record.
PUT_BAND = (
    TERMINAL_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then return -1 end
if TERMINAL[redis.call('HGET', KEYS[1], 'status')] then return -1 end
redis.call('HSET', KEYS[1], ARGV[4], ARGV[5])
if redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  return redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
end
return tonumber(redis.call('HGET', KEYS[1], ARGV[3]) or '0')
"""
)

# Only a queued job starts: a cancel (or any ending) that came first holds, and its stages see it ended.
START = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'preprocessing', 'ts:started', ARGV[1])
return 1
"""

# A client is about to wait on the job: its end is announced from now on (`FINISH`); the job as it stands, read in
# the same step, so an end after this read is never missed and one before it is in what it returns. A job that is
# unknown (never made by watching it) or already ended (its record no longer changes) is only read.
WATCH = (
    TERMINAL_LUA
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if status and not TERMINAL[status] then redis.call('HSET', KEYS[1], 'watched', '1') end
return redis.call('HGETALL', KEYS[1])
"""
)

# A new job, in one step: its record, its place on the reaper's watch list and in its tenant's indexes, its count;
# with a model request (a job that skips preprocessing), its hand-off to inference (`hand_over`, as `HAND_OFF`
# hands over once its checks pass: a record just made has nothing to check); the record as written. One command
# where each of these was one of the transaction's: a redis-py transaction reads and parses every command's answer
# on its own, and on a loaded API that cost three times the commands themselves.
# KEYS: the record, the watch list, the tenant's jobs and listing, the counts[, the request].
# ARGV: ttl, first look, in-flight until, accepted, the listing's oldest kept, id, 2 × fields, fields…
#       [, the request, now, the hand-off's channel].
CREATE = (
    _HAND_OVER
    + """
local job, ttl, id, n = KEYS[1], ARGV[1], ARGV[6], tonumber(ARGV[7])
redis.call('HSET', job, unpack(ARGV, 8, 7 + n))
redis.call('EXPIRE', job, ttl)
redis.call('ZADD', KEYS[2], ARGV[2], id)
redis.call('ZADD', KEYS[3], 'XX', ARGV[3], id)
redis.call('ZADD', KEYS[4], ARGV[4], id)  -- the listing: entries older than the records go, the index with its last
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[5])
redis.call('EXPIRE', KEYS[4], ttl)
redis.call('HINCRBY', KEYS[5], 'accepted', 1)
if KEYS[6] then hand_over(job, KEYS[6], KEYS[2], id, ARGV[8 + n], ARGV[9 + n], ttl, ARGV[10 + n]) end
return redis.call('HGETALL', job)
"""
)
#: The new-job script's SHA-1, as redis-py's `Script` names it (a new job's transaction calls it by it).
CREATE_SHA = hashlib.sha1(CREATE.encode()).hexdigest()  # the name Redis gives a script
