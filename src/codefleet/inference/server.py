"""An OpenAI-compatible HTTP server over the engine (aiohttp).

    POST /v1/chat/completions   messages, tools, temperature, top_p, max_tokens
                                (or max_completion_tokens), stop, seed, stream,
                                logprobs -> a chat.completion (or SSE chunks)
    GET  /v1/models             the one model served
    GET  /health                200 when up

Each request renders its messages with the checkpoint's chat format
(`formats.of(tokenizer)`: codefleet's template, or a Hugging Face
checkpoint's own chat template and tool-call format), is submitted to the
engine (whose background thread batches all requests in flight into the same
decode steps) and awaited without blocking the event
loop. `tool_choice` "required" or a named function, a tool marked `"strict":
true`, or a server started with `tool_grammar` constrain decoding so that
every tool call parses and fits its schema (`grammar.py`). "required" and a
named function also make the turn tool calls alone: its first token opens a
call (of the named function, and only one), so any model, a random one too,
answers with a call rather than text until `max_tokens`. "none" offers no
tools and the turn may not open a call (`openai_request.py` validates a
request and chooses these). The completion is parsed with the format's
tool-call parser (`tool_parser`): tool calls come back as OpenAI `tool_calls` with ids
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

from aiohttp import web

from codefleet.chat import formats, tool_parser
from codefleet.chat.codefleet_template import check_prompt
from codefleet.inference.engine import Engine, Result
from codefleet.inference.openai_request import ChatRequest, RequestError, parse_request

log = logging.getLogger(__name__)


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    type_: str = "invalid_request_error",
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status)


def build_completion(
    result: Result, request: ChatRequest, tokenizer, model_name: str, completion_id: str, created: int
) -> dict:
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
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": [choice],
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        },
    }


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

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        model_name: str = "codefleet",
        default_max_tokens: int = 1024,
        prompt: str = "full",
        tool_grammar: bool = False,
    ):
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
            what = {
                404: f"no route {request.method} {request.path}; this server serves POST /v1/chat/completions "
                "and GET /v1/models",
                405: f"{request.method} is not allowed on {request.path}",
            }.get(e.status, e.reason)
            return error_response(what, e.status, code=str(e.status))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # the server keeps serving
            log.exception("request failed")
            return error_response(
                f"the server failed on this request: {type(e).__name__}: {e}", 500, type_="server_error"
            )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "running": self.engine.n_running,
                "waiting": self.engine.n_waiting,
                "version": self.engine.version,
            }
        )

    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "codefleet",
            "max_model_len": self.engine.max_seq_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            raise RequestError(
                f"the model {request.match_info['model']!r} does not exist here; this server serves "
                f"{self.model_name!r}",
                param="model",
                code="model_not_found",
                status=404,
            )
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
        return web.json_response(build_completion(result, req, self.tokenizer, self.model_name, completion_id, created))

    def _parse(self, raw: bytes) -> ChatRequest:
        """The request in `raw`; RequestError (a 400) for any body that is not one, however malformed: JSON that
        does not parse, nests deeper than the parser recurses (100,000 `[`), or holds an integer of more digits
        than Python converts."""
        try:
            body = json.loads(raw)
        except RecursionError:
            raise RequestError(
                "the request body nests arrays or objects too deeply to read; send a JSON object "
                'with "model" and "messages"',
                code="invalid_json",
            ) from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's digit limit
            raise RequestError(
                f'the request body is not valid JSON ({e}); send a JSON object with "model" and "messages"',
                code="invalid_json",
            ) from None
        try:
            return parse_request(
                body,
                self.engine,
                self.tokenizer,
                self.model_name,
                self.default_max_tokens,
                self.prompt,
                self.tool_grammar,
            )
        except RecursionError:  # a tool schema or message parsed, but too deep to render or compile
            raise RequestError(
                "the request nests its values too deeply to process; flatten the tool schemas or messages",
                code="invalid_value",
            ) from None

    async def _stream(
        self, request: web.Request, req: ChatRequest, completion_id: str, created: int
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        future = self.engine.submit(
            req.prompt, req.params, on_token=lambda *token: loop.call_soon_threadsafe(tokens.put_nowait, token)
        )
        done = asyncio.wrap_future(future)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        chunk = _Chunks(completion_id, created, self.model_name, req.logprobs)
        try:
            await response.prepare(request)
            await response.write(chunk({"role": "assistant", "content": ""}))
            sent = await self._stream_tokens(response, req, tokens, done, chunk)
            result = done.result()
            final = build_completion(result, req, self.tokenizer, self.model_name, completion_id, created)
            message = final["choices"][0]["message"]
            content = message.get("content") or ""
            # what was held back: everything, for stop strings (sent cut); the text between or after tool calls
            rest = content[len(sent) :] if content.startswith(sent) else ""
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
            error = {
                "message": f"the server failed on this request: {type(e).__name__}: {e}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
            with contextlib.suppress(ConnectionResetError):
                await response.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
        return response

    async def _stream_tokens(
        self,
        response: web.StreamResponse,
        req: ChatRequest,
        tokens: asyncio.Queue,
        done: asyncio.Future,
        chunk: _Chunks,
    ) -> str:
        """Send the content as the engine samples it, until the request is done; the content sent. Once a tool
        call opens, the rest of the turn is held back (the caller sends it parsed), and with stop strings all of
        it is (a stop string may cut it)."""
        stop_ids = set(req.params.stop_token_ids)
        call_open = self.tokenizer.special.get(formats.of(self.tokenizer).tool_calls.call_open)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        held = False  # a tool call opened: hold the rest back until the turn is parsed
        sent = ""  # the content streamed so far
        getter: asyncio.Future | None = None
        try:
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
                    chunk.unsent.append(_token_logprob(self.tokenizer, tok, lp, top))
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
        finally:
            if getter is not None:
                getter.cancel()
        tail = decoder.decode(b"", final=True)
        if tail and not held and not req.params.stop:
            await response.write(chunk({"content": tail}))
            sent += tail
        return sent


class _Chunks:
    """The SSE chunks of one streamed completion; with logprobs, each carries those of the tokens generated since
    the last one (`unsent`)."""

    def __init__(self, completion_id: str, created: int, model_name: str, logprobs: bool):
        self.completion_id, self.created, self.model_name, self.logprobs = completion_id, created, model_name, logprobs
        self.unsent: list[dict] = []

    def __call__(self, delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
        logprobs = None
        if self.logprobs and usage is None:
            logprobs = {"content": list(self.unsent)}
            self.unsent.clear()
        body = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }
        if usage is not None:
            body["choices"], body["usage"] = [], usage
        return f"data: {json.dumps(body)}\n\n".encode()


# -- running it ---------------------------------------------------------------------------


class ServerThread:
    """Serve `ChatServer` on host:port from a background thread (tests, notebooks, the local policy).

    with ServerThread(engine, tokenizer, port=0) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "codefleet",
        default_max_tokens: int = 1024,
        prompt: str = "full",
        tool_grammar: bool = False,
    ):
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


def run_server(
    engine: Engine, tokenizer, host: str, port: int, model_name: str, prompt: str = "full", tool_grammar: bool = False
) -> None:
    """Serve until interrupted (the `codefleet serve` command). The line saying where it serves is printed
    once it listens, with the real port; a port it cannot listen on raises OSError before that line."""
    server = ChatServer(engine, tokenizer, model_name, prompt=prompt, tool_grammar=tool_grammar)
    shown = "; bare prompt: system messages and tool schemas are not rendered" if prompt == "bare" else ""
    shown += "; tool calls constrained to their schemas" if tool_grammar else ""

    async def serve() -> None:
        runner, real_port = await _listen(server.app, host, port)
        try:
            print(
                f"codefleet serve: {model_name} on http://{host}:{real_port}/v1 (max batch {engine.max_batch}, "
                f"context {engine.max_seq_len} tokens{shown})",
                flush=True,
            )
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):  # end cleanly: in-flight requests finish or are cancelled
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())
