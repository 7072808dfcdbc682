"""`specdec bench`: speculative vs plain decoding vs Hugging Face `generate`, on the same checkpoints.

Modules: `theory` (the expected-speedup formula); `results` (the systems compared, a run's result);
`prompts`; `engine_runner` and `hf_runner` (how specdec and Hugging Face are timed); `step_costs`
(the draft/target step-cost microbenchmark); `oracle` (adaptive K against every fixed K);
`environment` (where it ran); `report` (table, targets, JSON, PNG); `arguments` and `command` (the
CLI subcommand: `add_arguments(parser)` / `run(args)`). `step_command` (with `floor`, `shapes`),
`policy_command` and `overlap` are the other bench subcommands and sections.
"""
from specdec_app.bench.theory import best_fixed_k_speedup, expected_tokens_per_round, theoretical_speedup

__all__ = ["best_fixed_k_speedup", "expected_tokens_per_round", "theoretical_speedup"]
