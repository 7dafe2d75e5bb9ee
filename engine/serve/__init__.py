"""``python -m engine serve MODEL``: the engine behind an OpenAI-compatible HTTP API.

FastAPI and uvicorn (``pip install -e ".[serve]"``) are imported here only: ``import
engine`` and ``python -m engine generate`` never need them.

* ``engine.serve.protocol``: request bodies checked into SamplingParams, the OpenAI
  response and chunk schemas, the error body;
* ``engine.serve.worker``: the engine thread, the only caller of ``LLM.step`` (requests
  from the event loop join the next step's batch; aborts free blocks at the next step);
* ``engine.serve.app``: the FastAPI app, its endpoints and streams;
* ``engine.serve.metrics``: ``GET /metrics`` in Prometheus' text format.

Shutdown: SIGTERM or Ctrl-C stops accepting connections, lets running requests finish
for up to ``--shutdown-timeout`` seconds, aborts the rest, stops the engine thread and
exits with status 0.
"""

import signal
import sys

import uvicorn

from .app import build_app

__all__ = ["build_app", "check_options", "serve"]


def check_options(args):
    """ValueError naming the option for a bad server option (before the model loads)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected an int in [0, 65535], got {args.port}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting: expected an int >= 0, got {args.max_waiting}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout: expected seconds >= 0, got {args.shutdown_timeout}")


def serve(llm, args):
    """Compile (or load) the model's kernels, then serve ``llm`` on ``args.host``:
    ``args.port`` until SIGTERM or Ctrl-C (module docstring, Shutdown)."""
    llm.warmup(progress=True)  # no request pays for compiling
    name = args.served_model_name or args.model or str(llm.source)
    app = build_app(llm, model_name=name, max_waiting=args.max_waiting)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info" if args.verbose else "warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    # uvicorn raises the signal it caught again once it has shut down; with these
    # handlers that ends nothing, so a shutdown by signal exits 0 (its default SIGTERM
    # handler would kill the process, its SIGINT one raise KeyboardInterrupt)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    sys.stderr.write(f"serving {name} on http://{args.host}:{args.port} (OpenAI API: /v1)\n")
    sys.stderr.flush()
    server.run()
    if not server.started:  # the port was taken, or the app failed to start
        raise SystemExit(
            f"python -m engine serve: error: could not serve on {args.host}:{args.port}"
        )
