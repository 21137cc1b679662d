"""Acceptance rules (spec/accept.py): chain matching on hand-built chains; sampling_probs
against hand-computed distributions and SGLang's own sampler; rejection sampling checked
statistically against the target distribution of a tiny random trigram model, with
negative controls that must fail the same check. CPU; most of the time is importing
SGLang's sampler (~20 s)."""

from typing import NamedTuple

import pytest
import torch
from scipy import stats

from sgl_vericache.spec.accept import (
    chain_match,
    filter_probs,
    rejection_sample_chain,
    sample_draft,
    sampling_probs,
)

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are tiny: extra intra-op threads only contend for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- statistics ----------------------------------------------------------------------------

ALPHA = 1e-3  # significance of every goodness-of-fit check (fixed seeds: deterministic)


def chi_square(counts, probs, min_expected=5.0):
    """Pearson goodness of fit; cells expected below ``min_expected`` are pooled into one.
    Cells of probability 0 must be empty and are left out."""
    impossible = probs == 0
    assert counts[impossible].sum() == 0, f"drew a token of probability 0: {counts.tolist()}"
    counts, probs = counts[~impossible], probs[~impossible].double()
    expected = counts.sum().double() * probs / probs.sum()
    small = expected < min_expected
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if not small.any():
        observed, expected = observed[:-1], expected[:-1]
    result = stats.chisquare(observed.numpy(), expected.numpy())
    return Fit(float(result.statistic), len(observed) - 1, float(result.pvalue))


class Fit(NamedTuple):
    statistic: float
    dof: int
    pvalue: float

    def __str__(self):
        return f"chi2={self.statistic:.1f} dof={self.dof} p={self.pvalue:.3g}"


# --- chain_match ---------------------------------------------------------------------------

ROOT = 7
DRAFTS = [11, 12, 13]
TARGETS = [11, 12, 13, 14]  # the target's pick after the root, d_1, d_2, d_3


def match_one(drafts, targets, max_accept):
    num_accepted, tokens = chain_match(torch.tensor([[ROOT, *drafts]]), torch.tensor([targets]), [max_accept])
    return num_accepted.item(), tokens[0].tolist()


@pytest.mark.parametrize(
    "drafts, max_accept, want_accepted, want_tokens",
    [
        (DRAFTS, 3, 3, [11, 12, 13, 14]),  # all accepted, bonus from the last row
        ([99, 12, 13], 3, 0, [11, -1, -1, -1]),  # first draft wrong: correction only
        ([11, 99, 13], 3, 1, [11, 12, -1, -1]),  # mismatch in the middle; later match ignored
        (DRAFTS, 2, 2, [11, 12, 13, -1]),  # max_accept shorter than the matching prefix
        (DRAFTS, 0, 0, [11, -1, -1, -1]),  # no drafts allowed
    ],
    ids=["all", "none", "middle", "max_accept_cuts", "max_accept_0"],
)
def test_chain_match_single(drafts, max_accept, want_accepted, want_tokens):
    assert match_one(drafts, TARGETS, max_accept) == (want_accepted, want_tokens)


def test_chain_match_batch_rows_differ():
    candidates = torch.tensor([[ROOT, 11, 12, 13], [ROOT, 11, 99, 13], [ROOT, 99, 12, 13], [ROOT, 11, 12, 0]])
    targets = torch.tensor([TARGETS] * 4)
    num_accepted, tokens = chain_match(candidates, targets, torch.tensor([3, 3, 3, 2]))
    assert num_accepted.tolist() == [3, 1, 0, 2]
    assert tokens.tolist() == [[11, 12, 13, 14], [11, 12, -1, -1], [11, -1, -1, -1], [11, 12, 13, -1]]


def test_max_accept_checked():
    candidates, targets = torch.tensor([[ROOT, *DRAFTS]]), torch.tensor([TARGETS])
    with pytest.raises(ValueError, match="max_accept"):
        chain_match(candidates, targets, [4])
    with pytest.raises(ValueError, match="shape"):
        chain_match(candidates, targets, [1, 1])


# --- sampling_probs ------------------------------------------------------------------------

WEIGHTS = torch.tensor([1.0, 2.0, 3.0, 4.0])  # probs 0.1, 0.2, 0.3, 0.4 at temperature 1
LOGITS = WEIGHTS.log()[None]


