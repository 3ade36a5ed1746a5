"""An OpenAI-compatible HTTP server over the engine (aiohttp).

    POST /v1/chat/completions   messages, tools, temperature, top_p, max_tokens
                                (or max_completion_tokens), stop, seed, stream,
                                logprobs -> a chat.completion (or SSE chunks)
    GET  /v1/models             the one model served
    GET  /health                200 when up

Each request renders its messages with the chat template (`chat.encode_chat`),
is submitted to the engine (whose background thread batches all requests in
flight into the same decode steps) and awaited without blocking the event
loop. `tool_choice` "required" or a named function, a tool marked `"strict":
true`, or a server started with `tool_grammar` constrain decoding so that
every tool call parses and fits its schema (`grammar.py`); "none" offers no
tools. The completion is parsed with `chat.parse_tool_calls`: tool calls come
back as OpenAI `tool_calls` with ids unique to the response and
`finish_reason: "tool_calls"`; otherwise "stop" (the turn ended) or
"length" (max_tokens or the context ran out).

Streaming sends the content as it is generated; once the model opens a tool
call the rest of the turn is held back and its calls are sent, parsed, at
the end (a call is only useful whole). With `logprobs`, each chunk carries the
logprobs of the tokens generated since the last one (a token held back is
reported with the next chunk sent), so a stream's logprobs are the response's.
A stream that fails partway ends with an `{"error": ...}` chunk and `[DONE]`.
A client that disconnects cancels its request in the engine: the server runs
with aiohttp's `handler_cancellation`, so a handler still waiting on the
engine is cancelled with its connection.

A checkpoint trained on the bare prompt (`codefleet train`'s `model.prompt=bare`, the
default there) never saw a system prompt or tool schemas; served with
`prompt="bare"`, every request is rendered the way it was trained: system
messages and tool schemas are left out of the prompt (tool calls are still
parsed and returned), so a client that sends the full prompt, such as
`codefleet agent run`, gets the policy it trained.

A field sent as `null` counts as not sent (OpenAI clients do that), and a
`developer` message is a `system` message. Bad requests (invalid JSON,
missing or malformed fields, an unknown model, a prompt longer than the
context) get a 4xx with the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`; nothing a client sends can
stop the server.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from codefleet.model import chat
from codefleet.model.chat import check_prompt
from codefleet.model.engine import Engine, Result
from codefleet.model.grammar import call_node
from codefleet.model.sampling import SamplingParams

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error response."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status)


@dataclass
class ChatRequest:
    """A validated chat-completions request."""

    prompt: list[int]
    params: SamplingParams
    tools: list[dict]
    stream: bool
    include_usage: bool
    logprobs: bool


def parse_request(body: object, engine: Engine, tokenizer, model_name: str, default_max_tokens: int,
                  prompt: str = "full", tool_grammar: bool = False) -> ChatRequest:
    """Validate an OpenAI chat-completions body; raises RequestError naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object with \"model\" and \"messages\"")
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(f"the model {model!r} does not exist here; this server serves {model_name!r} "
                           "(GET /v1/models)", param="model", code="model_not_found", status=404)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("\"messages\" must be a non-empty array of chat messages", param="messages",
                           code="missing_required_parameter" if messages is None else "invalid_type")
    # OpenAI's "developer" role is the system prompt of newer models
    messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                for m in messages]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in chat.ROLE_TOKENS:
            raise RequestError(f"messages[{i}] must be an object whose \"role\" is one of "
                               f"{', '.join(chat.ROLE_TOKENS)} or developer", param=f"messages[{i}]",
                               code="invalid_value")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError(f"messages[{i}].content must be a string, an array of content parts or null",
                               param=f"messages[{i}].content", code="invalid_type")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("\"tools\" must be an array of {\"type\": \"function\", \"function\": {...}} objects",
                           param="tools", code="invalid_type")
    tools, constrain, choice = _tool_choice(body.get("tool_choice"), tools, tool_grammar)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestError("only n=1 is supported; send several requests for several completions", param="n",
                           code="invalid_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise RequestError("\"stop\" must be a string or an array of strings", param="stop", code="invalid_type")
    params = SamplingParams(
        max_tokens=_field(body, "max_tokens", max_tokens, int, default_max_tokens),
        temperature=float(_field(body, "temperature", body.get("temperature"), (int, float), 1.0)),
        top_p=float(_field(body, "top_p", body.get("top_p"), (int, float), 1.0)),
        top_k=_field(body, "top_k", body.get("top_k"), int, 0),
        seed=_field(body, "seed", body.get("seed"), int, None),
        stop=[s for s in (stop or []) if s], stop_token_ids=chat.stop_ids(tokenizer),
        tools=tools if constrain else None, tool_choice=choice)
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or top_logprobs != 0):
        raise RequestError("top_logprobs is not supported: this server returns only the sampled tokens' logprobs "
                           "(\"logprobs\": true); leave top_logprobs out or set it to 0", param="top_logprobs",
                           code="invalid_value")
    if params.temperature > 2:
        raise RequestError(f"temperature must be between 0 and 2, got {params.temperature}", param="temperature",
                           code="invalid_value")
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(str(e), param=str(e).split()[0], code="invalid_value") from None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("\"stream\" must be true or false", param="stream", code="invalid_type")
    stream_options = body.get("stream_options") or {}
    shown, shown_tools = messages, tools
    if prompt == "bare":  # the policy was trained on the conversation alone (module docstring)
        shown, shown_tools = [m for m in messages if m["role"] != "system"], None
        if not shown:
            raise RequestError("this model was trained without system prompts and sees none; send the task as a "
                               "user message", param="messages", code="invalid_value")
    try:
        ids = chat.encode_chat(tokenizer, shown, shown_tools)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RequestError(f"the messages could not be rendered: {e}", param="messages", code="invalid_value") from None
    room = engine.max_seq_len - len(ids)
    if room < 1:
        raise RequestError(f"the prompt has {len(ids)} tokens but this model's context is {engine.max_seq_len} "
                           "tokens; shorten the messages", param="messages", code="context_length_exceeded")
    params.max_tokens = min(params.max_tokens, room)
    return ChatRequest(ids, params, tools, bool(stream), bool(isinstance(stream_options, dict)
                                                           and stream_options.get("include_usage")),
                       bool(body.get("logprobs")))


