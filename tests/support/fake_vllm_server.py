"""A stand-in for vLLM's server (``python -m tests.support.fake_vllm_server``), so the tests of
what palaestra does around ``vllm serve`` (records, readiness, keys, stopping) run in seconds
without vLLM.

It takes the options palaestra passes, answers ``GET /v1/models`` with the served name and
``/health`` as vLLM does (the key, from ``VLLM_API_KEY``, guards ``/v1`` only), and writes what
it was started with (its arguments and the ``VLLM_*`` variables) to ``$FAKE_VLLM_SEEN``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    for option in ("--model", "--served-model-name", "--host"):
        parser.add_argument(option, required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    key = os.environ.get("VLLM_API_KEY")
    seen = {"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if "VLLM" in k}}
    with open(os.environ["FAKE_VLLM_SEEN"], "w") as out:
        json.dump(seen, out)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/v1") and key:
                if self.headers.get("Authorization") != f"Bearer {key}":
                    return self.reply(401, {"error": "Unauthorized"})
            if self.path == "/v1/models":
                return self.reply(200, {"data": [{"id": args.served_model_name}]})
            self.reply(200 if self.path == "/health" else 404, {})

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    HTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