def normalized(weights):
    weights = torch.tensor(weights, dtype=torch.float32)
    return weights / weights.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p, want",
    [
        (1.0, -1, 1.0, 0.0, [1, 2, 3, 4]),
        (2.0, -1, 1.0, 0.0, [1, 2**0.5, 3**0.5, 2]),  # softmax(log w / 2) ~ sqrt(w)
        (0.5, -1, 1.0, 0.0, [1, 4, 9, 16]),
        (1.0, 2, 1.0, 0.0, [0, 0, 3, 4]),
        (1.0, 1 << 30, 1.0, 0.0, [1, 2, 3, 4]),  # SGLang's TOP_K_ALL
        (1.0, -1, 0.75, 0.0, [0, 2, 3, 4]),  # mass before: 0, .4, .7 <= .75; .9 > .75
        (1.0, -1, 0.35, 0.0, [0, 0, 0, 1]),  # .4 before the 0.3 already exceeds .35
        (1.0, -1, 1.0, 0.6, [0, 0, 3, 4]),  # keep p >= 0.6 * 0.4
        (1.0, -1, 1.0, 0.45, [0, 2, 3, 4]),  # keep p >= 0.18
        (1.0, 3, 0.75, 0.6, [0, 0, 3, 4]),  # all three filters
        (0.0, -1, 1.0, 0.0, [0, 0, 0, 1]),  # temperature 0 = greedy
        (1.0, 1, 1.0, 0.0, [0, 0, 0, 1]),  # SGLang's form of greedy
    ],
)
def test_sampling_probs_hand_computed(temperature, top_k, top_p, min_p, want):
    probs = sampling_probs(LOGITS, temperature, top_k, top_p, min_p)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs[0], normalized(want))


def test_sampling_probs_per_row_params():
    logits = LOGITS.expand(3, 4)
    probs = sampling_probs(logits, [0.0, 1.0, 2.0], torch.tensor([[-1], [2], [-1]]), [1.0, 1.0, 1.0], 0.0)
    for row, want in zip(probs, [[0, 0, 0, 1], [0, 0, 3, 4], [1, 2**0.5, 3**0.5, 2]]):
        torch.testing.assert_close(row, normalized(want))


def test_greedy_is_one_hot_at_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    probs = sampling_probs(logits, 0.0, -1, 1.0, 0.0)
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


# Parameter sets as a user sends them; SGLang's SamplingParams normalizes them for its sampler.
USER_PARAMS = [  # temperature, top_k, top_p, min_p
    (1.0, -1, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, -1, 0.8, 0.0),
    (1.0, -1, 1.0, 0.1),
    (0.9, 6, 0.9, 0.05),
    (0.0, -1, 1.0, 0.0),
]
VOCAB = 8


@pytest.fixture(scope="module")
def sglang_sampler():
    """SGLang's pure-torch filter-and-sample function and the engine's parameter
    normalization, fed the way Sampler.forward feeds them."""
    import sgl_vericache.cpu.compat as cpu_compat

    cpu_compat.install()
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
    from sglang.srt.sampling.sampling_params import SamplingParams

    def run(logits, **kwargs):
        params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in USER_PARAMS]
        rows = logits.shape[0] // len(params)
        column = lambda name, dtype: torch.tensor([getattr(s, name) for s in params for _ in range(rows)], dtype=dtype)
        probs = torch.softmax(logits / column("temperature", torch.float32)[:, None], dim=-1)
        return top_k_top_p_min_p_sampling_from_probs_torch(
            probs, column("top_k", torch.int64), column("top_p", torch.float32), column("min_p", torch.float32),
            need_min_p_sampling=True, sampling_seed=None, positions=None, **kwargs,
        )

    return run


def our_probs(logits):
    rows = logits.shape[0] // len(USER_PARAMS)
    t, k, p, m = (torch.tensor(c).repeat_interleave(rows) for c in zip(*USER_PARAMS))
    return sampling_probs(logits, t, k, p, m)


def test_sampling_probs_equals_sglang_filtered_weights(sglang_sampler):
    logits = 2 * torch.randn(len(USER_PARAMS) * 4, VOCAB, generator=torch.Generator().manual_seed(1))
    _, weights_sorted, order, _ = sglang_sampler(logits.clone(), return_filtered_probs=True)
    weights_sorted = weights_sorted / weights_sorted.sum(-1, keepdim=True)
    theirs = torch.zeros_like(weights_sorted).scatter_(-1, order.long(), weights_sorted)
    torch.testing.assert_close(our_probs(logits), theirs)
    assert (theirs.view(len(USER_PARAMS), -1, VOCAB)[1:] == 0).any(-1).all()  # every filter cut something


