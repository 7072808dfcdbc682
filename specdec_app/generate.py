"""`specdec generate "prompt"` (or `--chat "text"`): stream a completion from a running server to the terminal."""
from __future__ import annotations

import argparse
import sys

import grpc

from specdec.client import GenerationClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="text to complete (or use --token-ids or --chat)")
    parser.add_argument("--chat", default=None, metavar="TEXT",
                        help="send TEXT as a user chat message (the server applies the model's chat template)")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message before --chat's")
    parser.add_argument("--address", default="127.0.0.1:50051", help="server host:port (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the server's (64)")
    parser.add_argument("--temperature", type=float, default=None, help="0 or unset: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="K; 0 disables speculation")
    parser.add_argument("--token-ids", default=None,
                        help="pre-tokenized prompt, comma- or space-separated ids (replaces the text prompt)")
    parser.add_argument("--token", default=None, help="bearer token for an authenticated server")
    parser.add_argument("--tls-ca", default=None, help="CA certificate (PEM) to connect with TLS")
    parser.add_argument("--timeout", type=float, default=None, help="deadline for the whole request, seconds")
    parser.add_argument("--stats", action="store_true", help="print generation stats to stderr at the end")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"error: --token-ids must be integers separated by commas or spaces, got {text!r}") from None


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """The conversation `--chat` sends: an optional system message, then the user's."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


def format_stats(finish_reason: str, stats) -> str:
    acc = f"{stats.acceptance_rate:.3f}" if stats.HasField("acceptance_rate") else "n/a"
    return (f"finish_reason={finish_reason} prompt_tokens={stats.prompt_tokens} "
            f"generated_tokens={stats.generated_tokens} rounds={stats.rounds} acceptance_rate={acc} "
            f"mean_accepted_length={stats.mean_accepted_length:.2f} "
            f"target_forward_passes={stats.target_forward_passes} draft_forward_passes={stats.draft_forward_passes}")


def run(args: argparse.Namespace) -> int:
    if args.chat is not None and (args.prompt is not None or args.token_ids is not None):
        print("error: give either --chat or a prompt / --token-ids, not both", file=sys.stderr)
        return 2
    if args.system is not None and args.chat is None:
        print("error: --system needs --chat", file=sys.stderr)
        return 2
    prompt, messages = None, None
    if args.chat is not None:
        messages = chat_messages(args.chat, args.system)
    elif args.token_ids is not None:
        prompt = _parse_ids(args.token_ids)
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        print("error: give a prompt, --token-ids or --chat", file=sys.stderr)
        return 2
    options = dict(messages=messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                   stop=args.stop, ignore_eos=args.ignore_eos, num_speculative_tokens=args.num_speculative_tokens)
    token_ids: list[int] = []
    any_text = False
    finish_reason, stats = "", None
    try:
        client = GenerationClient(args.address, token=args.token, tls_ca=args.tls_ca)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    call = client.generate_stream(prompt, timeout=args.timeout, **options)
    try:
        for response in call:
            token_ids.extend(response.token_ids)
            if response.text:
                any_text = True
                sys.stdout.write(response.text)
                sys.stdout.flush()
            if response.finish_reason:
                finish_reason, stats = response.finish_reason, response.stats
    except grpc.RpcError as e:
        if any_text:
            sys.stdout.write("\n")
        print(f"error: {_describe(e, args.address)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        call.cancel()
        print("\ncancelled", file=sys.stderr)
        return 130
    finally:
        client.close()
    if not any_text and token_ids:  # a server without a tokenizer: show the ids
        sys.stdout.write(" ".join(map(str, token_ids)))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats and stats is not None:
        print(format_stats(finish_reason, stats), file=sys.stderr)
    return 0


def _describe(e, address: str) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if code == grpc.StatusCode.UNAVAILABLE and any(s in details.lower() for s in (
            "failed to connect", "connection refused", "dns resolution", "unreachable", "connect failed",
            "no route", "failed to resolve", "ssl", "handshake")):
        return f"server not reachable at {address} ({details.splitlines()[0]})"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return f"invalid request: {details}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"not authorized: {details} (use --token)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"deadline exceeded: {details}"
    name = code.name if code is not None else "ERROR"
    return f"{name}: {details}"
