"""SampledRound (spec/sampled_round.py) in rounds whose rows draft different lengths: a
rejection row shorter than the round's longest is verified over padding (its last draft
repeated), a fixed proposal, and must emit exactly the target's distribution. Checked
statistically, with the negative control the old rule fails. CPU, a few seconds."""

import pytest
import torch
from scipy import stats
from types import SimpleNamespace

from sgl_vericache.spec.round_batch import pad_drafts
from sgl_vericache.spec.sampled_round import SampledRound

V, BS, ROUNDS = 2, 2, 3000
TARGET = torch.tensor([0.7, 0.3])  # the target's distribution at every position
ALPHA = 1e-3


def _params():
    return SimpleNamespace(temperatures=torch.ones(BS, 1), top_ks=torch.full((BS,), V), top_ps=torch.ones(BS),
                           min_ps=torch.zeros(BS), sampling_seed=None, need_top_p_sampling=False,
                           need_top_k_sampling=False, need_min_p_sampling=False)


def _second_tokens(own_lens_known: bool, seed: int = 0) -> torch.Tensor:
    """Row 0 drafts 1 token, row 1 three, in one round. Row 0's first draft is token 0 almost
    surely; the steps it drafted past its own length put all their mass on token 1 (thrown
    away: its padding repeats token 0). Returns row 0's second emitted token, in the rounds
    that accepted its draft."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 3]
    logits_steps = [torch.tensor([[30.0, 0.0]] * BS), torch.tensor([[0.0, 30.0]] * BS),
                    torch.tensor([[0.0, 30.0]] * BS)]
    target_logits = TARGET.log().expand(BS, 4, V).clone()
    out = []
    for _ in range(ROUNDS):
        sampled = SampledRound(_params(), [False, False], rows=[0, 1], engine_draw=None, rng=gen)
        drafts = torch.stack([sampled.draw(l, torch.zeros(BS, dtype=torch.long)) for l in logits_steps], 1)
        if own_lens_known:
            sampled.own_lens = lens  # as the round sets it
        padded = torch.from_numpy(pad_drafts(drafts.numpy(), lens, 3))
        candidates = torch.cat([torch.zeros(BS, 1, dtype=torch.long), padded], 1)
        num, tokens = sampled.accept(candidates, target_logits, torch.zeros(BS, 4, dtype=torch.long))
        if int(num[0]) >= 1:
            out.append(int(tokens[0, 1]))
    return torch.tensor(out)


def _fit(tokens):
    counts = torch.bincount(tokens, minlength=V).double()
    return stats.chisquare(counts.numpy(), (counts.sum() * TARGET.double()).numpy()).pvalue


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_row_shorter_than_the_round_emits_the_target_distribution_past_its_drafts():
    tokens = _second_tokens(own_lens_known=True)
    assert len(tokens) > ROUNDS * 0.6  # its draft (token 0, p = 0.7) was accepted that often
    assert _fit(tokens) > ALPHA, torch.bincount(tokens, minlength=V).tolist()


def test_padding_accepted_against_a_discarded_steps_q_fails_the_same_check():
    """The old rule: the q the row recorded at a step past its own length, whose token the
    padding replaced. Its second token came out 0 every time (target: 70%)."""
    tokens = _second_tokens(own_lens_known=False)
    assert _fit(tokens) < ALPHA and bool((tokens == 0).all())
