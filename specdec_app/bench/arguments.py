"""`specdec bench`'s arguments: the systems and prompt sets it knows, the flags and their parsers,
and where a model or prompt file named on the command line is found.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from specdec.config import NGRAM, REPO_ROOT, SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.model.source import resolve_model_source
from specdec_app.bench import overlap as overlap_bench
from specdec_app.flags import add_settings, format_default

ALL_SYSTEMS = ["engine", "spec-draft", "spec-draft-fixed", "spec-draft-tree", "spec-draft-tree-fixed", "spec-ngram",
               "spec-ngram-fixed", "hf", "hf-assisted"]
TREE_SYSTEMS = ["spec-draft-tree", "spec-draft-tree-fixed"]
DEFAULT_SYSTEMS = [s for s in ALL_SYSTEMS if s not in TREE_SYSTEMS]  # trees: asked for by name
DEFAULT_SWEEP = "1,2,3,4,6,8"
# The shipped prompt sets (JSONL, {"prompt": text, "source": ...} per line), by the name --prompt-sets uses.
PROMPT_SETS = {"code": "models/heldout_prompts.jsonl", "prose": "models/prose_prompts.jsonl"}
SHIPPED_PAIR = (str(SHIPPED_TARGET), str(SHIPPED_DRAFT))



def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be finite and >= 0, got {text!r}")
    return values


def _tree_branches(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 2 <= value <= 16:
        raise argparse.ArgumentTypeError(f"expected an integer in [2, 16], got {text!r}")
    return value


def _systems(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ALL_SYSTEMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {bad}; choose from {','.join(ALL_SYSTEMS)}")
    return [s for s in ALL_SYSTEMS if s in names]


def _prompt_sets(text: str) -> list[str]:
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [n for n in names if n not in PROMPT_SETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown prompt set(s) {bad}; choose from {','.join(PROMPT_SETS)}")
    return names


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, ["target", "target_weights", "draft_weights"])
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT),
                        help="draft model of the spec-draft system: checkpoint directory, .gguf file or Hub id "
                             f"(default: {format_default(str(SHIPPED_DRAFT))})")
    parser.add_argument("--prompt-sets", type=_prompt_sets, default=list(PROMPT_SETS),
                        help="comma-separated shipped prompt sets: "
                             + ", ".join(f"{name} ({path})" for name, path in PROMPT_SETS.items())
                             + f" (default {','.join(PROMPT_SETS)})")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help='JSONL, one {"prompt": text} or {"prompt_ids": [ids]} per line; replaces '
                             "--prompt-sets with this one file, named by its stem (or by the shipped set it is)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per run and prompt set, spread over the file (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per prompt (default 128)")
    add_settings(parser, ["num_speculative_tokens"])
    parser.add_argument("--batch-sizes", type=int_list, default=None, help="comma-separated (default 1,8)")
    parser.add_argument("--temperatures", type=_float_list, default=[0.0, 0.8],
                        help="comma-separated; 0 = greedy (default 0,0.8)")
    parser.add_argument("--systems", type=_systems, default=list(DEFAULT_SYSTEMS),
                        help=f"subset of {','.join(ALL_SYSTEMS)} (default: all but {','.join(TREE_SYSTEMS)})")
    parser.add_argument("--tree-branches", type=_tree_branches, default=3,
                        help="children of the root in the tree systems' drafts (default 3)")
    parser.add_argument("--tree-side-depth", type=int, default=0,
                        help="how deep the tree systems grow the root's other children (default 0: K deep)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every system (default 2)")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed of HF's sampled runs (specdec's sampled requests are unseeded, like "
                             "typical traffic: a seeded request's K follows a restricted rule)")
    parser.add_argument("--sweep-k", nargs="?", const=DEFAULT_SWEEP, default=None, metavar="K1,K2,...",
                        help="also sweep K (adaptive systems: the most K) for the speculative systems at batch 1 "
                             f"greedy on the first prompt set (default list {DEFAULT_SWEEP})")
    parser.add_argument("--sweep-only", action="store_true", help="with --sweep-k: skip the main grid")
    parser.add_argument("--cost-steps", type=int, default=None,
                        help="timed passes per step-cost measurement (default 30)")
    parser.add_argument("--out", default="bench_out", help="output folder for bench.json and bench.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke run: 2 prompts per set, 16 new tokens, batch sizes 1,2")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs of every system per row, in mirrored order (the systems forward, then "
                             "backward, ...) and pooled, so a machine that speeds up or slows down during a row "
                             "moves every system alike (default 2; 1 with --quick)")
    parser.add_argument("--oracle", action="store_true",
                        help="also run every fixed K from 1 to K for each adaptive system and row, and print the "
                             "adaptive row's ratio to the best of plain and those (specdec bench-policy always does)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    overlap_bench.add_arguments(parser)


def resolve_path(path: str) -> str:
    """Relative paths are tried from the working directory, then from the repository (anything
    else, a Hub id included, is left as it is)."""
    p = Path(path)
    if p.is_absolute() or p.exists() or path == NGRAM:
        return str(p)
    alt = REPO_ROOT / p
    return str(alt) if alt.exists() else str(p)


def model_problem(spec: str) -> str | None:
    """Why a model spec (checkpoint directory, .gguf file or Hub id) cannot be loaded, or None."""
    try:
        resolve_model_source(spec)
    except ValueError as e:
        return str(e)
    return None


def prompt_set_name(path: str) -> str:
    """A --prompts file is named by the shipped set it is, else by its stem."""
    for name, shipped in PROMPT_SETS.items():
        if Path(resolve_path(shipped)).resolve() == Path(path).resolve():
            return name
    return Path(path).stem