def _tool_choice(tool_choice: object, tools: list[dict], tool_grammar: bool) -> tuple[list[dict], bool, str]:
    """(the tools offered, whether decoding is constrained to them, the grammar's tool choice) for OpenAI's
    `tool_choice`. "required" and a named function are honoured by constraining decoding (model.grammar); so
    is "auto" for tools marked `"strict": true`, or for every request on a server started with tool_grammar."""
    def name_of(tool: dict) -> object:
        return (tool.get("function") or {}).get("name") if isinstance(tool.get("function"), dict) else tool.get("name")

    if tool_choice == "none":
        return [], False, "auto"
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}}
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) \
            else None
        tools = [t for t in tools if name_of(t) == name]
        if not tools:
            raise RequestError(f"tool_choice names the function {name!r}, which is not in \"tools\"",
                               param="tool_choice", code="invalid_value")
        tool_choice = "required"
    elif tool_choice not in (None, "auto", "required"):
        raise RequestError("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
    if tool_choice == "required":
        if not tools:
            raise RequestError("tool_choice requires a tool call but \"tools\" is empty", param="tool_choice",
                               code="invalid_value")
        constrain = True
    else:
        constrain = bool(tools) and (tool_grammar or any(
            isinstance(t.get("function"), dict) and t["function"].get("strict") is True for t in tools))
    if constrain:
        try:
            call_node(tools)
        except ValueError as e:
            raise RequestError(f"the tools cannot constrain decoding: {e}", param="tools", code="invalid_value") \
                from None
    return tools, constrain, tool_choice or "auto"


def _field(body: dict, name: str, value: object, types, default):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, types):
        kind = "an integer" if types is int else "a number"
        raise RequestError(f"\"{name}\" must be {kind}, got {json.dumps(value)}", param=name, code="invalid_type")
    return value


