"""The inference consumer: its device batches, the local model, vision embeddings, the `openai` backend, the
watchdog."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stoker.settings.base import SettingsPart


class DeviceBatchSettings(SettingsPart):
    """Which backend runs the model, and how the consumer fills a device batch."""

    backend: Literal["transformers", "openai", "sim"] = Field(
        "transformers",
        description="`transformers` (the local model), `openai` (an OpenAI-compatible server: the `openai_*` "
        "settings) or `sim` (a simulated device: the `sim_*` settings).",
    )
    max_batch_size: int = Field(8, ge=1, description="The most requests in a batch.")
    max_batch_tokens: int = Field(
        16_384,
        ge=1,
        description="A batch closes early when its prompts add up to this many tokens (requests differ wildly in "
        "size).",
    )
    max_wait_ms: int = Field(
        0,
        ge=0,
        description="0 (default): a free device takes whatever waits at once. Above 0: a batch that is not full "
        "waits up to this long after its first request arrived, for company (for backends where a fuller batch is "
        "worth the latency).",
    )


class InferenceConsumerSettings(SettingsPart):
    """What the inference worker holds, how the local model runs, and what it is given."""

    prefetch_batches: int = Field(
        3,
        ge=1,
        description="Batches' worth of messages the inference worker may hold: one on the device, one prepared, "
        "one being written (its messages are acked only once its results are).",
    )
    yield_tokens: int = Field(
        1,
        ge=0,
        description="The local model: every this many decoding steps, a running call of interactive requests stops "
        "when some of its answers are done and others are not, or when a request waits for the device and the "
        "call has room for it; the done answers are written, the others go on in the next call beside the waiting "
        "requests. On the decode engine (`local_engine`) an answer goes on from its kept KV cache, so stopping "
        "costs no re-reading and 1 lets a waiting request join at the next step; on `generate` it re-reads its "
        "prompt and tokens so far, and a larger number (16) trades a longer wait for less re-reading. 0: a call "
        "runs until its longest answer ends.",
    )
    local_engine: bool = Field(
        True,
        description="The local model runs on stoker's decode engine: each row's KV cache is kept across decoding "
        "steps and calls, a request joins the running batch between steps, its prompt (a picture's image tokens "
        "too) read once. `false`: batched `generate` calls, restarted at each yield (the path before the engine, "
        "kept for comparison in benchmarks).",
    )
    engine_max_rows: int = Field(
        0,
        ge=0,
        description="The decode engine's most rows at once (an answer each; a request with `n` takes `n`). 0: the "
        "batch size (`max_batch_size`). On a CPU the batch size is about right; on CUDA a step costs nearly the "
        "same for many more rows, so raise it with `max_batch_size` until the KV cache fills the memory left.",
    )
    kv_cache_tokens: int = Field(
        0,
        ge=0,
        description="The decode engine's KV cache size in tokens: a request joins only while the rows running "
        "and queued reach (prompt and token limit each) no more than this. 0: no bound but the rows' (a CPU's "
        "memory holds far more than a batch of SmolLM2 rows). On CUDA set it from the memory left after the "
        "weights: a token takes 2 × layers × KV heads × head width × the dtype's bytes.",
    )
    engine_prefill_chunk: int = Field(
        512,
        ge=0,
        description="The decode engine's chunked prefill: while rows are generating, the prompts that join are "
        "read at most this many tokens a step (padding counted) between the running rows' steps, so a long prompt "
        "(a picture's image tokens) holds their next token back by one chunk's read at most, not by its whole "
        "read. 0: a joining prompt is read whole at the next step. On a CPU a chunk costs about its tokens times "
        "a prompt token's read (512: about one to two seconds for SmolLM2 on two cores); on CUDA a step costs "
        "nearly the same up to a few thousand tokens, so 2048 or more.",
    )
    line_batch_size: int = Field(
        1,
        ge=1,
        description="The most batch lines (OpenAI Batch API work) in one device batch while interactive requests "
        "come (while none has come for 2 s, lines run in full batches). Lines run only when no interactive request "
        "waits, so an interactive request that arrives waits at most for the batch on the device: fewer lines per "
        "batch bound that wait on a device whose batches take longer the fuller they are; on one whose batch costs "
        "the same at any size, `max_batch_size` gives lines the most throughput at no cost to interactive latency.",
    )
    device: str = Field("cpu", description="The inference device: `cuda` on a GPU host.")
    torch_threads: int = Field(
        0,
        ge=0,
        description="CPU threads the local model's operations use; 0 leaves torch's default (one per core). On a "
        "host whose cores other processes share, 1 stops a second thread from spinning while it waits for a core.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The local model's dtype; `auto` = bf16 on CUDA, fp32 on CPU."
    )
    vram_budget_gb: float | None = Field(
        None, gt=0, description="On CUDA: the share of GPU memory this worker may take, in GiB (unset: all of it)."
    )
    max_context_tokens: int = Field(
        2048,
        ge=64,
        description="Prompt + answer budget: a prompt longer than this less `max_new_tokens` is refused (400 "
        "`context_length_exceeded`, as vLLM refuses it), never cut to fit.",
    )
    system_prompt: str = Field(
        "",
        description="A system prompt put before every chat (empty: none; the chat reaches the model as it was sent, "
        "with the model's own template).",
    )


class VisionEmbeddingSettings(SettingsPart):
    """Vision embeddings: what a vision-language model's encoder (and connector) made of a picture, cached by its
    content hash and the model's identity, so a picture any worker has seen skips the encoder everywhere."""

    vision_embeddings_cache: bool = Field(
        True,
        description="Cache vision embeddings (this worker's memory, then the shared store); `false`: every "
        "picture runs the vision encoder.",
    )
    vision_embeddings_local_bytes: int = Field(
        512 * 1024**2,
        ge=0,
        description="This inference worker's in-memory vision embeddings, at most (bytes; least recently used "
        "go first; 0: none kept in memory).",
    )
    vision_embeddings_shared_bytes: int = Field(
        2 * 1024**3,
        ge=0,
        description="The shared store's vision embeddings (in the cache Redis), at most (bytes; the oldest go "
        "first, counted as evictions; 0: no shared store).",
    )
    vision_embeddings_ttl_s: int = Field(
        24 * 3600, ge=1, description="How long a picture's vision embeddings live in the shared store."
    )


