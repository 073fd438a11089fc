"""The `stoker` command: run the stack, a worker or the API; submit jobs; fetch the model.

The top layer. Each subcommand imports what it runs only when it runs (kept local on purpose, not to dodge a
cycle): `stoker worker` execs celery without loading FastAPI, and only `stoker bench` pays for matplotlib.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the command loads what it runs when it runs
    from stoker.adapters.store import Store


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args, extra = _parser().parse_known_args(argv)
    if args.command == "bench":  # its own parser: `stoker bench --help` lists its options
        from bench.harness import main as bench

        return bench(extra)
    if extra and args.command != "worker":
        _parser().error(f"unrecognised arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns what matters
    handler = _HANDLERS[args.command]
    return int(handler(args, extra) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Keeps inference accelerators fed.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start API, workers and Flower locally (and a broker if none answers)")
    up.add_argument("--port", type=int, default=None, help="the API's port (default 8000)")
    up.add_argument("--flower-port", type=int, default=None, help="Flower's port (default 5555)")
    up.add_argument("--metrics-port", type=int, default=None, help="the first of the workers' 3 metrics ports (9101)")
    up.add_argument("--auth", action="store_true", help="require API keys (off on a local stack; STOKER_AUTH wins)")
    worker = sub.add_parser("worker", help="start a celery worker for a queue group; extra args go to celery")
    worker.add_argument("kind", choices=["cpu", "ocr", "asr", "infer", "sync"])
    sub.add_parser("reaper", help="move late and stalled jobs on (deadlines, lost messages); one acts at a time")
    sub.add_parser(
        "batch-feeder", help="feed OpenAI batches' lines into the queues as room appears (one feeds at a time)"
    )
    api = sub.add_parser("api", help="serve the HTTP API")
    api.add_argument("--host", default=None)
    api.add_argument("--port", type=int, default=None)
    submit = sub.add_parser("submit", help="submit files and a prompt, wait, print the answer and timings")
    submit.add_argument("files", nargs="*", type=Path)
    submit.add_argument("--prompt", required=True)
    submit.add_argument(
        "--api", "--url", dest="api", default=None, help="the API's URL (default: $STOKER_API_URL, else :8000)"
    )
    submit.add_argument("--timeout", type=float, default=300.0)
    submit.add_argument("--key", default=None, help="API key (default: $STOKER_API_KEY)")
    cache = sub.add_parser("cache", help="stage-result cache: hit/miss counters, or clear it")
    cache.add_argument("action", choices=["stats", "clear"])
    cache.add_argument("--stage", default=None, help="only this stage (decode, ocr, transcribe, keyframes, tokenize)")
    sub.add_parser("stats", help="operator counters (the cache's, for now)")
    sub.add_parser("bench", help="benchmark the pipeline against the synchronous baseline (see --help)", add_help=False)
    model = sub.add_parser("model", help="manage the model cache")
    model.add_argument("action", choices=["fetch", "path", "make-tiny-vlm"])
    model.add_argument(
        "dir", nargs="?", type=Path, default=None, help="make-tiny-vlm: build into DIR (default: the model cache)"
    )
    _keys_parser(sub)
    _batch_parser(sub)
    docs = sub.add_parser("docs", help="print a generated documentation page (config: docs/configuration.md)")
    docs.add_argument("page", choices=["config"])
    check = sub.add_parser("verify-callback", help="check a completion callback's signature (the body on stdin)")
    check.add_argument("--secret", required=True, help="the tenant's callback secret")
    check.add_argument("--timestamp", required=True, help="the X-Stoker-Timestamp header")
    check.add_argument("--signature", required=True, help="the X-Stoker-Signature header")
    check.add_argument("--tolerance", type=int, default=300, help="seconds a delivery may be old (default 300)")
    return parser


def _keys_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="API keys: create one for a tenant, list them, revoke one; callback secrets")
    actions = keys.add_subparsers(dest="keys_action", required=True)
    create = actions.add_parser("create", help="create a key; it is printed once, on the last line")
    create.add_argument("--tenant", required=True)
    actions.add_parser("list", help="every key: id, tenant, created, revoked (never a secret)")
    revoke = actions.add_parser("revoke", help="revoke a key, by its id (or the whole key)")
    revoke.add_argument("key")
    rotate = actions.add_parser(
        "rotate-callback-secret", help="a new callback secret for a tenant; the old one still signs for --grace"
    )
    rotate.add_argument("--tenant", required=True)
    rotate.add_argument(
        "--grace", type=int, default=86400, help="seconds the old secret still signs beside the new (default 86400)"
    )


def _up(args: argparse.Namespace, _: list[str]) -> int:
    from workers.stack import run_stack

    ports = {"port": args.port, "flower_port": args.flower_port, "metrics_base_port": args.metrics_port}
    return run_stack(ports, auth=args.auth)


def _worker(args: argparse.Namespace, extra: list[str]) -> int:
    from workers.launch import exec_worker

    exec_worker(args.kind, extra)
    return 0


def _reaper(args: argparse.Namespace, _: list[str]) -> int:
    from workers.reaper import run_reaper

    return run_reaper()


def _batch_feeder(args: argparse.Namespace, _: list[str]) -> int:
    from api.openai_batch_feeder import run_openai_batch_feeder
    from stoker.settings import ApiSettings

    return run_openai_batch_feeder(ApiSettings())


def _api(args: argparse.Namespace, _: list[str]) -> int:
    from api.server import serve
    from stoker.settings import ApiSettings

    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    serve(ApiSettings(**overrides))
    return 0


def _batch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    batch = sub.add_parser("batch", help="OpenAI batch files: submit one and follow it, or show a batch")
    actions = batch.add_subparsers(dest="batch_action", required=True)
    submit = actions.add_parser("submit", help="upload FILE.jsonl, run it as a batch, write its output next to it")
    submit.add_argument("file", type=Path)
    submit.add_argument("--window", default="24h", help="the completion window (OpenAI offers 24h)")
    status = actions.add_parser("status", help="a batch's status, request counts, files and errors")
    status.add_argument("batch_id")
    for action in (submit, status):
        action.add_argument(
            "--api", "--url", dest="api", default=None, help="the API's URL (default: $STOKER_API_URL, else :8000)"
        )
        action.add_argument("--key", default=None, help="API key (default: $STOKER_API_KEY)")


def _batch(args: argparse.Namespace, _: list[str]) -> int:
    from rich.console import Console

    from stoker.adapters.openai_batch_client import OpenAIBatchClient, describe, follow, save_results
    from stoker.settings import ClientSettings

    console = Console()
    settings = ClientSettings()
    client = OpenAIBatchClient(args.api or settings.api_url, args.key or settings.api_key)
    try:
        if args.batch_action == "status":
            describe(client.retrieve(args.batch_id), console)
            return 0
        uploaded = client.upload(args.file)
        batch = follow(client, client.create(uploaded["id"], args.window), console)
        describe(batch, console)
        for path in save_results(client, batch, args.file):
            console.print(f"  wrote {path}")
        return 0 if batch["status"] == "completed" else 1
    finally:
        client.close()


def _submit(args: argparse.Namespace, _: list[str]) -> int:
    from stoker.adapters.client import render_job, submit_files
    from stoker.settings import ClientSettings

    client = ClientSettings()
    key = args.key or client.api_key
    job = submit_files(args.api or client.api_url, args.prompt, args.files, args.timeout, api_key=key)
    render_job(job)
    return 0 if job["status"] in ("succeeded", "degraded") else 1


def _model(args: argparse.Namespace, _: list[str]) -> int:
    from stoker.adapters.backends.modelstore import resolve_model
    from stoker.settings import CommonSettings

    settings = CommonSettings()
    if args.action == "make-tiny-vlm":
        return _tiny_vlm(args.dir, settings.model_cache)
    if args.dir is not None:
        _parser().error(f"model {args.action} takes no directory")
    print(resolve_model(settings.model, settings.model_cache, fetch=args.action == "fetch"))
    return 0


def _tiny_vlm(target: Path | None, cache: Path) -> int:
    from stoker.adapters.backends.tinyvlm import build_tiny_vlm, ensure_tiny_vlm

    print(build_tiny_vlm(target, cache) if target is not None else ensure_tiny_vlm(cache))
    return 0


def _docs(args: argparse.Namespace, _: list[str]) -> int:
    from stoker.docs import configuration_page

    sys.stdout.write(configuration_page())
    return 0


def _cache(args: argparse.Namespace, _: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from stoker.adapters.cache import StageCache
    from stoker.settings import CommonSettings

    settings = CommonSettings()
    cache = StageCache.connect(settings.model_copy(update={"cache_enabled": True}))  # operators see it even when off
    if getattr(args, "action", "stats") == "clear":
        print(f"deleted {cache.clear(args.stage)} cached entries")
        return 0
    table = Table(title=f"stage cache at {settings.cache_url}")
    for column in ("stage", "hits", "misses", "hit rate", "CPU s saved", "CPU s spent", "oversize"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for stage, c in sorted(cache.stats().items()):
        if getattr(args, "stage", None) not in (None, stage):
            continue
        hits, misses = c.get("hits", 0), c.get("misses", 0)
        rate = f"{hits / (hits + misses):.0%}" if hits + misses else "-"
        table.add_row(
            stage,
            f"{hits:.0f}",
            f"{misses:.0f}",
            rate,
            f"{c.get('saved_s', 0):.1f}",
            f"{c.get('spent_s', 0):.1f}",
            f"{c.get('oversize', 0):.0f}",
        )
    Console().print(table)
    return 0


def _verify_callback(args: argparse.Namespace, _: list[str]) -> int:
    """Check a delivery as a receiver would: the raw body on stdin, the two headers' values as options."""
    import time

    from stoker.core.callbacks import verify

    body = sys.stdin.buffer.read()
    if verify(args.secret, args.timestamp, body, args.signature, time.time(), args.tolerance):
        print("valid")
        return 0
    print("invalid: wrong secret, altered body, or a timestamp too far from now", file=sys.stderr)
    return 1


