"""Test helper: run an ASGI app on a real uvicorn server, 127.0.0.1, a free port, in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(app):
    """Yields the base URL; stops the server (and checks it stopped) on exit. The server is handed a
    socket already bound: a port found free, then bound by the server, could be taken in between."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        assert not thread.is_alive()


def trickling_app(reply: bytes, routes: dict[str, str], chunk: int, every_s: float):
    """An app answering each of `routes` ({path: method}) with `reply`, `chunk` bytes every `every_s`
    seconds (a stuck proxy's keep-alive): what a client's timeout must bound as a whole."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    def trickle():
        def body():
            for i in range(0, len(reply), chunk):
                time.sleep(every_s)
                yield reply[i:i + chunk]
        return StreamingResponse(body(), media_type="application/json")  # chunked

    for path, method in routes.items():
        app.add_api_route(path, trickle, methods=[method])
    return app


@contextlib.contextmanager
def silent_endpoint():
    """An HTTP endpoint that takes requests and never answers (a stuck server, a proxy holding them): yields
    its base URL and an Event set once a request has arrived."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    asked, conns = threading.Event(), []

    def take():
        with contextlib.suppress(OSError):  # the listening socket shut below
            while True:
                conn, _ = sock.accept()
                conns.append(conn)
                if conn.recv(65536):
                    asked.set()

    threading.Thread(target=take, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", asked
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept; a close alone does not)
        sock.close()
        for conn in conns:
            conn.close()


def stopped_within(script: str, asked: threading.Event, signum: int, env: dict | None = None) -> float:
    """Run `script` in a Python process; once `asked` is set (its request is in flight), send it `signum`;
    the seconds it took to exit after that (inf past 20 s; the process is then killed)."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    try:
        assert asked.wait(60), proc.stderr.read().decode() if proc.poll() is not None else "no request came"
        proc.send_signal(signum)
        start = time.monotonic()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            return float("inf")
        return time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
