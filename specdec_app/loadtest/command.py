"""`specdec loadtest`: a bounded load test of the Generation service on loopback.

Opens N concurrent Generate streams (default 64 x 200 tokens, ignore_eos), cancels a fraction of
them after a random number of tokens, and checks that:

- every stream ends exactly once: a non-cancelled stream ends with a finish_reason on its last
  message and exactly max_new_tokens tokens (and the server's stats agree with the client's count);
  a cancelled stream ends with CANCELLED; nothing arrives after a finish; no stream is missing;
- with --verify-sample N, N completed streams replayed one at a time produce the same tokens
  (seeded sampling and greedy decoding do not depend on batching), which catches streams that
  received another stream's tokens;
- with --embedded, after the run every KV block of the target (and of the draft model) is free and
  the engine holds no request.

It reports throughput (generated tokens per second of wall time), p50/p99 time to first token,
inter-token latency per message and per token, the stream counts and the KV blocks still used.
With --embedded --grpc-workers the draft and target workers are served over loopback gRPC (as in a
deployment, minus the network) and the report adds the bytes on the wire per round: mean and p99 of
sent + received per round, split draft / target, and per generated token (protobuf payload bytes
of the Rounds messages; gRPC framing adds 5 bytes per message).
The exit status is 0 only if every check passed.

  specdec loadtest --address 127.0.0.1:50051
  specdec loadtest --embedded --draft models/draft --streams 64 --json out.json
  specdec loadtest --embedded --grpc-workers --draft models/draft --temperature 0.8

The embedded server takes the service settings of `specdec serve` (--target, --draft, -k, ...;
default target: the shipped model, default draft: none).

Everything stays bounded: --streams calls at most, --timeout seconds at most (hard), and in
embedded mode the server binds 127.0.0.1 on a free port and stops at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from specdec.config import ConfigError, ServiceConfig
from specdec_app.flags import add_settings, given_settings
from specdec_app.loadtest.embedded_server import run_embedded
from specdec_app.loadtest.records import LoadConfig, format_report
from specdec_app.loadtest.streams import run_load

# The settings of the embedded server this command can change (the rest keep their defaults).
EMBEDDED_SETTINGS = ("target", "draft", "adaptive", "device", "dtype", "max_batch_size", "kv_cache_blocks",
                     "kv_block_size", "target_threads", "draft_threads")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument("--address", default="127.0.0.1:50051", help="server host:port (default %(default)s)")
    parser.add_argument("--token", default=None, help="bearer token for an authenticated server")
    parser.add_argument("--streams", type=int, default=64, help="concurrent Generate streams (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens per stream (default %(default)s)")
    parser.add_argument("--cancel-fraction", type=float, default=0.1,
                        help="fraction of streams cancelled after a random number of tokens, 0 to "
                             "max-new-tokens - 1 (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=None, help="unset or 0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts, the cancel points and each stream")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="K per request (default: server's)")
    parser.add_argument("--timeout", type=float, default=300.0, help="hard bound on the run, seconds")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="send random token-id prompts in [0, N) instead of text (servers without a tokenizer)")
    parser.add_argument("--verify-sample", type=int, default=0,
                        help="replay N completed streams one at a time and require the same tokens")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e = parser.add_argument_group("embedded server (checks the KV cache after the run)")
    e.add_argument("--embedded", action="store_true", help="start a server on 127.0.0.1:0 in this process")
    e.add_argument("--grpc-workers", action="store_true",
                   help="serve the draft and target workers over loopback gRPC and report bytes on the wire per round")
    e.add_argument("-k", "--server-k", dest="server_num_speculative_tokens", type=int, default=None,
                   help="the server's num_speculative_tokens (default: the config's)")
    add_settings(e, EMBEDDED_SETTINGS)
    c = parser.add_argument_group("chaos (see specdec_app/loadtest/chaos.py)")
    c.add_argument("--chaos", type=float, default=None, metavar="SECONDS",
                   help="run a local Ray deployment and SIGKILL a random worker every SECONDS during the load; "
                        "then replay every completed stream uninterrupted and count different outputs "
                        "(uses the embedded-server settings; streams alternate greedy / sampled)")
    c.add_argument("--replicas-sweep", type=lambda text: [int(x) for x in text.split(",")], default=None,
                   metavar="N1,N2,...", help="run the load against a local Ray deployment with each number of "
                                             "target replicas in turn and print throughput ratios and latency "
                                             "(see specdec_app/loadtest/replica_sweep.py)")
    c.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="closed loop: --streams clients each send request after request for SECONDS "
                        "(default with --chaos: 60)")


def load_from_args(args) -> LoadConfig:
    return LoadConfig(streams=args.streams, max_new_tokens=args.max_new_tokens, cancel_fraction=args.cancel_fraction,
                      temperature=args.temperature, seed=args.seed, timeout=args.timeout,
                      num_speculative_tokens=args.num_speculative_tokens, vocab_size=args.vocab_size,
                      verify_sample=args.verify_sample, progress=not args.no_progress and sys.stderr.isatty(),
                      token=args.token, duration=args.duration or (60.0 if args.chaos else None),
                      mixed=args.chaos is not None)


def _bad_args(args) -> str | None:
    if not 1 <= args.streams <= 10_000:
        return "--streams must be between 1 and 10000"
    if args.max_new_tokens < 1:
        return "--max-new-tokens must be >= 1"
    if not 0.0 <= args.cancel_fraction <= 1.0:
        return "--cancel-fraction must be in [0, 1]"
    if not args.timeout > 0:
        return "--timeout must be > 0"
    if args.grpc_workers and not args.embedded:
        return "--grpc-workers needs --embedded"
    if args.chaos is not None and (args.chaos <= 0 or args.embedded):
        return "--chaos needs a positive number of seconds, and runs its own deployment (no --embedded)"
    if args.replicas_sweep is not None and (args.embedded or args.chaos is not None
                                            or not all(n >= 1 for n in args.replicas_sweep)):
        return "--replicas-sweep takes positive counts and runs its own deployments (no --embedded, --chaos)"
    if args.duration is not None and args.duration <= 0:
        return "--duration must be > 0"
    if args.verify_sample < 0:
        return "--verify-sample must be >= 0"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _bad_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    load = load_from_args(args)
    chaos = None
    try:
        if args.replicas_sweep is not None:
            # Imports Ray, which only the runs on a deployment of their own need.
            from specdec_app.loadtest.replica_sweep import format_sweep, run_replica_sweep

            config = ServiceConfig.from_settings(**given_settings(args, EMBEDDED_SETTINGS))
            results = run_replica_sweep(config, load, args.replicas_sweep)
            print(format_sweep(results))
            return 0 if all(r.ok for _, r in results) else 1
        if args.chaos is not None:
            # Imports Ray, which only the runs on a deployment of their own need.
            from specdec_app.loadtest.chaos import format_chaos, run_chaos

            load.timeout = max(load.timeout, load.duration + 300.0)  # the tail of the last streams
            config = ServiceConfig.from_settings(**given_settings(args, EMBEDDED_SETTINGS))
            report, chaos = run_chaos(config, load, args.chaos)
        elif args.embedded:
            server_k = {} if args.server_num_speculative_tokens is None else {
                "num_speculative_tokens": args.server_num_speculative_tokens}
            config = ServiceConfig.from_settings(**given_settings(args, EMBEDDED_SETTINGS), **server_k)
            report = run_embedded(config, load, grpc_workers=args.grpc_workers)
        else:
            report = run_load(args.address, load)
    except (ConnectionError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if chaos is not None:
        print(format_chaos(chaos))
    if args.json:
        with open(args.json, "w") as fh:
            data = report.to_dict()
            if chaos is not None:
                data["chaos"] = {**dataclasses.asdict(chaos), "ok": chaos.ok}
            json.dump(data, fh, indent=2)
            fh.write("\n")
    return 0 if report.ok else 1