def build_completion(result: Result, request: ChatRequest, tokenizer, model_name: str, completion_id: str,
                     created: int) -> dict:
    """The chat.completion body for a finished engine result (tool calls parsed from its text)."""
    if request.tools:
        parsed = chat.parse_tool_calls(result.text, id_prefix=f"call_{completion_id[-8:]}_")
        content, calls = parsed.content, chat.openai_tool_calls(parsed.tool_calls)
    else:  # no tools offered: the turn is all content
        content, calls = result.text, []
    finish = result.finish_reason
    if calls and finish == "stop":
        finish = "tool_calls"
    message: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    choice: dict = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if request.logprobs:
        choice["logprobs"] = {"content": _logprobs_content(result, tokenizer)}
    n_prompt, n_out = len(result.prompt_token_ids), len(result.token_ids)
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [choice], "system_fingerprint": None,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                      "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}}


def _logprobs_content(result: Result, tokenizer) -> list[dict]:
    return [_token_logprob(tokenizer, tok, lp) for tok, lp in zip(result.token_ids, result.logprobs)]


def _token_logprob(tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw), "top_logprobs": []}


class ChatServer:
    """The aiohttp application over one engine."""

    def __init__(self, engine: Engine, tokenizer, model_name: str = "codefleet", default_max_tokens: int = 1024,
                 prompt: str = "full", tool_grammar: bool = False):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.default_max_tokens, self.prompt = default_max_tokens, check_prompt(prompt)
        self.tool_grammar = tool_grammar  # constrain every request's tool calls (model.grammar), not only strict ones
        self.created = int(time.time())
        self.app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.model)
        self.app.router.add_get("/health", self.health)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            return error_response(e.message, e.status, e.param, e.code, e.type)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            what = {404: f"no route {request.method} {request.path}; this server serves POST /v1/chat/completions "
                         "and GET /v1/models",
                    405: f"{request.method} is not allowed on {request.path}"}.get(e.status, e.reason)
            return error_response(what, e.status, code=str(e.status))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # the server keeps serving
            log.exception("request failed")
            return error_response(f"the server failed on this request: {type(e).__name__}: {e}", 500,
                                  type_="server_error")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "running": self.engine.n_running,
                                  "waiting": self.engine.n_waiting, "version": self.engine.version})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "codefleet",
                "max_model_len": self.engine.max_seq_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            raise RequestError(f"the model {request.match_info['model']!r} does not exist here; this server serves "
                               f"{self.model_name!r}", param="model", code="model_not_found", status=404)
        return web.json_response(self._model_card())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object with \"model\" and "
                               "\"messages\"", code="invalid_json") from None
        req = parse_request(body, self.engine, self.tokenizer, self.model_name, self.default_max_tokens,
                            self.prompt, self.tool_grammar)
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if req.stream:
            return await self._stream(request, req, completion_id, created)
        future = self.engine.submit(req.prompt, req.params)
        result = await asyncio.wrap_future(future)  # cancelling this (client gone) cancels the engine request
        return web.json_response(build_completion(result, req, self.tokenizer, self.model_name, completion_id,
                                                  created))

    async def _stream(self, request: web.Request, req: ChatRequest, completion_id: str, created: int
                      ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        future = self.engine.submit(req.prompt, req.params,
                                    on_token=lambda tok, lp: loop.call_soon_threadsafe(tokens.put_nowait, (tok, lp)))
        done = asyncio.wrap_future(future)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        unsent: list[dict] = []  # logprobs of the tokens since the last chunk (with req.logprobs)

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
            logprobs = None
            if req.logprobs and usage is None:
                logprobs = {"content": list(unsent)}
                unsent.clear()
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                           "logprobs": logprobs}]}
            if usage is not None:
                body["choices"], body["usage"] = [], usage
            return f"data: {json.dumps(body)}\n\n".encode()

        stop_ids = set(req.params.stop_token_ids)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        held = False  # a tool call opened: hold the rest back until the turn is parsed
        sent = ""  # the content streamed so far
        getter: asyncio.Future | None = None
        try:
            await response.prepare(request)
            await response.write(chunk({"role": "assistant", "content": ""}))
            while True:
                getter = asyncio.ensure_future(tokens.get())
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    if tokens.empty():
                        break
                    tok, lp = tokens.get_nowait()
                else:
                    tok, lp = getter.result()
                if req.logprobs:
                    unsent.append(_token_logprob(self.tokenizer, tok, lp))
                if held or tok in stop_ids:
                    continue
                if tok == self.tokenizer.call_open_id and req.tools:
                    held = True
                    continue
                piece = decoder.decode(self.tokenizer.token_bytes(tok))
                if req.params.stop:  # never send text a stop string will cut
                    continue
                if piece:
                    await response.write(chunk({"content": piece}))
                    sent += piece
            tail = decoder.decode(b"", final=True)
            if tail and not held and not req.params.stop:
                await response.write(chunk({"content": tail}))
                sent += tail
            result = done.result()
            final = build_completion(result, req, self.tokenizer, self.model_name, completion_id, created)
            message = final["choices"][0]["message"]
            content = message.get("content") or ""
            # what was held back: everything, for stop strings (sent cut); the text between or after tool calls
            rest = content[len(sent):] if content.startswith(sent) else ""
            if rest:
                await response.write(chunk({"content": rest}))
            for i, call in enumerate(message.get("tool_calls") or []):
                await response.write(chunk({"tool_calls": [{"index": i, **call}]}))
            await response.write(chunk({}, final["choices"][0]["finish_reason"]))
            if req.include_usage:
                await response.write(chunk({}, usage=final["usage"]))
            await response.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            future.cancel()
            raise
        except Exception as e:  # once the headers are sent, report it in the stream and end it
            future.cancel()
            if not response.prepared:
                raise
            log.exception("stream failed")
            error = {"message": f"the server failed on this request: {type(e).__name__}: {e}", "type": "server_error",
                     "param": None, "code": None}
            with contextlib.suppress(ConnectionResetError):
                await response.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
        finally:
            if getter is not None:
                getter.cancel()
        return response


