"""Speculative sampling: exactness (analytic and Monte-Carlo), greedy shortcut, guards, randomness."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdec.sampling import (
    ACCEPT,
    DRAFT,
    TARGET,
    sample_from_probs,
    speculative_step_distribution,
    speculative_verify,
    top_entries,
    uniforms,
)

P_MIN = 1e-3  # chi-square p-value threshold; seeds are fixed so the tests are deterministic


def sparse(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense q [..., V] as speculative_verify's (ids, probs): every token an entry."""
    return torch.arange(q.shape[-1]).expand_as(q), q


def sparsified(q: torch.Tensor, n: int) -> torch.Tensor:
    """q keeping its n largest entries, renormalised, back in dense form."""
    ids, vals = top_entries(q, n)
    return torch.zeros_like(q).scatter_(-1, ids, vals)


def dirichlet(shape, seed, alpha=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch._standard_gamma(torch.full(shape, alpha, dtype=dtype), generator=g)
    return x / x.sum(-1, keepdim=True)


def assert_counts_match(observed: np.ndarray, probs: np.ndarray):
    """Chi-square goodness of fit; categories with zero expected mass must be empty."""
    probs = probs / probs.sum()
    assert observed.sum() >= 200, "too few samples for a meaningful test"
    zero = probs == 0
    assert observed[zero].sum() == 0, f"observed impossible outcomes: {observed}, {probs}"
    stat = chisquare(observed[~zero], probs[~zero] * observed.sum())
    assert stat.pvalue > P_MIN, (observed, probs * observed.sum(), stat)


# ---------------------------------------------------------------- one step, exactly

@pytest.mark.parametrize("case", ["random", "q_zeros", "q_one_hot", "q_equals_p", "p_zeros", "disjoint"])
def test_step_distribution_equals_p(case):
    V = 10
    for seed in range(20):
        p = dirichlet((V,), seed)
        q = dirichlet((V,), 1000 + seed, alpha=0.3)
        if case == "q_zeros":
            q[torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:6]] = 0
            q /= q.sum()
        elif case == "q_one_hot":  # n-gram drafter: a single proposed token with q = 1
            q = torch.zeros(V, dtype=torch.float64)
            q[seed % V] = 1.0
        elif case == "q_equals_p":
            q = p.clone()
        elif case == "p_zeros":
            p[:4] = 0
            p /= p.sum()
        elif case == "disjoint":
            p[5:] = 0
            p /= p.sum()
            q[:5] = 0
            q /= q.sum()
        torch.testing.assert_close(speculative_step_distribution(p, q), p, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- Monte-Carlo

def run_sampled(p, q, B, seed, num_proposed=None):
    """B independent rounds of the same p [K+1,V] / q [K,V]; draft tokens drawn from q."""
    K1, V = p.shape
    K = K1 - 1
    g = torch.Generator().manual_seed(seed)
    draft = (torch.stack([torch.multinomial(q[i], B, replacement=True, generator=g) for i in range(K)], 1) if K
             else torch.zeros(B, 0, dtype=torch.long))
    nd = torch.full((B,), K) if num_proposed is None else num_proposed
    n_acc, nxt = speculative_verify(
        p.expand(B, -1, -1), *sparse(q.expand(B, -1, -1)), draft, nd, torch.zeros(B, dtype=torch.bool),
        torch.rand(B, K, generator=g, dtype=torch.float64), torch.rand(B, K + 1, generator=g, dtype=torch.float64),
    )
    return draft, n_acc, nxt


def output_token(draft, n_acc, nxt, pos):
    """Committed token at position `pos` (valid where n_acc >= pos)."""
    if draft.shape[1] == pos:
        return nxt
    return torch.where(n_acc > pos, draft[:, min(pos, draft.shape[1] - 1)], nxt)


@pytest.mark.parametrize("q_kind", ["dense", "sparse", "one_hot"])
def test_monte_carlo_outputs_follow_p(q_kind):
    V, K, B = 6, 3, 20000
    p = dirichlet((K + 1, V), seed=1).float()
    p[0, 5] = 0  # a token the target forbids must never come out
    p /= p.sum(-1, keepdim=True)
    q = dirichlet((K, V), seed=2, alpha=0.7).float()
    if q_kind == "sparse":
        q = sparsified(q, 2)
    elif q_kind == "one_hot":
        q = torch.nn.functional.one_hot(torch.tensor([4, 1, 2]), V).float()
    draft, n_acc, nxt = run_sampled(p, q, B, seed=3)

    first = output_token(draft, n_acc, nxt, 0)
    assert_counts_match(np.bincount(first.numpy(), minlength=V), p[0].double().numpy())
    # Given position 0 was accepted, the token at position 1 must follow p_1 (p does not depend
    # on the prefix here, so this is the conditional as well as the marginal).
    second = output_token(draft, n_acc, nxt, 1)[n_acc >= 1]
    assert_counts_match(np.bincount(second.numpy(), minlength=V), p[1].double().numpy())

    # Number accepted: P(n) = prod_{i<n} beta_i * (1 - beta_n), with all K accepted at the end.
    beta = torch.minimum(p[:K], q).sum(-1).double()
    expected = [float(beta[:n].prod() * (1 - beta[n])) for n in range(K)] + [float(beta.prod())]
    assert_counts_match(np.bincount(n_acc.numpy(), minlength=K + 1), np.array(expected))


def test_monte_carlo_one_step_accept_rate_and_bonus():
    V, B = 6, 20000
    p = dirichlet((2, V), seed=7).float()
    q = dirichlet((1, V), seed=8).float()
    draft, n_acc, nxt = run_sampled(p, q, B, seed=9)
    beta = float(torch.minimum(p[0], q[0]).sum())
    assert_counts_match(np.bincount(n_acc.numpy(), minlength=2), np.array([1 - beta, beta]))
    # After an accepted draft token, the bonus token follows p_1.
    assert_counts_match(np.bincount(nxt[n_acc == 1].numpy(), minlength=V), p[1].double().numpy())
    # After a rejection, the correction follows the residual norm(max(0, p_0 - q_0)).
    resid = (p[0] - q[0]).clamp_min(0).double().numpy()
    assert_counts_match(np.bincount(nxt[n_acc == 0].numpy(), minlength=V), resid)


def test_monte_carlo_k0_and_partial_num_proposed():
    V, K, B = 6, 3, 20000
    p = dirichlet((K + 1, V), seed=12).float()
    q = dirichlet((K, V), seed=13).float()
    nd = torch.arange(B) % 2  # rows with 0 or 1 real draft tokens; the rest is padding
    draft, n_acc, nxt = run_sampled(p, q, B, seed=14, num_proposed=nd)
    assert (n_acc <= nd).all()
    first = output_token(draft, n_acc, nxt, 0)
    assert_counts_match(np.bincount(first.numpy(), minlength=V), p[0].double().numpy())
    # K = 0: the round is plain sampling from p_0.
    _, n0, nxt0 = run_sampled(p[:1], q[:0], B, seed=15)
    assert (n0 == 0).all()
    assert_counts_match(np.bincount(nxt0.numpy(), minlength=V), p[0].double().numpy())


# ---------------------------------------------------------------- greedy, padding, guards

def one_hot(tokens, V):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_greedy_rows():
    V, K = 8, 3
    # Target argmaxes per row/position, and drafts that match for a prefix.
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0], [1, 2, 3, 4]]
    draft = torch.tensor([[1, 2, 3], [1, 7, 3], [0, 6, 7], [1, 2, -1]])
    num_proposed = torch.tensor([3, 3, 3, 2])
    p = torch.stack([one_hot(t, V) for t in target])
    q = torch.zeros(4, K, V)  # greedy requests carry no q
    greedy = torch.ones(4, dtype=torch.bool)
    n_acc, nxt = speculative_verify(p, *sparse(q), draft, num_proposed, greedy, torch.rand(4, K), torch.rand(4, K + 1))
    assert n_acc.tolist() == [3, 1, 0, 2]  # all + bonus, first rejected at 1, at 0, padding ignored
    assert nxt.tolist() == [4, 2, 5, 3]
    n_acc, nxt = speculative_verify(p, *sparse(q), draft, torch.zeros(4, dtype=torch.long), greedy,
                                    torch.rand(4, K), torch.rand(4, K + 1))
    assert n_acc.tolist() == [0] * 4 and nxt.tolist() == [1, 1, 5, 1]  # num_proposed = 0: target's own token


