"""``python -m gradsync.elastic.store --port 29400``: host the store of a fault-tolerant run.

The store itself is tcp_store.py ([Note: a store outside the trainers]); ``gradsync.elastic`` does
not import this module, so ``python -m`` runs it fresh (no runpy warning).
"""

from __future__ import annotations

import argparse
import signal
import threading

from .tcp_store import DEFAULT_PORT, connect, serve

__all__ = ["DEFAULT_PORT", "connect", "main", "serve"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Host the rendezvous store of a gradsync fault-tolerant run.")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    args = parser.parse_args(argv)
    store = serve(args.host, args.port)
    print(f"gradsync store serving on port {store.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


if __name__ == "__main__":
    main()
