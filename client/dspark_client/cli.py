"""`dspark` command line: one-shot generation and an interactive chat.

    dspark generate "Write a haiku" --max-tokens 64 --temperature 0.7
    dspark chat --system "You are terse."      (/reset clears the history, /exit or Ctrl-D quits)
"""

import argparse
import os
import sys

from .channel import TlsConfig
from .client import Client
from .errors import DSparkError
from .retry import RetryPolicy
from .types import ChatMessage, FinishReason, GenerationResult, collect


def _common_flags() -> argparse.ArgumentParser:
    # One parent parser so every flag works after the subcommand: `dspark generate "x" --address ...`.
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--address", default=os.environ.get("DSPARK_ADDRESS", "localhost:50051"),
                   help="server host:port (default: $DSPARK_ADDRESS or localhost:50051)")
    p.add_argument("--model", default="", help="model name (default: the server's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-speculation", action="store_true", help="plain decoding for this request")
    p.add_argument("--max-draft-tokens", type=int, default=0, help="cap on draft tokens per step; 0 = none")
    p.add_argument("--no-stream", action="store_true", help="print the answer once it is complete")
    p.add_argument("--metrics", action="store_true", help="print speculation metrics to stderr")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds per request")
    p.add_argument("--retries", type=int, default=3, help="attempts while the server is unavailable")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE", help="gRPC metadata (repeatable)")
    p.add_argument("--tls", action="store_true", help="use TLS (implied by the certificate flags)")
    p.add_argument("--root-certs", help="PEM file of trusted roots (default: the system's)")
    p.add_argument("--client-cert", help="PEM client certificate chain, for mutual TLS")
    p.add_argument("--client-key", help="PEM client private key, for mutual TLS")
    p.add_argument("--server-name", help="name to check the server certificate against")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative-decoding client")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", parents=[_common_flags()], help="complete one prompt")
    generate.add_argument("prompt")
    chat = commands.add_parser("chat", parents=[_common_flags()], help="interactive chat keeping the history")
    chat.add_argument("--system", default=None, help="system message opening the conversation")
    return parser


def _client(args) -> Client:
    tls = None
    if args.tls or args.root_certs or args.client_cert or args.client_key:
        tls = TlsConfig.from_files(args.root_certs, args.client_cert, args.client_key, args.server_name)
    metadata = [tuple(item.split("=", 1)) for item in args.metadata]
    if any(len(pair) != 2 for pair in metadata):
        raise SystemExit("--metadata takes KEY=VALUE")
    return Client(args.address, tls=tls, timeout=args.timeout, retry=RetryPolicy(max_attempts=args.retries),
                  metadata=metadata)


def _params(args) -> dict:
    return dict(
        model=args.model, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop, speculation=not args.no_speculation,
        max_draft_tokens=args.max_draft_tokens,
    )


def _run(client: Client, args, **prompt) -> GenerationResult:
    """Generate, printing text as it streams (or all at once with --no-stream)."""
    if args.no_stream:
        result = client.generate(**prompt, **_params(args))
        print(result.text, flush=True)
    else:
        chunks = []
        for chunk in client.generate_stream(**prompt, **_params(args)):
            chunks.append(chunk)
            print(chunk.text, end="", flush=True)
        print(flush=True)
        result = collect(chunks)
    if args.metrics and result.metrics:
        m = result.metrics
        print(f"[{m.generated_tokens} tokens, {m.steps} steps, tau {m.tau:.2f}, "
              f"accepted {m.accepted_tokens}/{m.draft_tokens} drafts, "
              f"finish {result.finish_reason.value if result.finish_reason else '?'}]",
              file=sys.stderr)
    if result.finish_reason == FinishReason.ERROR:
        print(f"error: {result.error}", file=sys.stderr)
    return result


def _chat(client: Client, args) -> int:
    system = [ChatMessage("system", args.system)] if args.system else []
    history = list(system)
    prompt = "> " if sys.stdin.isatty() else ""
    while True:
        try:
            line = input(prompt).strip()
        except EOFError:
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(system)
            continue
        if not line:
            continue
        try:
            result = _run(client, args, messages=history + [ChatMessage("user", line)])
        except DSparkError as error:
            print(f"error: {error}", file=sys.stderr)  # the turn is dropped; the history stays as it was
            continue
        history += [ChatMessage("user", line), ChatMessage("assistant", result.text)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with _client(args) as client:
        if args.command == "chat":
            return _chat(client, args)
        try:
            result = _run(client, args, prompt=args.prompt)
        except DSparkError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        return 1 if result.finish_reason == FinishReason.ERROR else 0