def test_mixed_greedy_and_sampled_rows_with_garbage_padding():
    V, K = 6, 3
    p = torch.full((3, K + 1, V), float("nan"))
    q = torch.full((3, K, V), float("nan"))
    # Row 0: greedy, one real draft token (matching); row 1: sampled, two tokens with p == q so
    # both must be accepted; row 2: sampled, draft token impossible under p -> rejected.
    p[0, :2] = one_hot([2, 4], V)
    p[1, :3] = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0, 0, 1.0, 0, 0, 0], [0, 0, 0, 0, 0, 1.0]])
    q[1, :2] = p[1, :2]
    p[2, :1] = torch.tensor([[0, 0.25, 0.25, 0.5, 0, 0]])
    q[2, :1] = torch.tensor([[0, 0, 0, 0, 1.0, 0]])
    draft = torch.tensor([[2, -1, 99], [1, 2, -7], [4, 10**6, -1]])
    num_proposed = torch.tensor([1, 2, 1])
    greedy = torch.tensor([True, False, False])
    n_acc, nxt = speculative_verify(p, *sparse(q), draft, num_proposed, greedy, torch.full((3, K), 0.999),
                                    torch.tensor([[0.3], [0.3], [0.9]]).expand(3, K + 1))
    assert n_acc.tolist() == [1, 2, 0]
    assert nxt.tolist() == [4, 5, 3]  # greedy bonus; sampled bonus from p_2; residual = p_0 here


