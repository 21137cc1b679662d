"""Penalties position by position (``sglang.penalties``), against SGLang's own penalizers
fed one token at a time, as decoding feeds them: every verified position's penalized
logits bit-equal to a decode step's at that point, and the state after a round equal to
the state after decoding its tokens."""

from __future__ import annotations

from types import SimpleNamespace as N

import pytest
import torch

VOCAB, WIDTH = 40, 6


class _Batch:
    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"


def _orchestrator(reqs):
    from sglang.srt.sampling import penaltylib

    batch = _Batch(reqs)
    kinds = [penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
             penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer]  # install_penalty_order's order
    orch = penaltylib.BatchedPenalizerOrchestrator(VOCAB, batch, kinds)
    orch._test_batch = batch  # the orchestrator holds its batch weakly
    return orch


def _reqs():
    tok = N(eos_token_id=1, additional_stop_token_ids=None)
    rows = [
        dict(frequency_penalty=0.7, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0),
        dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.3, min_new_tokens=0),
        dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0),  # none
        dict(frequency_penalty=0.45, presence_penalty=0.6, repetition_penalty=1.15, min_new_tokens=2),  # all, min met
        dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=50),  # held back
        # min_new_tokens alone, reached mid-round (test_each_verified_position...: 7 tokens before it)
        dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=10),
    ]
    return [N(sampling_params=N(stop_token_ids=None, **r), eos_token_ids={1}, tokenizer=tok, output_ids=[],
              retraction_count=0) for r in rows]


def _accumulated(orch):
    """update_penalties' tensors: what SGLang's verify and decode add and scale by."""
    add = torch.zeros((len(orch.reqs()), VOCAB), dtype=torch.float32)
    orch.accumulate_additive_penalties(add)
    return add, orch.accumulate_scaling_penalties()


def _decode_logits(raw_row, orch, b):
    """Row b's logits as a decode step penalizes them under ``orch``'s state: SGLang without
    the overlap scheduler calls ``orchestrator.apply`` on the batch's logits (penalizer by
    penalizer, in place)."""
    x = torch.zeros(len(orch.reqs()), VOCAB)
    x[b] = raw_row
    orch.apply(x)
    return x[b]


def _relaxed(raw, add, scale, n):
    """SGLang's verify (eagle_sample): the round's starting sums, for every position."""
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    out = raw.clone()
    out.add_(torch.repeat_interleave(add, n, dim=0))
    apply_scaling_penalties(out, torch.repeat_interleave(scale, n, dim=0))
    return out


def _feed(orch, reqs, tokens):
    for t in tokens:  # one token for every row a step, as decode's cumulate
        orch.cumulate_output_tokens(torch.tensor(t, dtype=torch.int64))
        for req, tok in zip(reqs, t):
            req.output_ids.append(tok)


def test_each_verified_position_is_penalized_as_a_decode_step_there():
    """A round's drafts repeat tokens of the history and of each other (so frequency counts
    pass 1 and presence / repetition switch on mid-round), and one row's min_new_tokens is
    reached mid-round (its stop token held back at positions 0-2, not after). Position i of
    every penalized row equals, bit for bit, SGLang's decode penalties after the history
    and drafts 1..i; the relaxed step SGLang applies (the round's start for every position)
    differs."""
    from sgl_vericache.sglang.penalties import penalize_positions

    gen = torch.Generator().manual_seed(3)
    history = torch.randint(2, VOCAB, (7, 6), generator=gen).tolist()
    history[3] = [9, 9, 9, 9, 9, 9]
    candidates = torch.tensor([
        [history[-1][0], 9, 12, 9, 9, 30],
        [history[-1][1], 12, 12, 5, 9, 5],
        [history[-1][2], 3, 4, 5, 6, 7],
        [history[-1][3], 9, 30, 30, 12, 9],
        [history[-1][4], 8, 8, 8, 8, 8],
        [history[-1][5], 1, 6, 1, 7, 1],  # eos (1) drafted across min_new_tokens' end
    ])
    raw = 4 * torch.randn(len(candidates) * WIDTH, VOCAB, generator=gen)
    raw[:, 9] = raw[:, 9].abs()  # positive and negative logits take the two sides of the scaling
    raw[:, 12] = -raw[:, 12].abs()
    raw[:, 1] = raw.max() + 1  # eos the likeliest token: only min_new_tokens keeps it back
    reqs = _reqs()
    start = _orchestrator(reqs)
    _feed(start, reqs, history)
    add, scale = _accumulated(start)
    info = N(penalizer_orchestrator=start, acc_additive_penalties=add, acc_scaling_penalties=scale)
    rows = [0, 1, 3, 4, 5]  # penalized; row 2 has no penalties
    ours = raw.clone()
    assert penalize_positions(info, ours, candidates, rows)
    relaxed = _relaxed(raw, add, scale, WIDTH)
    differs = 0
    for i in range(WIDTH):
        ref_reqs = _reqs()
        ref = _orchestrator(ref_reqs)
        _feed(ref, ref_reqs, history + [candidates[:, j].tolist() for j in range(1, i + 1)])
        for b in range(len(candidates)):
            want = _decode_logits(raw[b * WIDTH + i], ref, b)
            assert torch.equal(ours[b * WIDTH + i], want), (b, i)
            differs += not torch.equal(relaxed[b * WIDTH + i], want)
    assert differs >= 10  # negative control: SGLang's relaxed step is not a decode step's
    held = [torch.isinf(ours[5 * WIDTH + i, 1]).item() for i in range(WIDTH)]
    assert held == [True, True, True, False, False, False]  # min_new_tokens 10 after 7 tokens
    assert torch.isinf(relaxed[5 * WIDTH + 3 : 6 * WIDTH, 1]).all()  # relaxed: held all round
    # row 3 has a frequency and a presence penalty: even at position 0 (the round's starting
    # state) SGLang's sum of the two differs from decoding's one after the other
    assert not torch.equal(relaxed[3 * WIDTH], ours[3 * WIDTH])


