"""`specdec` command line: serve, generate, bench.

Each subcommand lives in its own module of specdec_app exposing `add_arguments(parser)` and
`run(args) -> int`; a module is imported only when its subcommand runs, so `specdec generate`
never imports Ray.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("specdec_app.serve", "start the service (Ray + gRPC); no arguments = embedded default"),
    "generate": ("specdec_app.generate", "stream a completion from a running server to the terminal"),
    "bench": ("specdec_app.bench.command", "benchmark speculative vs plain decoding and Hugging Face"),
    "bench-step": ("specdec_app.bench.step_command", "decode step vs its physical floor and vs HF (real shape)"),
    "bench-policy": ("specdec_app.bench.policy_command", "adaptive K vs the best fixed K, on a family of pairs"),
    "bench-peer": ("specdec_app.bench.peer_command", "specdec beside llama.cpp on the same quantized GGUF files"),
    "bench-quant": ("specdec_app.bench.quant_command", "q8/q4 weights against the same model in floats"),
    "loadtest": ("specdec_app.loadtest.command",
                 "bounded concurrent-stream load test: latency, throughput, no loss, KV freed"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding service")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen subcommand's module is imported
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(sub_parser)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