def test_residual_all_zero_guard_falls_back_to_p():
    """p == q up to rounding: a rejection can leave max(0, p - q) == 0 everywhere. The correction
    must then come from p, never from an arbitrary (possibly zero-probability) index."""
    V, B = 6, 4000
    q = torch.tensor([[0.0, 0.2, 0.3, 0.1, 0.4, 0.0]]).expand(B, 1, V)
    p_row = torch.tensor([0.0, 0.2, 0.3, 0.1, 0.4, 0.0]) * 0.999  # slightly under q everywhere
    p = torch.stack([p_row, p_row], 0).expand(B, 2, V)
    g = torch.Generator().manual_seed(21)
    draft = torch.multinomial(q[0, 0], B, replacement=True, generator=g)[:, None]
    n_acc, nxt = speculative_verify(p, *sparse(q), draft, torch.ones(B, dtype=torch.long),
                                    torch.zeros(B, dtype=torch.bool), torch.full((B, 1), 0.9999),
                                    torch.rand(B, 2, generator=g))
    assert (n_acc == 0).all()
    counts = np.bincount(nxt.numpy(), minlength=V)
    assert counts[0] == 0 and counts[5] == 0
    assert_counts_match(counts, p_row.double().numpy())
    p64 = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    torch.testing.assert_close(speculative_step_distribution(p64, p64.clone()), p64)


def test_accept_rule_exact_thresholds():
    """Accept iff u < p(t)/q(t); always accept when p(t) >= q(t), even with u just below 1."""
    p = torch.tensor([[[0.2, 0.8], [0.5, 0.5]]]).expand(4, 2, 2)
    q = torch.tensor([[[0.4, 0.6]]]).expand(4, 1, 2)
    draft = torch.tensor([[0], [0], [1], [1]])
    u = torch.tensor([[0.49], [0.51], [0.9999999], [0.0]])
    n_acc, _ = speculative_verify(p, *sparse(q), draft, torch.ones(4, dtype=torch.long),
                                  torch.zeros(4, dtype=torch.bool), u, torch.rand(4, 2))
    assert n_acc.tolist() == [1, 0, 1, 1]


