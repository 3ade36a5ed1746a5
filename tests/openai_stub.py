"""A real local HTTP server that speaks the OpenAI chat-completions protocol.

Not a mock: it listens on 127.0.0.1 (a random port), the harness talks to it
through the `openai` package over HTTP exactly as it would to vLLM, and it
answers from a script, in order:

    with OpenAIStub([reply("", call("read_file", {"path": "a.py"}), call("read_file", {"path": "b.py"})),
                     fail(500),
                     reply("done")]) as stub:
        policy = OpenAIPolicy(stub.base_url)
        ...
        stub.requests  # every chat request body received, parsed

Script items: `reply(...)` (an assistant message, optionally with tool calls
and a delay), `fail(status)` (an HTTP error), `raw(body)` (a 200 answer sent
as given, for servers that bend the protocol), or a callable that receives
the request body and returns one of those. When the script runs out, the
stub answers "stub script exhausted" without tool calls, so an episode ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    usage: tuple[int, int] | None = None  # (prompt, completion); None: estimated from the request
    delay_s: float = 0.0


@dataclass
class Fail:
    status: int = 500
    message: str = "stub: scripted failure"
    retry_after_ms: int | None = 20


@dataclass
class Raw:
    body: dict


ScriptItem = Reply | Fail | Raw | Callable[[dict], "Reply | Fail | Raw"]
_ids = iter(range(1, 1 << 30))


def call(name: str, arguments: dict | str, id: str | None = None) -> dict:
    """A tool call; a str `arguments` is sent verbatim (e.g. malformed JSON)."""
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": id or f"call_{next(_ids)}", "type": "function", "function": {"name": name, "arguments": raw}}


def reply(content: str = "", *tool_calls: dict, usage: tuple[int, int] | None = None, delay_s: float = 0.0) -> Reply:
    return Reply(content, list(tool_calls), usage, delay_s)


def raw(body: dict) -> Raw:
    return Raw(body)


def fail(status: int = 500, message: str = "stub: scripted failure", retry_after_ms: int | None = 20) -> Fail:
    return Fail(status, message, retry_after_ms)


class OpenAIStub:
    def __init__(self, script: list[ScriptItem] | None = None, model: str = "stub-model"):
        self.script: list[ScriptItem] = list(script or [])
        self.model = model
        self.requests: list[dict] = []  # chat request bodies, in arrival order
        self.request_times: list[float] = []
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def add(self, *items: ScriptItem) -> None:
        with self.lock:
            self.script.extend(items)

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- protocol -------------------------------------------------------------------

    def _next(self, body: dict) -> Reply | Fail | Raw:
        with self.lock:
            self.requests.append(body)
            self.request_times.append(time.perf_counter())
            item = self.script.pop(0) if self.script else Reply("stub script exhausted")
        return item(body) if callable(item) else item

    def _completion(self, body: dict, r: Reply) -> dict:
        message: dict = {"role": "assistant", "content": r.content or None}
        if r.tool_calls:
            message["tool_calls"] = r.tool_calls
        prompt, completion = r.usage or (len(json.dumps(body.get("messages", []))) // 4, len(json.dumps(message)) // 4)
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if r.tool_calls else "stop",
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(
                        200,
                        {
                            "object": "list",
                            "data": [{"id": stub.model, "object": "model", "created": 0, "owned_by": "stub"}],
                        },
                    )
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                    return
                body = json.loads(raw or b"{}")
                item = stub._next(body)
                if isinstance(item, Fail):
                    headers = {} if item.retry_after_ms is None else {"retry-after-ms": str(item.retry_after_ms)}
                    self._send(item.status, {"error": {"message": item.message, "type": "stub_error"}}, headers)
                    return
                if isinstance(item, Raw):
                    self._send(200, item.body)
                    return
                if item.delay_s:
                    time.sleep(item.delay_s)
                self._send(200, stub._completion(body, item))

        return Handler
