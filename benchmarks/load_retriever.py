"""Load test of the retriever server: `selfevo serve-retriever` over the real corpus on 127.0.0.1,
driven by N concurrent HTTP clients (each its own connection) for a bounded number of requests;
reports requests/s, p50/p99 latency and errors per level, then stops the server.

    python benchmarks/load_retriever.py [--corpus PATH] [--qa-dir DIR] [--clients 1 4 16 64]
                                        [--requests 200] [--out docs/reliability.md]

Each request is what a Search-R1 agent sends: one question (from the QA sets, in order, cycled),
topk 3, scores on; one extra level sends 32 questions a request. An error is anything but a 200
with one result list per query (a refused connection, a timeout, a 4xx/5xx). The server is checked
to be unreachable on the machine's non-loopback address. Client and server share the machine, so
the figures are a floor for the server alone. Writes the "## Load: retriever server" section of
docs/reliability.md. `tests/test_reliability.py` runs `load()` against an in-process server.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SECTION = "## Load: retriever server"
REPO = Path(__file__).resolve().parents[1]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    # the ceil of q% of n, as a 1-based rank (round() rounds .5 to even: one rank high at times)
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values) / 100) - 1))
    return sorted_values[k]


async def _client(url: str, queries: list[str], start: int, n: int, batch: int, topk: int,
                  latencies: list[float], errors: list[str]) -> None:
    async with httpx.AsyncClient(timeout=30.0) as http:
        for i in range(n):
            qs = [queries[(start + i * batch + j) % len(queries)] for j in range(batch)]
            t = time.perf_counter()
            try:
                r = await http.post(f"{url}/retrieve", json={"queries": qs, "topk": topk, "return_scores": True})
                ok = r.status_code == 200 and len(r.json()["result"]) == batch
                problem = None if ok else f"HTTP {r.status_code}"
            except (httpx.HTTPError, ValueError, KeyError) as e:
                problem = f"{type(e).__name__}: {e}"
            latencies.append(time.perf_counter() - t)
            if problem:
                errors.append(problem)


def load(url: str, queries: list[str], clients: int, requests_per_client: int, batch: int = 1,
         topk: int = 3) -> dict:
    """Drive `url` with `clients` concurrent clients, each sending `requests_per_client` requests
    one after another; return throughput, latency percentiles and errors."""
    latencies: list[float] = []
    errors: list[str] = []

    async def main() -> float:
        t = time.perf_counter()
        await asyncio.gather(*(_client(url, queries, c * requests_per_client * batch, requests_per_client, batch,
                                       topk, latencies, errors) for c in range(clients)))
        return time.perf_counter() - t

    seconds = asyncio.run(main())
    lat = sorted(latencies)
    n = len(lat)
    return {"clients": clients, "batch": batch, "requests": n, "errors": len(errors),
            "first_errors": sorted(set(errors))[:3], "seconds": round(seconds, 3),
            "requests_per_s": round(n / seconds, 1), "queries_per_s": round(n * batch / seconds, 1),
            "p50_ms": round(statistics.median(lat) * 1000, 2) if lat else float("nan"),
            "p99_ms": round(_percentile(lat, 99) * 1000, 2), "max_ms": round(lat[-1] * 1000, 2) if lat else 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def non_loopback_address() -> str | None:
    """This machine's outward address (no packet is sent), or None when it only has loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class Server:
    """`selfevo serve-retriever` in a child process, default host (loopback)."""

    def __init__(self, corpus: Path, port: int | None = None, extra: list[str] | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "selfevo.cli", "serve-retriever", "--corpus", str(corpus),
                                      "--port", str(self.port), *(extra or [])],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "COLUMNS": "200"})
        self.startup_s = self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> float:
        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.output()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout} s: {self.output()[-2000:]}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly on Ctrl-C
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _section(rows: list[dict], meta: dict) -> str:
    table = "\n".join(
        f"| {r['clients']} | {r['batch']} | {r['requests']:,} | {r['errors']} | {r['requests_per_s']:,.0f} | "
        f"{r['queries_per_s']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.1f} |" for r in rows)
    total = sum(r["requests"] for r in rows)
    errors = sum(r["errors"] for r in rows)
    return f"""{SECTION}

- Command: `{meta['command']}` (from the repo root)
- Machine: {meta['machine']}; load average {meta['load_average']} at the start (other work on the machine)
- Server: `selfevo serve-retriever --corpus {meta['corpus_name']}` (BM25 over {meta['documents']:,} passages, default
  host 127.0.0.1, one uvicorn worker, ready {meta['startup_s']:.1f} s after start)
- Clients: `httpx.AsyncClient`, one connection each, in one process on the same cores; questions: the
  {meta['questions']:,} questions of the seven QA sets, cycled; topk 3, scores on; each client sends its requests
  one after another.

**{total:,} requests, {errors} errors.** Reachable on 127.0.0.1: {meta['loopback_ok']}; reachable on the machine's
other address ({meta['other_address'] or 'none'}): {meta['other_reachable']}.

| clients | queries / request | requests | errors | requests/s | queries/s | p50 ms | p99 ms | max ms |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{table}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=REPO / "../shared/data/corpus/wiki18-mini.jsonl")
    ap.add_argument("--qa-dir", type=Path, default=REPO / "../shared/data/qa")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=200, help="requests per client and level")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "reliability.md")
    args = ap.parse_args()
    from _common import machine_line, write_section

    from selfevo.corpus import read_qa_dir

    queries = [it.question for items in read_qa_dir(args.qa_dir).values() for it in items]
    load_average = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    with Server(args.corpus) as server:
        docs = httpx.get(f"{server.url}/health").json()["documents"]
        print(f"server ready in {server.startup_s:.1f} s: {docs:,} documents at {server.url}")
        levels = [(c, 1, args.requests) for c in args.clients] + [(4, 32, max(1, args.requests // 4))]
        for clients, batch, n in levels:
            load(server.url, queries, clients, 5, batch)  # warm up: connections, caches
            r = load(server.url, queries, clients, n, batch)
            rows.append(r)
            print(f"{clients:3d} clients × {n} requests × {batch} queries: {r['requests_per_s']:8.1f} req/s, "
                  f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, errors {r['errors']} {r['first_errors']}")
        other = non_loopback_address()
        meta = {"command": "python benchmarks/load_retriever.py" + (
                    "" if args.clients == [1, 4, 16, 64] else " --clients " + " ".join(map(str, args.clients)))
                + ("" if args.requests == 200 else f" --requests {args.requests}"),
                "machine": machine_line(), "load_average": load_average, "corpus_name": args.corpus.name,
                "documents": docs,
                "startup_s": server.startup_s, "questions": len(queries),
                "loopback_ok": reachable("127.0.0.1", server.port), "other_address": other,
                "other_reachable": reachable(other, server.port) if other else "n/a"}
        alive = server.proc.poll() is None
    print(f"server still running at the end: {alive}; loopback {meta['loopback_ok']}, "
          f"{other}: {meta['other_reachable']}")
    write_section(args.out, SECTION, _section(rows, meta), title="# Reliability")
    print(f"wrote {SECTION!r} to {args.out}")
    bad = sum(r["errors"] for r in rows) or not alive or meta["other_reachable"] is True
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
