"""Say when the local Serve app answers, and what it is doing until then (``make serve`` runs this beside
``serve run``). Standard library only.

    python scripts/wait_ready.py --url http://127.0.0.1:8000 [--since EPOCH_S] [--timeout-s 900]

Prints a progress line when the stage changes and every ``--every-s`` seconds within a stage:

    starting: Serve proxy up, building the application (13 s)
    starting: application deployed, ingress starting (31 s)
    starting: replica of tiny-llama starting: vLLM loads and warms up (42 s)
    ready: http://127.0.0.1:8000 (model tiny-llama)

then a curl example. The stages come from what the HTTP port answers: the proxy's ``/-/healthz``, its route
table ``/-/routes``, the ingress's ``GET /v1/models``, and one 1-token completion, which Serve holds until the
model replica runs (``/v1/models`` is answered by the ingress alone, before the engine is up).

Exit codes: 0 ready, 1 not ready within ``--timeout-s``, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request

POLL_S = 1.0


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body), or (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


def _model_ids(body: bytes) -> list[str]:
    try:
        return [str(item["id"]) for item in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        return []


class FirstRequests(threading.Thread):
    """``GET /v1/models``, then one ``max_tokens: 1`` completion, each with a long timeout: Serve queues them until
    the ingress and then the model replica run (short timeouts would leave a trail of cancelled requests in the
    log), so the completion's answer is the moment a user's request would be served. A request that fails fast
    is tried again after a pause."""

    def __init__(self, url: str, timeout_s: float):
        super().__init__(daemon=True)
        self.url, self.deadline = url, time.monotonic() + timeout_s
        self.model = ""
        self.done = threading.Event()
        self.error = ""

    def _until_answered(self, request: urllib.request.Request) -> bytes | None:
        while time.monotonic() < self.deadline:
            started = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=max(1.0, self.deadline - started)) as response:
                    return response.read()
            except urllib.error.HTTPError as exc:
                self.error = f"HTTP {exc.code} from {request.full_url}"
            except OSError as exc:
                self.error = f"{exc} ({request.full_url})"
            time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))
        return None

    def run(self) -> None:
        while not self.model and time.monotonic() < self.deadline:
            body = self._until_answered(urllib.request.Request(f"{self.url}/v1/models"))
            if body is None:
                return
            ids = _model_ids(body)
            if ids:
                self.model = ids[0]
            else:
                time.sleep(2.0)
        payload = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=payload,
                                         headers={"Content-Type": "application/json"})
        if self._until_answered(request) is not None:
            self.done.set()


def curl_example(url: str, model: str) -> str:
    payload = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})
    return (f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{payload}'")


def wait_ready(url: str, *, since: float, timeout_s: float, every_s: float, out=sys.stdout) -> int:
    url = url.rstrip("/")
    deadline = time.time() + timeout_s
    stage, stage_printed_at = "", 0.0
    probe: FirstRequests | None = None

    def say(text: str) -> None:
        nonlocal stage, stage_printed_at
        now = time.time()
        if text != stage or now - stage_printed_at >= every_s:
            print(f"starting: {text} ({now - since:.0f} s)", file=out, flush=True)
            stage, stage_printed_at = text, now

    while time.time() < deadline:
        if probe is not None:
            if probe.done.wait(POLL_S):
                print(f"ready: {url} (model {probe.model})", file=out, flush=True)
                print("Try:", file=out)
                print(curl_example(url, probe.model), file=out, flush=True)
                return 0
            if not probe.is_alive():
                break
            say(f"replica of {probe.model} starting: vLLM loads and warms up" if probe.model
                else "application deployed, ingress starting")
            continue
        status, _ = _get(f"{url}/-/healthz")
        if status == 0:
            say("waiting for Serve's HTTP proxy")
        else:
            routes_status, routes = _get(f"{url}/-/routes")
            if routes_status != 200 or routes.strip() in (b"", b"{}"):
                say("Serve proxy up, building the application")
            else:
                probe = FirstRequests(url, max(1.0, deadline - time.time()))
                probe.start()
                continue
        time.sleep(POLL_S)
    print(f"not ready: {url} did not serve a request within {timeout_s:.0f} s; see the log above "
          f"(last stage: {stage or 'nothing answered'}"
          + (f", last error: {probe.error}" if probe is not None and probe.error else "") + ")",
          file=out, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  python scripts/wait_ready.py --url http://127.0.0.1:8000 --since $(date +%s)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the Serve HTTP address (default %(default)s)")
    parser.add_argument("--since", type=float, default=None, help="epoch seconds the start is counted from (default: now)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up after this many seconds (default %(default)s)")
    parser.add_argument("--every-s", type=float, default=10.0, help="repeat a stage's line this often (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        return wait_ready(args.url, since=args.since or time.time(), timeout_s=args.timeout_s, every_s=args.every_s)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