def test_sampling_probs_matches_sglang_draws(sglang_sampler):
    """What SGLang's sampler actually draws, per parameter set, fits our distribution."""
    draws_per_row = 20_000
    logits = 2 * torch.randn(len(USER_PARAMS), VOCAB, generator=torch.Generator().manual_seed(2))
    logits = logits.repeat_interleave(draws_per_row, dim=0)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        tokens = sglang_sampler(logits.clone()).long().view(len(USER_PARAMS), draws_per_row)
    want = our_probs(logits).view(len(USER_PARAMS), draws_per_row, VOCAB)[:, 0].double()
    for params, row_tokens, row_probs in zip(USER_PARAMS, tokens, want):
        counts = torch.bincount(row_tokens, minlength=VOCAB)
        if (row_probs > 0).sum() > 1:
            fit = chi_square(counts, row_probs)
            assert fit.pvalue > ALPHA, (params, fit)
        else:  # greedy: every draw is the one token we keep
            assert counts[row_probs == 1].item() == draws_per_row, params


def test_seeded_draws_with_min_p_fit_the_distribution(sglang_sampler):
    """sgl_vericache lets SGLang's seeded sampler serve min-p (which it refuses alone) by
    applying min-p first. Seeded draws at distinct positions are independent samples: they
    must fit the same distribution as SGLang's own unseeded min-p sampling."""
    from sglang.srt.layers import sampler as sampler_mod

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.sampling import install_seeded_per_row_sampling

    install_seeded_per_row_sampling(Runtime())
    draws_per_row = 20_000
    logits = 2 * torch.randn(len(USER_PARAMS), VOCAB, generator=torch.Generator().manual_seed(4))
    logits = logits.repeat_interleave(draws_per_row, dim=0)
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in USER_PARAMS]
    column = lambda name, dtype: torch.tensor(  # noqa: E731  (as the engine normalizes them)
        [getattr(sp, name) for sp in params for _ in range(draws_per_row)], dtype=dtype)
    probs = torch.softmax(logits / column("temperature", torch.float32)[:, None], dim=-1)
    seeds = torch.full((logits.shape[0],), 1234, dtype=torch.int64)
    positions = torch.arange(logits.shape[0], dtype=torch.int64)
    tokens = sampler_mod.top_k_top_p_min_p_sampling_from_probs_torch(
        probs, column("top_k", torch.int64), column("top_p", torch.float32), column("min_p", torch.float32),
        True, seeds, positions).long().view(len(USER_PARAMS), draws_per_row)
    want = our_probs(logits).view(len(USER_PARAMS), draws_per_row, VOCAB)[:, 0].double()
    for params, row_tokens, row_probs in zip(USER_PARAMS, tokens, want):
        counts = torch.bincount(row_tokens, minlength=VOCAB)
        assert counts[row_probs == 0].sum() == 0, params  # never a filtered-out token
        if (row_probs > 0).sum() > 1:
            fit = chi_square(counts, row_probs)
            assert fit.pvalue > ALPHA, (params, fit)