def test_a_plain_iteration_penalizes_as_decoding():
    """An iteration VERICACHE runs as a plain decode step forwards SGLang's copy of the
    sampling state, which carries the sum of the additive penalties; the hook applies the
    penalizers one by one instead, as decoding does (bit-equal; the sum is not)."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    from sgl_vericache.sglang.penalties import install_penalties_per_position
    from sgl_vericache.sglang.runtime import Runtime

    install_penalties_per_position(Runtime())
    gen = torch.Generator().manual_seed(4)
    reqs = _reqs()
    orch = _orchestrator(reqs)
    _feed(orch, reqs, torch.randint(2, VOCAB, (9, len(reqs)), generator=gen).tolist())
    add, scale = _accumulated(orch)
    info = SamplingBatchInfo.__new__(SamplingBatchInfo)
    info.__dict__.update(penalizer_orchestrator=None, acc_additive_penalties=add, acc_scaling_penalties=scale)
    info.__dict__["vericache_penalizers"] = orch  # what the copy_for_forward hook leaves on the copy
    raw = 4 * torch.randn(len(reqs), VOCAB, generator=gen)
    ours = raw.clone()
    info._apply_pre_grammar_logits_transforms(ours)
    want = raw.clone()
    orch.apply(want)
    assert torch.equal(ours, want)
    assert not torch.equal(_relaxed(raw, add, scale, 1), want)  # the copy's sums: what SGLang would do


def test_a_batch_without_penalties_is_left_to_sglang():
    from sgl_vericache.sglang.penalties import penalize_positions

    reqs = [r for r in _reqs() if r.sampling_params.repetition_penalty == 1.0 and not r.sampling_params.frequency_penalty
            and not r.sampling_params.min_new_tokens]
    orch = _orchestrator(reqs)
    logits = torch.randn(WIDTH, VOCAB)
    before = logits.clone()
    info = N(penalizer_orchestrator=None, acc_additive_penalties=None, acc_scaling_penalties=None)
    info.__dict__["vericache_penalizers"] = orch  # a forward copy's reference
    assert not penalize_positions(info, logits, torch.zeros((1, WIDTH), dtype=torch.int64), [0])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("retracted", [False, True])
def test_the_state_after_a_round_is_decodings(retracted):
    """After a round that accepted several tokens, SGLang adds the last one (its cumulate)
    and catch_up the rest: every penalizer's state equals the state after decoding them one
    at a time (each row against a one-row orchestrator fed its own tokens). A request
    retracted since its round restarts from zero (SGLang's rule, speculation on or off), so
    catch_up adds nothing for it."""
    from sgl_vericache.sglang.penalties import catch_up, mark_round

    gen = torch.Generator().manual_seed(5)
    history = torch.randint(2, VOCAB, (4, 6), generator=gen).tolist()
    runs = [[9, 9, 12, 9], [12], [3, 4], [30, 9, 30], [8], [5, 6, 7]]  # accepted this round, per row
    reqs = _reqs()
    orch = _orchestrator(reqs)
    _feed(orch, reqs, history)
    mark_round(reqs, range(len(reqs)))
    for req, run in zip(reqs, runs):
        req.output_ids.extend(run)
    if retracted:
        reqs[0].retraction_count += 1
    orch.cumulate_output_tokens(torch.tensor([r[-1] for r in runs]))  # SGLang's own, before the next forward
    catch_up(orch, reqs)
    names = ("cumulated_frequency_penalties", "cumulated_presence_penalties", "cumulated_repetition_penalties",
             "len_output_tokens")
    compared = 0
    for b, run in enumerate(runs):
        ref_req = _reqs()[b]
        ref = _orchestrator([ref_req])
        decoded = [row[b] for row in history] + (run[-1:] if retracted and b == 0 else run)
        _feed(ref, [ref_req], [[t] for t in decoded])
        for cls, pen in ref.penalizers.items():
            if not pen.is_prepared():
                continue
            for name in names:
                if hasattr(pen, name):
                    assert torch.equal(getattr(orch.penalizers[cls], name)[b], getattr(pen, name)[0]), (b, name)
                    compared += 1
    assert compared == 8  # row 0 frequency, 1 repetition, 3 all four, 4 and 5 min_new_tokens
    if not retracted:  # negative control: SGLang's own cumulate alone (its relaxed rule) is not decoding's
        reqs2 = _reqs()
        lone = _orchestrator(reqs2)
        _feed(lone, reqs2, history)
        lone.cumulate_output_tokens(torch.tensor([r[-1] for r in runs]))
        pens = list(lone.penalizers.values())
        assert not all(torch.equal(getattr(p, n), getattr(q, n)) for p, q in zip(pens, orch.penalizers.values())
                       if p.is_prepared() for n in names if hasattr(p, n))


def test_draft_steps_are_steered_by_the_penalties_as_decoding():
    """The draft side (proposals only): starting from the round's accumulated tensors, each
    drafted token counted for frequency and repetition gives, for rows with those penalties,
    a decode step's penalized logits after the same tokens; with presence too (tokens new to
    the history among them), the same within an ulp; a min_new_tokens reached mid-round
    holds the stop tokens back at the steps before it only."""
    from sgl_vericache.sglang.penalties import DraftPenalty

    gen = torch.Generator().manual_seed(8)
    history = torch.randint(2, VOCAB, (5, 6), generator=gen).tolist()  # row 5: min_new_tokens 10, 5 out
    drafted = [[9, 9, 12, 9, 3], [12, 12, 5, 30, 30], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0],
               [4, 5, 6, 7, 8]]
    reqs = _reqs()
    start = _orchestrator(reqs)
    _feed(start, reqs, history)
    add, scale = _accumulated(start)
    drafted[3] = [9, 31, 9, 31, 5]  # frequency, presence and repetition: tokens new to the history too
    info = N(acc_additive_penalties=add, acc_scaling_penalties=scale, temperatures=torch.ones(6, 1),
             penalizer_orchestrator=start)
    penalty = DraftPenalty.of(info, [0, 1, 3, 5], reqs)
    for step in range(len(drafted[0]) + 1):
        raw = 5 * torch.randn(4, VOCAB, generator=gen)
        ref_reqs = _reqs()
        ref = _orchestrator(ref_reqs)
        _feed(ref, ref_reqs, history + [[row[j] for row in drafted] for j in range(step)])
        got = penalty.apply(raw)
        for r, b in enumerate((0, 1)):
            assert torch.equal(got[r], _decode_logits(raw[r], ref, b)), (step, b)
        # row 3: the additive penalties summed (SGLang's verify's way): within an ulp of decoding's
        want = _decode_logits(raw[2], ref, 3)
        assert torch.allclose(got[2], want, rtol=1e-6, atol=1e-6) and got[2].argmax() == want.argmax(), step
        assert torch.equal(got[3], _decode_logits(raw[3], ref, 5)), step  # held at steps 0-4 only
        assert torch.isinf(got[3, 1]) == (step < 5), step
        if step < len(drafted[0]):
            penalty.count(torch.tensor([drafted[0][step], drafted[1][step], drafted[3][step], drafted[5][step]]))
    assert DraftPenalty.of(N(acc_additive_penalties=None, acc_scaling_penalties=None), [0], reqs) is None
