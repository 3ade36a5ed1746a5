"""An OpenAI-compatible HTTP server over the engine (aiohttp).

    POST /v1/chat/completions   messages, tools, temperature, top_p, max_tokens
                                (or max_completion_tokens), stop, seed, stream,
                                logprobs -> a chat.completion (or SSE chunks)
    GET  /v1/models             the one model served
    GET  /health                200 when up

Each request renders its messages with the checkpoint's chat format
(`formats.of(tokenizer)`: codefleet's template, or a Hugging Face
checkpoint's own chat template and tool-call format), is submitted to the engine (whose background thread batches all requests in
flight into the same decode steps) and awaited without blocking the event
loop. `tool_choice` "required" or a named function, a tool marked `"strict":
true`, or a server started with `tool_grammar` constrain decoding so that
every tool call parses and fits its schema (`grammar.py`). "required" and a
named function also make the turn tool calls alone: its first token opens a
call (of the named function, and only one), so any model, a random one too,
answers with a call rather than text until `max_tokens`. "none" offers no
tools and the turn may not open a call. The completion is parsed with
the format's tool-call parser (`tool_parser`): tool calls come back as OpenAI `tool_calls` with ids
unique to the response and `finish_reason: "tool_calls"`; otherwise "stop"
(the turn ended) or "length" (max_tokens ran out). `logprobs` with
`top_logprobs` (0 to 20) also returns the likeliest tokens at each step.

The body is parsed and the prompt tokenized in a worker thread, so a long
prompt does not stall the other clients, and a prompt whose characters alone
prove it longer than the context (a token holds at most the tokenizer's
longest token's bytes) is refused before it is tokenized. As OpenAI does, a
prompt over the context, or a `max_tokens` over the room the prompt leaves in
it, is a 400 (`context_length_exceeded`), not a completion cut short.

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
missing or malformed fields, an unknown model, a prompt or `max_tokens` over
the context) get a 4xx with the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`; nothing a client sends can
stop the server.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from codefleet.chat import formats, tool_parser
from codefleet.chat.codefleet_template import check_prompt
from codefleet.inference.engine import Engine, Result
from codefleet.inference.grammar import call_node
from codefleet.inference.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


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
    fmt = formats.of(tokenizer)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in fmt.roles:
            raise RequestError(f"messages[{i}] must be an object whose \"role\" is one of "
                               f"{', '.join(fmt.roles)} or developer", param=f"messages[{i}]",
                               code="invalid_value")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError(f"messages[{i}].content must be a string, an array of content parts or null",
                               param=f"messages[{i}].content", code="invalid_type")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("\"tools\" must be an array of {\"type\": \"function\", \"function\": {...}} objects",
                           param="tools", code="invalid_type")
    tools, grammar = _tool_choice(body.get("tool_choice"), tools, tool_grammar)
    markers = (fmt.tool_calls.call_open, fmt.tool_calls.call_close)
    if grammar and not all(m in tokenizer.special for m in markers):
        raise RequestError(f"this model's tool-call markers {markers} are not single tokens, so its tool calls "
                           "cannot be constrained; send tool_choice \"auto\" and tools not marked strict",
                           param="tool_choice", code="invalid_value")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestError("only n=1 is supported; send several requests for several completions", param="n",
                           code="invalid_value")
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(limit_field)
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
        stop=[s for s in (stop or []) if s], stop_token_ids=fmt.stop_ids(tokenizer), **grammar)
    logprobs = bool(body.get("logprobs"))
    params.top_logprobs = _top_logprobs(body.get("top_logprobs"), logprobs)
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
        least = fmt.least_tokens(tokenizer, shown, shown_tools)
        if least >= engine.max_seq_len:  # refused before tokenizing: its characters alone prove it too long
            raise RequestError(f"the messages are at least {least} tokens but this model's context is "
                               f"{engine.max_seq_len} tokens; shorten the messages", param="messages",
                               code="context_length_exceeded")
        ids = fmt.encode_chat(tokenizer, shown, shown_tools)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RequestError(f"the messages could not be rendered: {e}", param="messages", code="invalid_value") from None
    room = engine.max_seq_len - len(ids)
    if room < 1:
        raise RequestError(f"the prompt has {len(ids)} tokens but this model's context is {engine.max_seq_len} "
                           "tokens; shorten the messages", param="messages", code="context_length_exceeded")
    if max_tokens is not None and params.max_tokens > room:  # OpenAI refuses it too; unsent, it is the room left
        raise RequestError(f"{limit_field} is {params.max_tokens} but the prompt's {len(ids)} tokens leave {room} "
                           f"of this model's context of {engine.max_seq_len}; lower {limit_field} or shorten the "
                           "messages", param=limit_field, code="context_length_exceeded")
    params.max_tokens = min(params.max_tokens, room)
    return ChatRequest(ids, params, tools, bool(stream), bool(isinstance(stream_options, dict)
                                                           and stream_options.get("include_usage")), logprobs)


def _top_logprobs(value: object, logprobs: bool) -> int:
    """OpenAI's `top_logprobs`: an integer from 0 to 20, sent only with `"logprobs": true`."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"\"top_logprobs\" must be an integer from 0 to {MAX_TOP_LOGPROBS}, got "
                           f"{json.dumps(value)[:40]}", param="top_logprobs", code="invalid_type")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {value}",
                           param="top_logprobs", code="invalid_value")
    if not logprobs:
        raise RequestError("top_logprobs needs \"logprobs\": true; send both, or leave top_logprobs out",
                           param="top_logprobs", code="invalid_value")
    return value