def test_seeded_draw_depends_only_on_its_own_row(sglang_sampler):
    """A seeded request draws the same token whatever its batch-mates ask for. SGLang's
    sampler takes its unfiltered path (noise keyed on token ids) when no row filters and its
    sorted path otherwise; sgl_vericache makes both key the noise on token ids, so a row
    sampled alone, or next to a top-p or min-p row, gives one answer per (seed, position).
    Negative control: SGLang's unpatched sorted path disagrees with its unfiltered path."""
    from sglang.srt.layers import sampler as sampler_mod
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.sampling import install_seeded_per_row_sampling

    unpatched = sampler_mod.top_k_top_p_min_p_sampling_from_probs_torch
    unpatched = getattr(unpatched, "__wrapped__", unpatched)
    install_seeded_per_row_sampling(Runtime())
    vocab, draws = 64, 400
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(2 * torch.randn(draws, vocab, generator=gen), dim=-1)
    seeds = torch.randint(0, 2**62, (draws,), generator=gen)
    positions = torch.randint(0, 4096, (draws,), generator=gen)
    alone = sampler_mod.sampling_from_probs_torch(probs, seeds, positions).long()  # SGLang's no-filter path

    def with_mates(params):  # every row unfiltered, then each row also sampled next to a filtering mate
        sp = [SamplingParams(temperature=1.0), SamplingParams(**params)]
        col = lambda name, dtype: torch.tensor([getattr(sp[i % 2], name) for i in range(2 * draws)], dtype=dtype)
        both = torch.stack([probs, probs], dim=1).view(2 * draws, vocab)
        tokens = sampler_mod.top_k_top_p_min_p_sampling_from_probs_torch(
            both, col("top_k", torch.int64), col("top_p", torch.float32), col("min_p", torch.float32),
            True, seeds.repeat_interleave(2), positions.repeat_interleave(2))
        return tokens.long().view(draws, 2)

    for params in ({"top_p": 0.8}, {"min_p": 0.1}, {"top_k": 5}):
        tokens = with_mates(params)
        assert torch.equal(tokens[:, 0], alone), params
        filtered = tokens[:, 1]
        agree = filtered == alone  # the filter only removes tokens: a kept draw is the same draw
        kept = filter_probs(probs, torch.tensor(params.get("top_k", -1)), params.get("top_p", 1.0),
                            params.get("min_p", 0.0))
        assert torch.equal(agree, kept.gather(1, alone[:, None]).squeeze(1) > 0), params
    sorted_path = unpatched(probs.clone(), torch.full((draws,), vocab), torch.full((draws,), 0.999),
                            torch.zeros(draws), False, seeds, positions).long()
    assert (sorted_path != alone).float().mean() > 0.5


# --- rejection sampling on a tiny model ----------------------------------------------------

V = 5  # tiny vocabulary
CHAIN = 3  # drafts per round, and emitted tokens compared per sample
SAMPLES = 40_000
PREFIX = (0, 1)


class Trigram:
    """A random-weight autoregressive model: p(x | a, b) = softmax(table[a, b] / temperature)."""

    def __init__(self, logits, temperature=1.0):
        self.probs_table = torch.softmax(logits / temperature, dim=-1)  # [V, V, V]

    def __call__(self, a, b):  # a, b: [N] -> [N, V]
        return self.probs_table[a, b]

    def sequence_probs(self):
        """[V**CHAIN]: exact probability of each CHAIN-token continuation of PREFIX."""
        p = self.probs_table
        seq = p[PREFIX][:, None, None] * p[PREFIX[1]][:, :, None] * p  # [x1, x2, x3]
        return seq.double().flatten()


def tiny_models(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, V, generator=gen)
    target = Trigram(logits)
    draft = Trigram(logits + 1.0 * torch.randn(V, V, V, generator=gen), temperature=0.7)
    return target, draft