class OpenAIBackendSettings(SettingsPart):
    """The `openai` backend: an OpenAI-compatible server (e.g. `vllm serve`)."""

    openai_image_max_side: int = Field(
        4096,
        ge=64,
        description="`openai` backend: the longest side of a picture sent to the server, at most. Below it, the "
        "picture is sent at the served model's own size (its image processor's config, from `STOKER_MODEL`) or "
        "as uploaded when smaller, losslessly (PNG) from the decoded original.",
    )
    openai_base_url: str = Field(
        "http://127.0.0.1:8001/v1", description="`openai` backend: the server's base URL (e.g. `vllm serve`)."
    )
    openai_model: str = Field("default", description="`openai` backend: the model name sent to the server.")
    openai_api_key: str | None = Field(None, description="`openai` backend: the server's API key, if it wants one.")
    openai_max_in_flight: int = Field(
        8, ge=1, description="`openai` backend: requests of a batch sent at once, at most."
    )
    openai_timeout_s: float = Field(60.0, gt=0, description="`openai` backend: each request's timeout.")
    openai_batch_priority: int | None = Field(
        None,
        description="`openai` backend, for a vLLM started with `--scheduling-policy priority`: the `priority` a "
        "batch line's request is sent with (an interactive one's is 0; lower runs first and may preempt), so the "
        "server's own scheduler serves interactive requests before batch lines it already holds. Unset: no "
        "`priority` is sent (a server without priority scheduling refuses one other than 0).",
    )
    openai_protocol: Literal["auto", "generate", "chat"] = Field(
        "auto",
        description="`openai` backend: how a request reaches the server. `generate`: rendered here (token ids, each "
        "picture's tensors from the stage cache, sampling parameters) and sent as vLLM's `GenerateRequest` to "
        "`/inference/v1/generate` (a `vllm serve` with `--enable-scale-out` or `--tokens-only`), so the server runs "
        "the model alone; `chat`: chat completions with each picture as a data URL; `auto`: `generate` while the "
        "server offers it, chat completions once it says it does not (404, or vLLM's 403 without scale-out; logged "
        "once, counted in "
        "`stoker_openai_generate_fallbacks_total`).",
    )
    openai_image_embeds: bool = Field(
        False,
        description="`openai` backend, for a vLLM started with `--enable-mm-embeds`: this worker loads the vision "
        "encoder of `STOKER_MODEL`, and each picture goes to the server as its (cached) vision embeddings, an "
        "`image_embeds` part, so the server never runs its encoder. Only for a trusted server of the same model.",
    )


class WatchdogSettings(SettingsPart):
    """The inference watchdog: a batch running longer than its budget fails its jobs as inference_failed; one
    still running after the grace as well means the device is wedged, and the worker exits to be restarted."""

    infer_batch_timeout_s: float = Field(
        60.0, gt=0, description="Watchdog: a batch running longer fails its jobs as inference_failed."
    )
    infer_wedge_grace_s: float = Field(
        30.0,
        gt=0,
        description="Watchdog: a batch still running this long after its timeout means the device is wedged; the "
        "worker exits to be replaced.",
    )