# ---------------------------------------------------------------- sample_from_probs

@settings(max_examples=200, deadline=None)
@given(
    weights=(st.lists(st.one_of(st.just(0.0), st.floats(1e-30, 1.0)), min_size=1, max_size=40)
             .filter(lambda w: sum(w) > 0)),
    u=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.floats(1 - 1e-6, 1.0, exclude_max=True),
                st.just(float(np.nextafter(np.float32(1), np.float32(0))))),
    tail_zeros=st.integers(0, 5),
)
def test_sample_from_probs_never_picks_zero_probability(weights, u, tail_zeros):
    probs = torch.tensor([weights + [0.0] * tail_zeros], dtype=torch.float32)
    tok = int(sample_from_probs(probs, torch.tensor([u], dtype=torch.float32))[0])
    assert probs[0, tok] > 0


def test_sample_from_probs_distribution_and_edges():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]])
    B = 20000
    u = torch.rand(B, generator=torch.Generator().manual_seed(31))
    toks = sample_from_probs(probs.expand(B, -1), u)
    assert toks.dtype == torch.int64
    assert_counts_match(np.bincount(toks.numpy(), minlength=6), probs[0].double().numpy())
    edge = sample_from_probs(probs.expand(3, -1) * 7, torch.tensor([0.0, 1 - 2**-24, 0.1 / 1.0]))
    assert edge.tolist() == [1, 4, 3]  # unnormalised rows are fine; u -> 1 lands on the last nonzero


def test_sample_from_probs_repairs_a_cdf_a_parallel_scan_rounded_up(monkeypatch):
    """A GPU's parallel cumsum may put a zero-probability token's cdf value above its neighbour's;
    the token must still never be drawn (the CPU's sequential cumsum cannot do this, so it is
    faked here)."""
    import specdec.sampling.speculative as speculative

    probs = torch.tensor([[0.5, 0.0, 0.5], [0.25, 0.25, 0.5]], dtype=torch.float64)
    rounded_up = torch.tensor([[0.5, 0.5 + 2**-40, 1.0], [0.25, 0.5, 1.0]], dtype=torch.float64)
    monkeypatch.setattr(speculative.torch, "cumsum", lambda x, dim: rounded_up.clone())
    u = torch.tensor([0.5, 0.3], dtype=torch.float64)  # row 0: u * total sits on the bad step
    assert sample_from_probs(probs, u).tolist() == [2, 1]


