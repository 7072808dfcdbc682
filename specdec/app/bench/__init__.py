"""`specdec bench`: speculative vs plain decoding vs Hugging Face `generate`, on the same checkpoints.

Modules: `theory` (the expected-speedup formula), `runners` (one way to time each system, plus
the draft/target step-cost microbenchmark), `report` (table, targets, JSON, PNG) and `command`
(the CLI subcommand: `add_arguments(parser)` / `run(args)`).
"""
from specdec.app.bench.theory import best_fixed_k_speedup, expected_tokens_per_round, theoretical_speedup

__all__ = ["best_fixed_k_speedup", "expected_tokens_per_round", "theoretical_speedup"]