def _keys(args: argparse.Namespace, _: list[str]) -> int:
    import time

    from stoker.adapters.store import Store
    from stoker.core.tenancy import issue_key, key_id_of
    from stoker.settings import CommonSettings

    settings = CommonSettings()
    store = Store.connect(settings)
    if args.keys_action == "create":
        try:
            issued = issue_key(args.tenant, time.time())
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        store.tenants.put_api_key(issued.record)
        secret = store.callbacks.secret(issued.record.tenant)  # the tenant's own, never one another tenant holds
        print(f"tenant {issued.record.tenant}'s callbacks are signed with {secret} (stoker verify-callback)")
        print(f"created key {issued.record.key_id} for tenant {issued.record.tenant}; it is shown only now:")
        print(issued.token)
        return 0
    if args.keys_action == "rotate-callback-secret":
        return _rotate_callback_secret(store, args.tenant, args.grace, settings.callback_secret)
    if args.keys_action == "list":
        print(f"{'id':<16}  {'tenant':<24}  {'created (UTC)':<20}  state")
        for key in store.tenants.api_keys():
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(key.created))
            print(f"{key.key_id:<16}  {key.tenant:<24}  {created:<20}  {'revoked' if key.revoked else 'active'}")
        return 0
    key_id = key_id_of(args.key)
    if key_id is None or not store.tenants.revoke_api_key(key_id):
        print(f"no key {args.key}", file=sys.stderr)
        return 1
    print(f"revoked key {key_id}")
    return 0


def _rotate_callback_secret(store: Store, tenant: str, grace_s: int, configured: str | None) -> int:
    """Replace a tenant's callback secret; the replaced one (for the default tenant without one of its own: the
    deprecated deployment-wide secret) still signs beside the new for `grace_s` seconds."""
    from stoker.core.callbacks import deployment_fallback
    from stoker.core.tenancy import check_tenant

    if grace_s < 0:
        raise SystemExit("--grace must be 0 or more seconds")
    try:
        check_tenant(tenant)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    secret = store.callbacks.rotate(tenant, grace_s, deployment_fallback(tenant, configured))
    print(f"tenant {tenant}'s callbacks are now signed with this secret and, for {grace_s} s, the old one too:")
    print(secret)
    return 0


_HANDLERS = {
    "up": _up,
    "worker": _worker,
    "reaper": _reaper,
    "batch-feeder": _batch_feeder,
    "api": _api,
    "submit": _submit,
    "batch": _batch,
    "model": _model,
    "cache": _cache,
    "stats": _cache,
    "keys": _keys,
    "verify-callback": _verify_callback,
    "docs": _docs,
}

if __name__ == "__main__":
    sys.exit(main())