def _tool_choice(tool_choice: object, tools: list[dict], tool_grammar: bool) -> tuple[list[dict], dict]:
    """(the tools offered, the SamplingParams fields that constrain decoding: model.grammar) for OpenAI's
    `tool_choice`. "none" hides the tools and the turn may not open a call; "required" makes the turn tool
    calls alone, opening with one, and a named function makes it one call of that function; "auto"
    constrains the calls to tools marked `"strict": true`, or to any tool on a server started with
    tool_grammar."""
    def name_of(tool: dict) -> object:
        return (tool.get("function") or {}).get("name") if isinstance(tool.get("function"), dict) else tool.get("name")

    if tool_choice == "none":
        return [], {"tool_choice": "none"}
    max_calls = 0
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}}
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) \
            else None
        tools = [t for t in tools if name_of(t) == name]
        if not tools:
            raise RequestError(f"tool_choice names the function {name!r}, which is not in \"tools\"",
                               param="tool_choice", code="invalid_value")
        tool_choice, max_calls = "required", 1  # OpenAI: call exactly this function
    elif tool_choice not in (None, "auto", "required"):
        raise RequestError("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
    if tool_choice == "required":
        if not tools:
            raise RequestError("tool_choice requires a tool call but \"tools\" is empty", param="tool_choice",
                               code="invalid_value")
        grammar = {"tools": tools, "tool_choice": "required", "calls_only": True, "max_calls": max_calls}
    elif tools and (tool_grammar or any(isinstance(t.get("function"), dict) and t["function"].get("strict") is True
                                        for t in tools)):
        grammar = {"tools": tools, "tool_choice": "auto"}
    else:
        return tools, {}
    try:
        call_node(tools)
    except ValueError as e:
        raise RequestError(f"the tools cannot constrain decoding: {e}", param="tools", code="invalid_value") from None
    return tools, grammar


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
        parsed = formats.of(tokenizer).parse_tool_calls(result.text, id_prefix=f"call_{completion_id[-8:]}_")
        content, calls = parsed.content, tool_parser.openai_tool_calls(parsed.tool_calls)
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
    tops = result.top_logprobs or [[]] * len(result.token_ids)
    return [_token_logprob(tokenizer, tok, lp, top) for tok, lp, top in zip(result.token_ids, result.logprobs, tops)]


def _token_logprob(tokenizer, token: int, logprob: float, top: list[tuple[int, float]] = ()) -> dict:
    """OpenAI's entry for one sampled token, with the likeliest tokens at its step (`top`: (id, logprob))."""
    return {**_token(tokenizer, token, logprob), "top_logprobs": [_token(tokenizer, t, lp) for t, lp in top]}


def _token(tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


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
        raw = await request.read()
        # JSON and tokenizing in a worker thread: a long prompt must not stall the other clients' requests
        req = await asyncio.get_running_loop().run_in_executor(None, self._parse, raw)
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if req.stream:
            return await self._stream(request, req, completion_id, created)
        future = self.engine.submit(req.prompt, req.params)
        result = await asyncio.wrap_future(future)  # cancelling this (client gone) cancels the engine request
        return web.json_response(build_completion(result, req, self.tokenizer, self.model_name, completion_id,
                                                  created))

    def _parse(self, raw: bytes) -> ChatRequest:
        """The request in `raw`; RequestError (a 400) for any body that is not one, however malformed: JSON that
        does not parse, nests deeper than the parser recurses (100,000 `[`), or holds an integer of more digits
        than Python converts."""
        try:
            body = json.loads(raw)
        except RecursionError:
            raise RequestError("the request body nests arrays or objects too deeply to read; send a JSON object "
                               "with \"model\" and \"messages\"", code="invalid_json") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's digit limit
            raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object with \"model\" and "
                               "\"messages\"", code="invalid_json") from None
        try:
            return parse_request(body, self.engine, self.tokenizer, self.model_name, self.default_max_tokens,
                                 self.prompt, self.tool_grammar)
        except RecursionError:  # a tool schema or message parsed, but too deep to render or compile
            raise RequestError("the request nests its values too deeply to process; flatten the tool schemas or "
                               "messages", code="invalid_value") from None

    async def _stream(self, request: web.Request, req: ChatRequest, completion_id: str, created: int
                      ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        future = self.engine.submit(req.prompt, req.params,
                                    on_token=lambda *token: loop.call_soon_threadsafe(tokens.put_nowait, token))
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
        call_open = self.tokenizer.special.get(formats.of(self.tokenizer).tool_calls.call_open)
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
                    tok, lp, top = tokens.get_nowait()
                else:
                    tok, lp, top = getter.result()
                if req.logprobs:
                    unsent.append(_token_logprob(self.tokenizer, tok, lp, top))
                if held or tok in stop_ids:
                    continue
                if tok == call_open and req.tools:
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
        try:
            runner, self.port = await _listen(self.server.app, self.host, self.port)
            self._stop = asyncio.Event()
        except Exception as e:  # reported to start()'s caller
            self._error = e
            self._started.set()
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


async def _listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port: its runner and the port it really listens on (the system's choice for 0).
    Raises OSError (the port is in use, the host is not this machine's) before serving anything."""
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its engine request
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


def run_server(engine: Engine, tokenizer, host: str, port: int, model_name: str, prompt: str = "full",
               tool_grammar: bool = False) -> None:
    """Serve until interrupted (the `codefleet serve` command). The line saying where it serves is printed
    once it listens, with the real port; a port it cannot listen on raises OSError before that line."""
    server = ChatServer(engine, tokenizer, model_name, prompt=prompt, tool_grammar=tool_grammar)
    shown = "; bare prompt: system messages and tool schemas are not rendered" if prompt == "bare" else ""
    shown += "; tool calls constrained to their schemas" if tool_grammar else ""

    async def serve() -> None:
        runner, real_port = await _listen(server.app, host, port)
        try:
            print(f"codefleet serve: {model_name} on http://{host}:{real_port}/v1 (max batch {engine.max_batch}, "
                  f"context {engine.max_seq_len} tokens{shown})", flush=True)
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):  # end cleanly: in-flight requests finish or are cancelled
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())