def test_the_gpus_always_repaired_search_never_draws_a_zero_probability_token(monkeypatch):
    """Off the CPU every row is searched on the repaired cdf (no flag read back): on an exact cdf
    it picks the CPU path's tokens; on one a parallel scan rounded up at zero-probability tokens it
    still never draws one, and where the CPU path had to repair a row, it picks the same."""
    import specdec.sampling.speculative as speculative

    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(400, 12, generator=gen, dtype=torch.float64)
    probs[torch.rand(400, 12, generator=gen) < 0.4] = 0.0
    probs[:, 5] += 1e-3  # every row keeps some mass
    u = torch.rand(400, generator=gen, dtype=torch.float64)
    exact = torch.cumsum(probs, dim=-1)
    assert torch.equal(speculative._search(speculative._repaired(probs, exact), u), sample_from_probs(probs, u))
    # Zero-probability steps raised (far beyond a real scan's rounding, so that random u hit them).
    rounded_up = exact + torch.where(probs == 0, 0.05, 0.0)
    raw = speculative._search(rounded_up, u)
    hit = (probs.gather(1, raw[:, None]) == 0).squeeze(1)
    assert int(hit.sum()) > 10  # the repair has work to do
    always_repaired = speculative._search(speculative._repaired(probs, rounded_up), u)
    assert bool((probs.gather(1, always_repaired[:, None]) > 0).all())
    monkeypatch.setattr(speculative.torch, "cumsum", lambda x, dim: rounded_up.clone())
    assert torch.equal(sample_from_probs(probs, u)[hit], always_repaired[hit])


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_the_cpus_search_picks_the_batched_searchs_tokens_bit_for_bit(rows):
    """Up to a few rows the CPU searches each row in Python and numpy (~30-40 us less a draw): it
    must pick exactly the index torch's batched search picks on the same cdf, at any u, u = 0 and
    u next to 1, over runs of zero-probability tokens."""
    import specdec.sampling.speculative as speculative

    gen = torch.Generator().manual_seed(rows)
    for vocab in (5, 4096):
        probs = torch.rand(rows, vocab, generator=gen) ** 4
        probs[torch.rand(rows, vocab, generator=gen) < 0.5] = 0.0
        probs[:, vocab // 2] += 1e-6  # every row keeps some mass
        for u in (torch.rand(rows, generator=gen, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64),
                  torch.full((rows,), 1 - 2**-53, dtype=torch.float64)):
            batched = speculative._search(torch.cumsum(probs.double(), dim=-1), u)
            assert torch.equal(sample_from_probs(probs, u), batched)


def test_a_few_rows_verified_one_at_a_time_get_the_batched_verdicts_bit_for_bit(monkeypatch):
    """Up to a few rows the CPU verifies each row in Python and numpy (~0.2 ms less a round): the
    same accepted counts and next tokens as the batched torch version, for greedy and sampled
    rows, proposals of every length (0 included), rejections with and without residual mass."""
    import specdec.sampling.speculative as speculative

    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        batch, k, vocab = 1 + trial % 8, trial % 5, 2 + trial % 29
        entries = min(1 + trial % 3, vocab)
        p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1)
        p[torch.rand(batch, k + 1, vocab, generator=gen) < 0.2] = 0.0
        p[:, :, 0] += 1e-4
        q_ids = torch.stack([torch.randperm(vocab, generator=gen)[:entries] for _ in range(batch * k)]
                            or [torch.zeros(entries, dtype=torch.long)])[:batch * k].view(batch, k, entries)
        q_probs = torch.rand(batch, k, entries, generator=gen) * (torch.rand(batch, k, entries, generator=gen) > 0.3)
        q_probs[:, :, 0] += 0.01
        q_probs /= q_probs.sum(-1, keepdim=True)
        proposed = torch.randint(0, k + 1, (batch,), generator=gen)
        picks = torch.randint(0, entries, (batch, k), generator=gen)
        draft = torch.where(q_probs.gather(2, picks[..., None])[..., 0] > 0, q_ids.gather(2, picks[..., None])[..., 0],
                            q_ids[:, :, 0])  # (a proposed token has q > 0: the target checks)
        draft[torch.arange(k)[None, :] >= proposed[:, None]] = -1
        greedy = torch.rand(batch, generator=gen) < 0.3
        args = (p, q_ids, q_probs, draft, proposed, greedy, torch.rand(batch, k, generator=gen, dtype=torch.float64),
                torch.rand(batch, k + 1, generator=gen, dtype=torch.float64))
        row_at_a_time = speculative_verify(*args)
        monkeypatch.setattr(speculative, "_ROW_AT_A_TIME", 0)
        batched = speculative_verify(*args)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(row_at_a_time, batched)), trial


# ---------------------------------------------------------------- per-request randomness

def test_uniforms_are_a_function_of_seed_position_and_purpose_only():
    seeds, positions = [123, 7, 2**64 - 1], [[5, 6, 7], [0, 1, 2], [9, 10, 11]]
    batch = uniforms(seeds, positions, ACCEPT)
    assert batch.shape == (3, 3) and batch.dtype == torch.float64
    # Alone, in another batch, in another order, one position at a time: the same values.
    assert torch.equal(uniforms([123], [[5, 6, 7]], ACCEPT)[0], batch[0])
    assert torch.equal(uniforms([2**64 - 1, 123], [[11], [6]], ACCEPT).flatten(), batch[[2, 0], [2, 1]])
    # Other purposes, seeds, positions: other values.
    for purpose in (DRAFT, TARGET):
        assert not torch.equal(uniforms(seeds, positions, purpose), batch)
    assert not torch.equal(uniforms([124], [[5, 6, 7]], ACCEPT)[0], batch[0])
    assert ((batch >= 0) & (batch < 1)).all()