def speculate(rule, target, draft, seed, greedy_draft=False, random_lengths=False, samples=SAMPLES):
    """Run speculative rounds (draft CHAIN tokens from ``draft``, verify with ``rule`` against
    ``target`` rows along the chain) until every sample emitted CHAIN tokens; [samples, CHAIN]."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(samples)
    history = torch.full((samples, len(PREFIX) + CHAIN * (CHAIN + 1)), -1)  # at most CHAIN rounds
    history[:, : len(PREFIX)] = torch.tensor(PREFIX)
    length = torch.full((samples,), len(PREFIX))
    while (length < len(PREFIX) + CHAIN).any():
        a, b = history[rows, length - 2], history[rows, length - 1]
        candidates, q_rows, p_rows = [b], [], [target(a, b)]
        for _ in range(CHAIN):
            q = draft(a, b)
            if greedy_draft:
                d = q.argmax(-1)
                q = torch.nn.functional.one_hot(d, V).float()
            else:
                d, q = sample_draft(q, gen)
            a, b = b, d
            candidates.append(d)
            q_rows.append(q)
            p_rows.append(target(a, b))
        max_accept = torch.randint(0, CHAIN + 1, (samples,), generator=gen) if random_lengths else [CHAIN] * samples
        num_accepted, tokens = rule(
            torch.stack(candidates, 1), torch.stack(p_rows, 1), torch.stack(q_rows, 1), max_accept, gen
        )
        emitted = torch.arange(CHAIN + 1) <= num_accepted[:, None]  # [samples, CHAIN + 1]
        assert (tokens[emitted] >= 0).all() and (tokens[~emitted] == -1).all()
        positions = length[:, None] + torch.arange(CHAIN + 1)
        history[rows[:, None].expand_as(positions)[emitted], positions[emitted]] = tokens[emitted]
        length += num_accepted + 1
    return history[:, len(PREFIX) : len(PREFIX) + CHAIN]


def sequence_fit(rule, seed=0, **kwargs):
    target, draft = tiny_models()
    sequences = speculate(rule, target, draft, seed, **kwargs)
    codes = (sequences * torch.tensor([V * V, V, 1])).sum(-1)
    fit = chi_square(torch.bincount(codes, minlength=V**CHAIN), target.sequence_probs())
    print(f"{getattr(rule, '__name__', rule)} {kwargs}: {fit}")  # shown with pytest -s
    return fit


def matched_target_draws(candidates, target_probs, draft_probs, max_accept, gen):
    """chain_match against a seeded draw from every target row (sampling without a q)."""
    bs, n, vocab = target_probs.shape
    targets = torch.multinomial(target_probs.reshape(-1, vocab), 1, generator=gen).view(bs, n)
    return chain_match(candidates, targets, max_accept)


def always_accept(candidates, target_probs, draft_probs, max_accept, gen):
    """Wrong: every draft accepted, so the output is distributed as the draft model."""
    return chain_match(candidates, torch.cat([candidates[:, 1:], candidates[:, -1:]], 1), max_accept)


def correction_from_target(candidates, target_probs, draft_probs, max_accept, gen):
    """Wrong, subtly: after a rejection, the correction is drawn from p, not from (p - q)+."""
    num_accepted, tokens = rejection_sample_chain(candidates, target_probs, draft_probs, max_accept, gen)
    p_last = target_probs[torch.arange(len(num_accepted)), num_accepted]
    tokens.scatter_(1, num_accepted[:, None], torch.multinomial(p_last, 1, generator=gen))
    return num_accepted, tokens


@pytest.mark.parametrize(
    "rule, kwargs",
    [
        (rejection_sample_chain, {}),
        (rejection_sample_chain, {"random_lengths": True}),  # per-request draft length, padding
        (rejection_sample_chain, {"greedy_draft": True}),  # one-hot q
        (matched_target_draws, {}),
    ],
    ids=["sampled_draft", "random_lengths", "greedy_draft", "chain_match_sampled_targets"],
)
def test_speculation_samples_the_target_distribution(rule, kwargs):
    fit = sequence_fit(rule, **kwargs)
    assert fit.pvalue > ALPHA, fit


@pytest.mark.parametrize("rule", [always_accept, correction_from_target])
def test_wrong_rules_fail_the_same_check(rule):
    """The check has power: rules that do not sample the target are rejected by it."""
    fit = sequence_fit(rule)
    assert fit.pvalue < ALPHA, fit


# --- rejection_sample_chain edge cases and determinism -------------------------------------


def one_hot(token, vocab=V):
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


def test_rejection_edge_cases():
    gen = torch.Generator().manual_seed(0)
    uniform = torch.full((V,), 1.0 / V)
    candidates = torch.tensor([[0, 2, 3]] * 4)
    target = torch.stack([
        torch.stack([one_hot(2), one_hot(3), one_hot(4)]),  # drafts certain under p: all accepted
        torch.stack([one_hot(1), uniform, uniform]),  # p(d_1) = 0: rejected, correction 1
        torch.stack([uniform, one_hot(1), uniform]),  # q(d_1) = 0 < p(d_1): accepted (ratio limit)
        torch.stack([one_hot(4), uniform, uniform]),  # p = q = 0 at d_1: rejected; residual 0 -> p
    ])
    draft = torch.stack([
        torch.stack([one_hot(2), one_hot(3)]),
        torch.stack([one_hot(2), one_hot(3)]),
        torch.stack([one_hot(1), one_hot(3)]),  # d_1 = 2 has q 0
        torch.stack([one_hot(4), one_hot(3)]),
    ])
    num_accepted, tokens = rejection_sample_chain(candidates, target, draft, [2, 2, 2, 2], gen)
    assert num_accepted.tolist() == [2, 0, 1, 0]
    assert tokens[0].tolist() == [2, 3, 4]
    assert tokens[1].tolist() == [1, -1, -1]
    assert tokens[2].tolist() == [2, 1, -1]  # then d_2 = 3 has p 0: residual is one_hot(1)
    assert tokens[3].tolist() == [4, -1, -1]
    # max_accept 0: the bonus comes from row 0 whatever the drafts
    num_accepted, tokens = rejection_sample_chain(candidates[:1], target[:1], draft[:1], [0], gen)
    assert num_accepted.tolist() == [0] and tokens.tolist() == [[2, -1, -1]]


def test_same_seed_same_output():
    target, draft = tiny_models()
    runs = [speculate(rejection_sample_chain, target, draft, seed=s, samples=1000) for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    probs = torch.softmax(torch.randn(100, V), -1)
    assert torch.equal(*(sample_draft(probs, torch.Generator().manual_seed(1))[0] for _ in range(2)))


def test_an_undefined_target_distribution_emits_a_token_instead_of_raising():
    """A row whose target distribution came out undefined (NaN here) must not raise in the
    final draw: that took the whole server down once under API fuzzing. The row emits its
    most likely finite token (token 0 if none); the other rows are drawn as before."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 3
    target = torch.full((3, n, vocab), 1.0 / vocab)
    target[1] = float("nan")  # row 1: no distribution anywhere
    target[2, 0] = torch.tensor([0.0, 0.1, float("inf"), 0.7, 0.2, 0.0])  # row 2: an infinite entry
    draft = torch.full((3, n - 1, vocab), 1.0 / vocab)
    candidates = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 5, 5]])
    num_accepted, tokens = rejection_sample_chain(candidates, target, draft, [2, 2, 2], gen)
    assert num_accepted[1] == 0 and tokens[1, 0] == 0  # nothing accepted against NaN; token 0
    assert num_accepted[2] == 0 and tokens[2, 0] == 3  # p(5) = 0 rejects; 0.7 is the largest finite entry
    assert 0 <= int(tokens[0, int(num_accepted[0])]) < vocab


