"""A minimal OpenAI-compatible server on loopback for the gate tests (stdlib http.server; the real `specquant serve`
is a later issue). POST /v1/completions and /v1/chat/completions answer from `respond(prompt, max_tokens, stop)`:
the tests plug in scripted answers (to check scoring) or our engine (to check the --server path against the
specquant backend)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _cut(text: str, stop) -> str:
    for s in stop or []:
        if s:
            text = text.split(s)[0]
    return text


class StubServer:
    def __init__(self, respond):
        self.respond = respond
        self.requests: list[dict] = []
        handler = self._handler()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if self.path.endswith("/chat/completions"):
                    prompt = "\n".join(m["content"] for m in body["messages"])
                    text = _cut(server.respond(prompt, body.get("max_tokens"), body.get("stop")), body.get("stop"))
                    out = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                        "finish_reason": "stop"}]}
                elif self.path.endswith("/completions"):
                    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
                    out = {"choices": [{"index": i, "text": _cut(server.respond(p, body.get("max_tokens"),
                                                                               body.get("stop")), body.get("stop")),
                                        "finish_reason": "stop"} for i, p in enumerate(prompts)]}
                else:
                    self.send_error(404)
                    return
                data = json.dumps({"id": "stub", "object": "text_completion", "model": body.get("model"), **out})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        return Handler
