"""A draft's chain in one C call (ModelRunner.draft_chain): the same tokens and the same q, bit for
bit, as the step-by-step drafter (a tree whose other branches are leaves too), and the cache as it
was where it gives up."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from draft_worker.worker import build_drafter
from specdec.model.cpu_kernels import KernelArgumentError, load_cpu_kernels
from specdec.params import SamplingParams
from specdec.role_configs import DraftConfig
from specdec.round_types import DraftTask

from checkpoints import CONFIGS, FAMILY_CONFIGS, build_checkpoint

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler on this machine")

# (config, weights): a float untied embedding, codes read back as a tied embedding's rows, head norms
CASES = [("gqa_untied", "fp"), ("mha_tied", "q8"), ("qwen3_tied", "q4")]
PARAMS = [SamplingParams(seed=1), SamplingParams(temperature=0.8, seed=2),
          SamplingParams(temperature=1.3, top_k=7, seed=3), SamplingParams(temperature=0.6, seed=4),
          SamplingParams(temperature=1e-300, seed=5)]  # (0 in float32, yet a draw: not the argmax)


@pytest.fixture(scope="module", params=CASES, ids=[f"{c}-{w}" for c, w in CASES])
def drafters(request, tmp_path_factory):
    """Two drafters of one random checkpoint: one with its chains in C, one stepping in Python."""
    name, weights = request.param
    settings = {**CONFIGS, **FAMILY_CONFIGS}[name]
    path = build_checkpoint(Path(tmp_path_factory.mktemp(name)), **settings)
    in_c, stepping = (build_drafter(DraftConfig(model=str(path), weights=weights, max_q_entries=16)) for _ in "ab")
    stepping._chain_in_c = lambda *args: False
    return in_c, stepping


def proposals(drafter, tasks):
    return [(p.tokens, None if p.q is None else (p.q.token_ids.tolist(), p.q.probs.tolist()))
            for p in drafter.propose(tasks)]


@pytest.mark.parametrize("chunk_tokens", [None, 6], ids=["whole", "after-a-long-catch-up"])
def test_a_chain_in_c_proposes_the_tokens_and_q_of_the_steps_it_replaces(drafters, chunk_tokens):
    """Greedy, temperature (one below float32's range too) and top-k requests side by side, each
    asking its own K (0-5) round after round, with part of each proposal committed in between:
    every proposal equal. A first pass longer than a chunk runs as the drafter's own, the chain
    from the second pass."""
    in_c, stepping = drafters
    chunk = in_c.runner.chunk_tokens
    for drafter in drafters:
        drafter.runner.chunk_tokens = chunk_tokens or chunk
    chains, draft_chain = [], in_c.runner.draft_chain
    in_c.runner.draft_chain = lambda *args: chains.append(draft_chain(*args)) or chains[-1]
    rng = random.Random(0)
    vocab = in_c.runner.vocab_size
    committed = {f"{chunk_tokens}r{i}": [rng.randrange(vocab) for _ in range(3 + 4 * i)] for i in range(len(PARAMS))}
    sent = {req_id: 0 for req_id in committed}
    for _ in range(6):
        tasks = []
        for (req_id, tokens), params in zip(committed.items(), PARAMS):
            tasks.append(DraftTask(req_id, tokens[sent[req_id]:], rng.randrange(6), params))
            sent[req_id] = len(tokens)
        expected = proposals(stepping, tasks)
        assert proposals(in_c, tasks) == expected
        for tokens, (drafted, _) in zip(committed.values(), expected):
            tokens += drafted[:rng.randrange(len(drafted) + 1)] + [rng.randrange(vocab)]
    assert in_c.runner.forward_passes == stepping.runner.forward_passes
    assert sum(chain is not None for chain in chains) >= 4  # (the C path ran)
    del in_c.runner.draft_chain
    for drafter in drafters:
        drafter.runner.chunk_tokens = chunk


def test_a_tree_whose_other_branches_are_leaves_grows_its_first_branch_in_c(drafters):
    """Trees of 2 and 3 branches, the others leaves (side depth 1), greedy and sampled, beside
    chains, round after round with part of each tree's first branch or a leaf committed: every
    proposal (tokens, parents, q) equal to the stepping drafter's, each tree from one C call (the
    root's children from its first pass); a tree whose branches all grow (side depth 0) stays in
    steps."""
    in_c, stepping = drafters
    chains, draft_chain = [], in_c.runner.draft_chain
    in_c.runner.draft_chain = lambda *args: chains.append(draft_chain(*args)) or chains[-1]
    rng = random.Random(1)
    vocab = in_c.runner.vocab_size
    committed = {f"t{i}": [rng.randrange(vocab) for _ in range(4 + 3 * i)] for i in range(4)}
    sent = {req_id: 0 for req_id in committed}
    shapes = [(2, 1), (3, 1), (1, 0), (3, 1)]  # (branches, side depth) of each request
    for round_ in range(5):
        side_depth = 0 if round_ == 4 else None  # (the last round: every tree's branches grow)
        tasks = []
        for (req_id, tokens), params, (branches, side) in zip(committed.items(), PARAMS, shapes):
            tasks.append(DraftTask(req_id, tokens[sent[req_id]:], 1 + rng.randrange(4), params, branches=branches,
                                   side_depth=side if side_depth is None else side_depth))
            sent[req_id] = len(tokens)
        calls = len(chains)
        expected = [(p.tokens, p.parents, None if p.q is None else (p.q.token_ids.tolist(), p.q.probs.tolist()))
                    for p in stepping.propose(tasks)]
        got = [(p.tokens, p.parents, None if p.q is None else (p.q.token_ids.tolist(), p.q.probs.tolist()))
               for p in in_c.propose(tasks)]
        assert got == expected
        assert (len(chains) > calls) == (side_depth is None)
        for tokens, (drafted, parents, _) in zip(committed.values(), expected):
            leaf = [drafted[-1]] if parents and parents[-1] == -1 and rng.random() < 0.5 else []
            tokens += (leaf or drafted[:rng.randrange(len(drafted) + 1)] if parents else drafted[:1])
            tokens.append(rng.randrange(vocab))
    assert all(chain is not None for chain in chains) and len(chains) >= 4
    del in_c.runner.draft_chain


def test_a_chain_that_cannot_run_in_c_is_stepped_in_python_or_refused(drafters):
    """A top-p request (a pick the C kernels do not make) keeps the whole round in Python steps;
    a chain that gives up in C (a NaN in a sampled row's logits) or is refused (a token past the
    vocabulary) leaves the cache as it was."""
    in_c, stepping = drafters
    top_p = [DraftTask("p", [1, 2, 3], 4, SamplingParams(temperature=0.9, top_p=0.8, seed=5))]
    assert proposals(in_c, top_p) == proposals(stepping, top_p)
    runner = in_c.runner
    runner.cache.add_sequence("nan")
    runner.run(["nan"], [[4, 5, 6]], [1])
    head = runner.model.weights.lm_head.panels
    stored = head.panels.clone() if hasattr(head, "panels") else head.scales.clone()
    try:
        (head.panels if hasattr(head, "panels") else head.scales).fill_(float("nan"))
        assert runner.draft_chain(["nan"], [[7]], [3], [0.8], [12345], [4]) is None
        assert runner.cache.length("nan") == 3
    finally:
        (head.panels if hasattr(head, "panels") else head.scales).copy_(stored)
    vocab = runner.vocab_size
    with pytest.raises(KernelArgumentError, match="draft_chain"):  # (C would read past the embedding)
        runner.draft_chain(["nan"], [[vocab]], [2], [0.0], [0], [1])
    assert runner.cache.length("nan") == 3
    runner.cache.free_sequence("nan")



def test_the_speed_script_times_the_three_engines_on_the_shipped_pair():
    """scripts/draft_chain_speed.py (a smoke run): a line per engine and the two ratios."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "draft_chain_speed.py"
    run = subprocess.run([sys.executable, str(script), "--num-prompts", "1", "--max-new-tokens", "6", "--repeats",
                          "1", "--temperature", "0.8", "--fixed-k", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["plain", "stepping", "chain", "chain", "chain"]
    assert all("tok/s" in line for line in lines[:3]) and all(line.rstrip().endswith(")") for line in lines[3:])
