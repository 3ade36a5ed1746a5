"""`codefleet serve --checkpoint DIR [--host H] --port P`: the OpenAI-compatible server.

    codefleet serve --checkpoint runs/ckpt --port 8000
    codefleet agent run --model http://127.0.0.1:8000/v1 ...   # any OpenAI client works too

A checkpoint is served in the prompt style its metadata.json says it was
trained on (`checkpoint.usage`; `--prompt` overrides it), so `codefleet agent
run` on it sees the policy its run evaluated, wherever the checkpoint lives.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from codefleet.contracts import ENGINES
from codefleet.inference.server import run_server
from codefleet.model import checkpoint


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve a checkpoint behind an OpenAI-compatible API",
        description="Load a checkpoint (codefleet.model.checkpoint.save) into the continuous-batching engine and "
        "serve POST /v1/chat/completions and GET /v1/models on HOST:PORT until interrupted.",
    )
    serve.add_argument("--checkpoint", required=True, help="checkpoint directory (model.safetensors + config.json)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--port",
        type=int,
        required=True,
        help="port to listen on (0: a free one; the line "
        "`codefleet serve: NAME on http://HOST:PORT/v1` says which, once it listens)",
    )
    serve.add_argument(
        "--model-name", default="", help="the model id clients ask for (default: the checkpoint directory's name)"
    )
    serve.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (default 32)")
    serve.add_argument(
        "--max-seq-len", type=int, default=None, help="context per sequence, prompt + completion (default: the model's)"
    )
    serve.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    serve.add_argument(
        "--prompt",
        choices=("full", "bare"),
        default=None,
        help="how requests are rendered: 'bare' leaves out system messages and tool schemas, for a "
        "policy trained without them (default: the style the checkpoint's metadata.json says, else "
        "full)",
    )
    serve.add_argument(
        "--tool-grammar",
        action="store_true",
        default=None,
        help="constrain every request's tool calls to parse and fit their tools' schemas (default: "
        "on for a checkpoint whose metadata.json says it was trained so; otherwise only tool_choice "
        '"required", a named function or tools marked strict are)',
    )
    serve.add_argument(
        "--engine",
        choices=ENGINES.names(),
        default="codefleet",
        help="the inference engine, by name (codefleet.contracts.ENGINES; vllm: a Hugging Face "
        "checkpoint, in the .venv-vllm that scripts/setup_vllm.sh makes; no --tool-grammar; default "
        "codefleet)",
    )
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.checkpoint):
        print(
            f"codefleet serve: checkpoint directory {args.checkpoint!r} does not exist; give --checkpoint a "
            "directory written by codefleet.model.checkpoint.save",
            file=sys.stderr,
        )
        return 2
    for flag, value, least in (("--max-batch", args.max_batch, 1), ("--max-seq-len", args.max_seq_len, 2)):
        if value is not None and value < least:
            print(f"codefleet serve: {flag} must be at least {least}, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.port <= 65535:
        print(f"codefleet serve: --port must be from 0 (a free one) to 65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        backend = ENGINES.get(args.engine)
    except ImportError as e:  # an installed package's engine that does not import
        print(f"codefleet serve: {e}", file=sys.stderr)
        return 2
    if args.tool_grammar and not backend.tool_grammar:
        print(
            f"codefleet serve: the {args.engine} engine has no tool-call grammar; leave out --tool-grammar, or use "
            "--engine codefleet",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = backend.load(
            args.checkpoint, max_batch=args.max_batch, max_seq_len=args.max_seq_len, **backend.serve_options
        )
    except (OSError, ValueError, KeyError, ImportError) as e:  # ImportError: vLLM missing, says how to install it
        print(f"codefleet serve: could not load {args.checkpoint!r}: {e}", file=sys.stderr)
        return 2
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    try:
        usage = checkpoint.usage(args.checkpoint)
        run_server(
            engine,
            engine.tokenizer,
            args.host,
            args.port,
            name,
            args.prompt or usage["prompt"],
            tool_grammar=backend.tool_grammar and (args.tool_grammar or usage["tool_grammar"] != "off"),
        )
    except OSError as e:  # before the line saying where it serves (model.server.run_server)
        print(
            f"codefleet serve: cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose another "
            "--port, or --port 0 for a free one",
            file=sys.stderr,
        )
        return 2
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m codefleet.inference.serve_cli --checkpoint DIR --port P` (the same as `codefleet serve`)."""
    parser = argparse.ArgumentParser(prog="codefleet")
    register(parser.add_subparsers(dest="group", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
