"""Server commands of `luminal-cloud` (serve, worker, runtime, stack, admin, demo), by entry point."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cloud.settings import Settings

log = logging.getLogger(__name__)


def register(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="run the server (embedded defaults)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on (default: 8000)")
    _data_dir_option(serve)
    serve.set_defaults(run=_serve)

    worker = commands.add_parser(
        "worker", help="run a Celery compile worker (compile_backend=celery; broker at LUMINAL_REDIS_URL)"
    )
    worker.add_argument(
        "--targets", default=None, help="comma-separated targets this worker compiles for; a GPU type it cannot "
        "compile on its device is refused (default: those of LUMINAL_TARGETS it can compile)"
    )
    worker.add_argument(
        "--device", default=None, help="the GPU its GPU targets compile and are timed on: cuda:N, or cpu for none "
        "(default: GPU 0); a GPU target needs a GPU of its compute capability unless "
        "LUMINAL_ALLOW_UNMEASURED_COMPILE=true",
    )
    worker.add_argument(
        "--concurrency", type=int, default=None, help="compiles at a time (default: LUMINAL_COMPILE_WORKERS)"
    )
    worker.add_argument("--loglevel", default="INFO", help="Celery's log level")
    worker.set_defaults(run=_worker)

    runtime = commands.add_parser(
        "runtime", help="run a runtime process serving queued requests (request_queue=redis)"
    )
    runtime.add_argument(
        "--device", default="cpu", help="the device this process runs models on: cpu, or a GPU type and ordinal (cuda:0, h100:1)"
    )
    runtime.add_argument("--loglevel", default="INFO", help="log level")
    runtime.set_defaults(run=_runtime)

    stack = commands.add_parser(
        "stack", help="run the distributed mode as local processes: Celery workers, runtimes, a gateway"
    )
    stack.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    stack.add_argument("--port", type=int, default=8000, help="the gateway's port")
    stack.add_argument("--workers", type=int, default=1, help="Celery compile workers")
    stack.add_argument(
        "--runtimes", type=_runtime_count, default=2, metavar="N|auto",
        help="runtime processes (device cpu), or auto: as many as requests waiting for one call for, "
        "from --runtime-min to --runtime-max, each stopped after --runtime-idle seconds idle (default: 2)",
    )
    stack.add_argument(
        "--runtime-min", type=int, default=0, help="with --runtimes auto: runtimes kept however idle (default: 0)"
    )
    stack.add_argument("--runtime-max", type=int, default=2, help="with --runtimes auto: at most this many (default: 2)")
    stack.add_argument(
        "--runtime-idle", type=float, default=30.0, metavar="SECONDS",
        help="with --runtimes auto: a runtime idle this long is stopped; the pool goes to zero (default: 30)",
    )
    stack.add_argument(
        "--runtime-target", type=int, default=None, metavar="REQUESTS",
        help="with --runtimes auto: requests waiting per runtime started (default: LUMINAL_MAX_BATCH_ROWS)",
    )
    stack.add_argument("--redis-url", help="default: LUMINAL_REDIS_URL")
    stack.add_argument(
        "--database-url", help="created when missing (default: LUMINAL_DATABASE_URL, else the local PostgreSQL's "
        "database luminal)"
    )
    stack.add_argument(
        "--s3-endpoint", help="default: LUMINAL_S3_ENDPOINT_URL; when neither is set, moto's S3 server is started"
    )
    stack.add_argument(
        "--runtime-metrics-port", type=int, default=0,
        help="the first runtime's /metrics port, the next ones follow (default: free ports)",
    )
    stack.add_argument("--log-dir", type=Path, help="default: LUMINAL_DATA_DIR/logs")
    stack.add_argument("--tenant", help="once ready, create an API key for this tenant and print it")
    stack.add_argument("--start-timeout", type=float, default=120.0, help="seconds each piece has to be ready")
    stack.set_defaults(run=_stack)

    admin = commands.add_parser("admin", help="administration")
    admin_commands = admin.add_subparsers(dest="admin_command", required=True)
    create_key = admin_commands.add_parser(
        "create-key", help="create an API key for a tenant, or with --admin an operator key (/v1/admin)"
    )
    create_key.add_argument("--tenant", help="the tenant the key acts for (created when new)")
    create_key.add_argument(
        "--admin", action="store_true", help="an operator key: reads every tenant's usage, acts for no tenant"
    )
    create_key.add_argument("--name", default="operator", help="who holds the operator key (with --admin)")
    _data_dir_option(create_key)
    create_key.set_defaults(run=_create_key)

    list_keys = admin_commands.add_parser(
        "list-keys", help="list API keys: id, prefix, tenant, created (never the keys themselves)"
    )
    list_keys.add_argument("--tenant", help="only this tenant's keys")
    list_keys.add_argument("--admin", action="store_true", help="the operator keys instead, with who holds each")
    _data_dir_option(list_keys)
    list_keys.set_defaults(run=_list_keys)

    revoke_key = admin_commands.add_parser(
        "revoke-key", help="delete an API key: refused at once by a server revoking it over HTTP, "
        "within LUMINAL_AUTH_CACHE_TTL_S by running servers otherwise"
    )
    revoke_key.add_argument("key", metavar="PREFIX_OR_ID", help="the key's id or prefix (as listed), or the whole key")
    revoke_key.add_argument("--admin", action="store_true", help="an operator key rather than a tenant's")
    _data_dir_option(revoke_key)
    revoke_key.set_defaults(run=_revoke_key)

    demo = commands.add_parser(
        "demo", help="start a server, deploy a sample model, batch, bill (in a temporary data directory)"
    )
    demo.add_argument("--port", type=int, default=0, help="0 picks a free port")
    demo.add_argument("--requests", type=int, default=24, help="concurrent sample requests to send (default: 24)")
    demo.add_argument(
        "--data-dir", type=Path, help="keep the demo's key, model and bill in this directory (default: a temporary "
        "one, removed at the end, with the embedded database and store whatever LUMINAL_* says)"
    )
    demo.add_argument(
        "--sample-dir", type=Path, default=Path("."),
        help="leave the sample model (demo-mlp.onnx) and an input for it (features.npy) here, to try the "
        "deploy and predict commands with (default: the current directory)",
    )
    demo.set_defaults(run=_demo)


def _runtime_count(value: str) -> int | None:
    """--runtimes: a count, or "auto" (None)."""
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of runtimes or auto, not {value!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"a number of runtimes is not negative: {count}")
    return count


def _data_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir", type=Path, help="the data directory: the SQLite database holding the keys, and the object store "
        "(default: LUMINAL_DATA_DIR, else ~/.luminal-cloud); serve and admin must use the same one"
    )


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(data_dir=args.data_dir) if args.data_dir is not None else Settings()


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from api.main import create_app
    from api.services import DataDirInUse, DataDirLock, open_database
    from cloud.errors import LuminalError
    from cloud.storage import make_object_store
    from worker.queue import check_compile_settings

    logging.basicConfig(level=logging.INFO)
    settings = _settings(args)
    try:  # fail before any work, with a message rather than uvicorn's startup traceback
        check_compile_settings(settings)
        DataDirLock(settings.data_dir).release()
        open_database(settings).dispose()  # and brings a PostgreSQL schema to head
        make_object_store(settings)
    except (DataDirInUse, LuminalError, ValueError) as exc:
        sys.exit(f"luminal-cloud serve: {exc}")
    print(f"Luminal Cloud on http://{args.host}:{args.port} (data in {settings.data_dir})")
    uvicorn.run(
        create_app(settings), host=args.host, port=args.port, log_level="info", access_log=settings.access_log
    )


def _worker(args: argparse.Namespace) -> None:
    from api.services import open_database
    from cloud.errors import LuminalError
    from worker.celery_app import run_worker, wait_for_broker
    from worker.devices import check_targets, probe_cuda
    from worker.queue import check_compile_settings

    logging.basicConfig(level=args.loglevel.upper())
    settings = Settings()
    targets = tuple(t for t in (args.targets or ",".join(settings.targets)).split(",") if t)
    unknown = sorted(set(targets) - set(settings.targets))
    if unknown:
        sys.exit(f"luminal-cloud worker: unknown target {', '.join(unknown)}; known: {', '.join(settings.targets)}")
    try:
        check_compile_settings(settings)
        check = check_targets(targets, args.device, probe_cuda, settings.allow_unmeasured_compile)
    except ValueError as exc:
        sys.exit(f"luminal-cloud worker: {exc}")
    # targets asked for by name are refused loudly; of the deployment's, it takes those it can
    if check.refused and (args.targets or not check.accepted):
        sys.exit("\n".join(f"luminal-cloud worker: {reason}" for reason in check.refused.values()))
    for reason in check.refused.values():
        log.warning("not taking this target: %s", reason)
    for target in check.unmeasured:
        log.warning("compiling %s without its GPU, as LUMINAL_ALLOW_UNMEASURED_COMPILE allows: untimed", target)
    try:  # fail at start, with a message, when a service the compiles need is missing
        wait_for_broker(settings)
        open_database(settings).dispose()
    except LuminalError as exc:
        sys.exit(f"luminal-cloud worker: {exc.message}")
    run_worker(settings, check, args.concurrency or settings.compile_workers, args.loglevel.upper())


def _runtime(args: argparse.Namespace) -> None:
    # the runtime role's own wiring, not api.services (the gateway's): a runtime that requests at
    # zero wait for starts without the database layer, the registry, Celery or the codecs
    from api.runtime_role import run_runtime_process
    from cloud.errors import LuminalError

    logging.basicConfig(level=args.loglevel.upper())
    settings = Settings()
    try:  # fail at start, with a message, when Redis or the object store is missing
        run_runtime_process(settings, args.device)
    except LuminalError as exc:
        sys.exit(f"luminal-cloud runtime: {exc.message}")


def _stack(args: argparse.Namespace) -> None:
    from api.stack import StackOptions, run_stack
    from scheduler.autoscale import ScalePolicy

    if args.runtimes is None:
        try:  # the autoscaler's options, checked before anything starts
            ScalePolicy(args.runtime_min, args.runtime_max, args.runtime_target or 1, args.runtime_idle)
        except ValueError as exc:
            sys.exit(f"luminal-cloud stack: --runtimes auto: {exc}")
    options = StackOptions(
        host=args.host, port=args.port, workers=args.workers, runtimes=args.runtimes, redis_url=args.redis_url,
        database_url=args.database_url, s3_endpoint=args.s3_endpoint, runtime_metrics_port=args.runtime_metrics_port,
        log_dir=args.log_dir, tenant=args.tenant, start_timeout_s=args.start_timeout, runtime_min=args.runtime_min,
        runtime_max=args.runtime_max, runtime_idle_s=args.runtime_idle, runtime_target=args.runtime_target,
    )
    sys.exit(run_stack(options))


def _open_database(args: argparse.Namespace):
    from api.services import open_database
    from cloud.errors import LuminalError

    try:
        return open_database(_settings(args))
    except LuminalError as exc:
        sys.exit(f"luminal-cloud admin: {exc}")


def _where(args: argparse.Namespace) -> str:
    settings = _settings(args)
    return "the database of LUMINAL_DATABASE_URL" if settings.database_url else str(settings.data_dir)


def _create_key(args: argparse.Namespace) -> None:
    from cloud.auth import create_admin_key, create_key
    from cloud.errors import InvalidRequest

    if args.admin == bool(args.tenant):
        sys.exit("luminal-cloud admin create-key: give --tenant NAME for a tenant's key, or --admin for an operator's")
    db = _open_database(args)
    try:
        key = create_admin_key(db, args.name) if args.admin else create_key(db, args.tenant)
    except InvalidRequest as exc:
        sys.exit(f"luminal-cloud admin create-key: {exc.message}")
    finally:
        db.dispose()
    # the key last: scripts take the last word; the data directory, since serve must share it
    if args.admin:
        print(f"Operator key for {args.name!r} (for /v1/admin only, in {_where(args)}): {key}")
    else:
        print(f"API key for tenant {args.tenant!r} (in {_where(args)}): {key}")


def _list_keys(args: argparse.Namespace) -> None:
    from cloud.auth import list_admin_keys, list_keys
    from cloud.errors import LuminalError

    if args.admin and args.tenant:
        sys.exit("luminal-cloud admin list-keys: --tenant lists a tenant's keys, --admin the operators': not both")
    db = _open_database(args)
    try:
        keys = list_admin_keys(db) if args.admin else list_keys(db, args.tenant)
    except LuminalError as exc:
        sys.exit(f"luminal-cloud admin list-keys: {exc.message}")
    finally:
        db.dispose()
    rows = [("ID", "PREFIX", "HOLDER" if args.admin else "TENANT", "CREATED")]
    rows += [(str(k.id), k.prefix, k.owner, k.created_at.strftime("%Y-%m-%d %H:%M")) for k in keys]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _revoke_key(args: argparse.Namespace) -> None:
    from cloud.auth import ADMIN_KEY_PREFIX, revoke_admin_key, revoke_key
    from cloud.errors import LuminalError, NotFound

    db = _open_database(args)
    try:
        revoked = (revoke_admin_key if args.admin else revoke_key)(db, args.key)
    except NotFound as exc:
        operators = args.key.startswith(ADMIN_KEY_PREFIX) and not args.admin
        hint = "; it looks like an operator key: add --admin" if operators else ""
        sys.exit(f"luminal-cloud admin revoke-key: {exc.message}{hint}")
    except LuminalError as exc:
        sys.exit(f"luminal-cloud admin revoke-key: {exc.message}")
    finally:
        db.dispose()
    if args.admin:  # operator keys are looked up on every request
        print(f"Revoked operator key {revoked.prefix} (id {revoked.id}, {revoked.owner}); refused from now on")
        return
    ttl = _settings(args).auth_cache_ttl_s
    print(f"Revoked key {revoked.prefix} (id {revoked.id}, tenant {revoked.owner}); running servers refuse it "
          f"within {ttl:g} s (LUMINAL_AUTH_CACHE_TTL_S)")


def _demo(args: argparse.Namespace) -> None:
    import tempfile

    from api.demo import run_demo

    if args.data_dir is not None:
        run_demo(Settings(data_dir=args.data_dir), port=args.port, requests=args.requests, sample_dir=args.sample_dir)
        return
    # the user's own data directory, database and bucket gain no demo key or model on each run
    with tempfile.TemporaryDirectory(prefix="luminal-cloud-demo-") as data_dir:
        settings = Settings(
            data_dir=Path(data_dir), database_url="", object_store="local", compile_backend="embedded",
            request_queue="embedded",
        )
        run_demo(settings, port=args.port, requests=args.requests, sample_dir=args.sample_dir)
    print(f"\n(the demo's data directory {data_dir} is removed; --data-dir DIR keeps one)")