def test_deterministic_inference_makes_every_row_a_seeded_one(monkeypatch):
    """Under --enable-deterministic-inference SGLang seeds every request without a seed with
    42, so speculation off draws each row reproducibly: every row is matched draw for draw
    (before, rows without their own seed were accepted by rejection sampling, and their ids
    differed from speculation off's)."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as context

    from sgl_vericache.sglang.sampling import seeded_rows

    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=s)) for s in (None, 7, None)]
    for on, want in ((False, [False, True, False]), (True, [True, True, True])):
        monkeypatch.setattr(context, "get_exec", lambda on=on: SimpleNamespace(
            deterministic=SimpleNamespace(enable_deterministic_inference=on)))
        assert seeded_rows(reqs) == want


def test_filtering_without_top_k_or_top_p_needs_no_sort(monkeypatch):
    """Rows that filter by min-p at most skip the full-vocabulary sort (on a GPU at batch 64 x
    17 verify rows x 128k tokens, gigabytes of sorted copies) and keep exactly what the sorted
    path keeps."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(6, 500, generator=gen) * 3, dim=-1)
    min_ps = torch.tensor([0.0, 0.05, 0.2, 0.5, 1.0, 0.01])
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)  # the sorted path's rule, by hand
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, ordered >= ordered[:, :1] * min_ps[:, None])
    reference = probs.masked_fill(~keep, 0.0)
    calls = []
    original = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    fast = filter_probs(probs, -1, 1.0, min_ps)
    assert not calls and torch.equal(fast, reference)
    assert torch.equal(filter_probs(probs, -1, 1.0, 0.0), probs)
    filter_probs(probs, 5, 1.0, 0.0)
    assert calls  # top-k still sorts