# -- running it ---------------------------------------------------------------------------


class ServerThread:
    """Serve `ChatServer` on host:port from a background thread (tests, notebooks, the local policy).

        with ServerThread(engine, tokenizer, port=0) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="x")
    """

    def __init__(self, engine: Engine, tokenizer, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "codefleet", default_max_tokens: int = 1024, prompt: str = "full",
                 tool_grammar: bool = False):
        self.server = ChatServer(engine, tokenizer, model_name, default_max_tokens, prompt, tool_grammar)
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="codefleet-server", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> ServerThread:
        self._thread.start()
        self._started.wait(timeout=30)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        runner = web.AppRunner(self.server.app, access_log=None, handler_cancellation=True)
        try:
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked
            self._stop = asyncio.Event()
        except Exception as e:  # reported to start()'s caller
            self._error = e
            self._started.set()
            await runner.cleanup()
            return
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(engine: Engine, tokenizer, host: str, port: int, model_name: str, prompt: str = "full",
               tool_grammar: bool = False) -> None:
    """Serve until interrupted (the `codefleet serve` command)."""
    server = ChatServer(engine, tokenizer, model_name, prompt=prompt, tool_grammar=tool_grammar)
    shown = "; bare prompt: system messages and tool schemas are not rendered" if prompt == "bare" else ""
    shown += "; tool calls constrained to their schemas" if tool_grammar else ""
    print(f"codefleet serve: {model_name} on http://{host}:{port}/v1 (max batch {engine.max_batch}, context "
          f"{engine.max_seq_len} tokens{shown})", flush=True)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its engine request
    web.run_app(server.app, host=host, port=port, print=None, access_log=None, handler_cancellation=True)
