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

__all__ = ["build_app", "serve"]


def serve(llm, args, *, model_name=None, verbose=False):
    """Compile (or load) the model's kernels, then serve ``llm`` on ``args.host``:
    ``args.port`` (``args``: an ``engine.args.ServeArgs``, checked) until SIGTERM or Ctrl-C
    (module docstring, Shutdown). ``model_name``: the MODEL argument as given, the API's
    name for it unless ``args.served_model_name``; ``verbose``: uvicorn's info log."""
    llm.warmup(progress=True)  # no request pays for compiling
    name = args.served_model_name or model_name or str(llm.source)
    app = build_app(llm, model_name=name, max_waiting=args.max_waiting)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info" if verbose else "warning",
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