def test_penalties_apply_in_one_order_in_every_process():
    """SGLang's orchestrator applies penalizers in the order of a set of classes, which
    follows their addresses: a request with presence and repetition penalties was penalized
    presence-then-repetition in one process and the other way in the next (seen: three
    processes, three orders). With the plugin, additive penalties come first and repetition
    last, as SGLang's accumulated buffers apply them, whatever order it is given."""
    from types import SimpleNamespace as N

    import sglang.srt.sampling.penaltylib as lib
    from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.sampling import install_penalty_order

    install_penalty_order(Runtime())  # this hook alone (register_all would patch the samplers the tests above read)
    params = N(frequency_penalty=0.0, presence_penalty=0.5, repetition_penalty=1.5, min_new_tokens=0,
               stop_token_ids=None)
    req = N(sampling_params=params, eos_token_ids=None, tokenizer=N(additional_stop_token_ids=None, eos_token_id=None))

    class Batch:
        reqs, device = [req], "cpu"

    batch = Batch()
    worst = [lib.BatchedRepetitionPenalizer, lib.BatchedPresencePenalizer, lib.BatchedMinNewTokensPenalizer,
             lib.BatchedFrequencyPenalizer]  # repetition first: the order a process's set may give
    orchestrator = BatchedPenalizerOrchestrator(8, batch, worst)
    assert [c.__name__ for c in orchestrator.penalizers] == [
        "BatchedFrequencyPenalizer", "BatchedMinNewTokensPenalizer", "BatchedPresencePenalizer",
        "BatchedRepetitionPenalizer"]
    orchestrator.cumulate_output_tokens(torch.tensor([3]))
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.2, 4.0, 5.0, 6.0, 7.0]])
    orchestrator.apply(logits)
    assert float(logits[0, 3]) == pytest.approx((0.2 - 0.5) * 1.5)  # presence subtracted, then the negative scaled


@pytest.mark.parametrize("rl_target", [None, "fsdp"])
@pytest.mark.parametrize("filtered", [False, True])
def test_engine_draw_equals_sglangs_sampler(monkeypatch, rl_target, filtered):
    """The verify's draw (sglang/sampling.py: engine_draw) is the token SGLang's own
    ``Sampler.forward`` picks from the same logits, seeds and positions, under deterministic
    inference: its softmax path, and under ``--rl-on-policy-target`` its bf16 log-softmax
    path for batches that filter nothing (filtering batches stay on the softmax path there)."""
    from types import SimpleNamespace as N

    import sglang.srt.layers.sampler as sampler_mod
    from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

    from sgl_vericache.sglang.sampling import engine_draw

    monkeypatch.setattr(sampler_mod, "get_exec", lambda: N(kernel=N(sampling_backend="pytorch")))
    sampler = sampler_mod.Sampler.__new__(sampler_mod.Sampler)
    torch.nn.Module.__init__(sampler)
    sampler.__dict__.update(
        tp_sync_group=None, cp_sync_group=None, rl_on_policy_target=rl_target, enable_deterministic=True,
        use_log_softmax_logprob=rl_target is not None, use_ascend_backend=False, sampling_mask_max_tokens=0,
        output_logprob_processor=OutputLogprobProcessor())
    batch, vocab, repeat = 3, 300, 500  # enough draws that bf16 rounding tips some (the paths share their noise)
    gen = torch.Generator().manual_seed(11)
    logits = 3 * torch.randn(batch * repeat, vocab, generator=gen)
    info = N(
        temperatures=torch.tensor([[0.7], [1.0], [1.3]]), sampling_seed=torch.tensor([5, 42, 9]),
        top_ks=torch.tensor([20 if filtered else vocab, vocab, vocab]),
        top_ps=torch.tensor([1.0, 0.9 if filtered else 1.0, 1.0]), min_ps=torch.zeros(3),
        need_top_k_sampling=filtered, need_top_p_sampling=filtered, need_min_p_sampling=False, max_top_k=None,
        is_all_greedy=False, has_custom_logit_processor=False, sampling_mask_batch_indices=None,
        sampling_support_logprobs_capture_indices=None, grammars=None)
    repeated = N(**{**info.__dict__, **{k: getattr(info, k).repeat_interleave(repeat, dim=0) for k in (
        "temperatures", "sampling_seed", "top_ks", "top_ps", "min_ps")}})
    positions = torch.arange(100, 100 + batch * repeat)
    theirs = sampler.forward(N(next_token_logits=logits.clone()), repeated, False, [], [], positions)
    ours = engine_draw(sampler, logits, info, repeat, positions)
    assert torch.equal(ours, theirs.long())
    if rl_target and not filtered:  # negative control: the softmax path picks other tokens somewhere
        sampler.use_log_softmax_logprob = False
        assert not torch.equal(engine_draw(sampler, logits, info, repeat, positions), ours)