def test_a_few_uniforms_made_in_pythons_integers_are_numpys_bits(monkeypatch):
    """A batch-1 step asks for 1-12 uniforms: those are hashed in Python's integers (numpy's
    fixed cost was ~30 us a call), and must be the very bits numpy makes, whatever the shape,
    seed (all 64 bits), position or tree rank."""
    import specdec.sampling.random as random_module

    gen = np.random.default_rng(0)
    for trial in range(200):
        rows, width = int(gen.integers(1, 4)), int(gen.integers(1, 5))
        seeds = [int(s) for s in gen.integers(0, 2**63, rows, dtype=np.uint64) * 2 + trial % 2]
        positions = gen.integers(0, 10**6, (rows, width)) if trial % 3 else gen.integers(0, 10**6, rows)
        ranks = [int(r) for r in gen.integers(0, 4, rows)] if trial % 2 else None
        purpose = (DRAFT, ACCEPT, TARGET)[trial % 3]
        few = uniforms(seeds, positions, purpose, ranks=ranks)
        monkeypatch.setattr(random_module, "_FEW", 0)  # numpy's hash
        made_by_numpy = uniforms(seeds, positions, purpose, ranks=ranks)
        monkeypatch.undo()
        assert few.shape == made_by_numpy.shape == positions.shape and torch.equal(few, made_by_numpy)


def test_seeds_that_differ_only_in_the_top_bit_give_their_own_streams():
    low, high = uniforms([5], [list(range(64))], TARGET), uniforms([5 | 1 << 63], [list(range(64))], TARGET)
    assert not torch.isclose(low, high).any()
    with pytest.raises(ValueError):
        uniforms([1], [[-1]], TARGET)


def test_uniforms_carry_53_bits_and_are_uniform():
    u = uniforms(list(range(200)), np.tile(np.arange(1000), (200, 1)), DRAFT).flatten()
    scaled = u * 2**53
    assert torch.equal(scaled, scaled.floor())  # on the 2^-53 grid
    assert (scaled % 2**29 != 0).float().mean() > 0.99  # the low bits are used, not a float32 in disguise
    counts = np.histogram(u.numpy(), bins=50, range=(0, 1))[0]
    assert chisquare(counts).pvalue > P_MIN
    # Neighbouring positions and neighbouring seeds are not correlated.
    grid = u.view(200, 1000)
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):
        assert abs(np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1]) < 0.01


def test_a_token_below_float32_resolution_is_sampled_at_its_rate():
    """p(token 1) = 2^-30 < 2^-24. Uniforms conditioned on the top 2^-20 of [0, 1) select it with
    probability 2^-10; on a float32 grid (spacing 2^-24 below 1) it could never be drawn."""
    small = 2.0**-30
    probs = torch.tensor([[1 - small, small]], dtype=torch.float64).expand(200_000, 2)
    u = uniforms([11], [np.arange(200_000)], TARGET)[0]
    top = 1 - 2.0**-20 * u  # the top 2^-20 of [0, 1), still on the 2^-53 grid
    hits = int((sample_from_probs(probs, top) == 1).sum())
    rate = 2.0**-10  # = small / 2^-20
    expected, sd = 200_000 * rate, (200_000 * rate * (1 - rate)) ** 0.5
    assert abs(hits - expected) < 5 * sd, (hits, expected)
    as_float32 = top.float().double().clamp(max=1 - 2.0**-24)  # what float32 uniforms would give
    assert int((sample_from_probs(probs, as_float32) == 1).sum()) == 0
