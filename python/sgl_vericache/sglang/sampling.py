"""Sampling: seeded draws on SGLang's pytorch sampler, and acceptance for VERICACHE
batches that sample.

Touches ``SamplingBatchInfo.from_schedule_batch`` (every request gets a seed on the
pytorch backend), ``BatchedPenalizerOrchestrator.__init__`` (penalties in one order),
``layers.sampler.top_k_top_p_min_p_sampling_from_probs_torch`` (a seeded row's draw depends
on its own row only), ``Sampler._sample_from_probs`` (called, to draw as
SGLang draws) and ``speculative.ngram_worker.eagle_sample`` (NGRAM's verify acceptance,
which on CPU always commits argmax; a VERICACHE batch that samples is accepted by
``spec.sampled_round.SampledRound`` instead).
"""

from __future__ import annotations

import functools
import random
import types

import torch

from sgl_vericache.sglang.penalties import mark_round, penalize_positions
from sgl_vericache.sglang.runtime import Runtime, patch
from sgl_vericache.spec.accept import filter_probs
from sgl_vericache.spec.plan import penalized
from sgl_vericache.spec.sampled_round import SampledRound, repeat_rows


def install_seeded_sampling(runtime: Runtime) -> None:
    """Make ``sampling_seed`` work with SGLang's pytorch sampling backend.

    SGLang draws position-keyed samples (a hash of seed, position and token id turned into
    Gumbel noise) only under ``--enable-deterministic-inference``, which refuses the CPU
    attention backend. Here every batch sampled by the pytorch backend carries a seed per
    request: the request's ``sampling_seed``, or a random seed drawn once per request. The
    draw for output position i then depends only on (seed, i) and the distribution, with
    speculation on or off, which is what lets VeriCache's seeded mode be token-identical.
    Requests without a seed are still sampled at random (their seed is random)."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    def make(original):
        def from_schedule_batch(cls, batch, vocab_size):
            info = original(cls, batch, vocab_size)
            if info.sampling_seed is None and get_exec().kernel.sampling_backend == "pytorch":
                seeds = []
                for req in batch.reqs:
                    seed = req.sampling_params.sampling_seed
                    if seed is None:
                        seed = getattr(req, "_vericache_seed", None)
                        if seed is None:
                            seed = req._vericache_seed = random.getrandbits(62)
                    seeds.append(seed)
                info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=info.temperatures.device)
            return info

        return from_schedule_batch

    patch(SamplingBatchInfo, "from_schedule_batch", runtime, make)
    install_seeded_per_row_sampling(runtime)


def install_seeded_per_row_sampling(runtime: Runtime) -> None:
    """Seeded top-k/top-p/min-p sampling whose draw depends only on the request's own row.

    SGLang's seeded torch sampler keys its Gumbel noise on the token id when no request in
    the batch filters, but on the *rank* in the sorted distribution when any request does;
    the same seeded request then draws different tokens depending on its batch-mates (and
    it refuses min-p). Here a seeded filtering batch zeroes each row's filtered-out tokens
    (``spec.accept.filter_probs``: a row without filters is left untouched) and draws with
    SGLang's own unfiltered seeded sampler, keyed on (seed, position, token id): the same
    distribution, and a row's draw no longer depends on the other rows."""
    from sglang.srt.layers import sampler as sampler_mod

    def make(original):
        def sample(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions, **kwargs):
            if sampling_seed is None:
                return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions,
                                **kwargs)
            min_ps = min_ps if need_min_p_sampling else 0.0
            if kwargs.get("return_filtered_probs"):  # SGLang's own path (sampling-mask capture), min-p applied first
                kept = filter_probs(probs, -1, 1.0, min_ps)
                return original(kept, top_ks, top_ps, min_ps, False, sampling_seed, positions, **kwargs)
            kept = filter_probs(probs, top_ks, top_ps, min_ps)
            return sampler_mod.sampling_from_probs_torch(kept, sampling_seed, positions)

        sample.__wrapped__ = original
        return sample

    patch(sampler_mod, "top_k_top_p_min_p_sampling_from_probs_torch", runtime, make)


def install_penalty_order(runtime: Runtime) -> None:
    """SGLang applies a batch's penalties in one of two ways: from buffers accumulated
    before the forward (the additive ones, frequency and presence, then the multiplicative
    one, repetition), or penalizer by penalizer in the order of the dict its orchestrator
    builds from a *set* of classes, whose iteration order follows the classes' addresses and
    so changes from process to process. A request with both an additive penalty and
    repetition was then penalized in a different order by different engines (or runs), and
    its ids differed, speculation on or off. Here the orchestrator keeps its penalizers in
    the buffers' order: additive ones first (by name), repetition last."""
    from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator

    def make(original):
        def __init__(self, vocab_size, batch, penalizers):
            ordered = sorted(penalizers, key=lambda c: (bool(getattr(c, "is_multiplicative", False)), c.__name__))
            original(self, vocab_size, batch, ordered)

        return __init__

    patch(BatchedPenalizerOrchestrator, "__init__", runtime, make)


def install_verify_sampler(runtime: Runtime) -> None:
    """NGRAM's verify calls ``eagle_sample``, which on CPU always commits argmax. For a
    VERICACHE batch that samples, acceptance goes to the worker's ``SampledRound`` instead;
    everything else (greedy batches, other algorithms) keeps SGLang's function. Rows
    deferred this round (staggered verifies) accept nothing; rows that drafted nothing
    (``Speculator.undrafted``) accept their root's token alone, exactly a decode step.
    Penalties are applied position by position (``penalties.penalize_positions``) in place
    of SGLang's relaxed step, and penalized rows are marked for ``penalties.catch_up``."""
    from sglang.srt.speculative import ngram_worker

    def make(original):
        def eagle_sample(verify_input, batch, logits_output, grammar_mask=None, *args, **kwargs):
            worker = eagle_sample.runtime.active_worker
            if worker is None:
                return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
            info, deferred = batch.sampling_info, set(worker.speculator.deferred)
            rows = [b for b, req in enumerate(batch.reqs) if b not in deferred and penalized(req)]
            candidates = verify_input.draft_token.reshape(len(batch.reqs), verify_input.draft_token_num)
            own_penalties = penalize_positions(info, logits_output.next_token_logits, candidates, rows)
            saved = info.acc_additive_penalties, info.acc_scaling_penalties
            if own_penalties:  # applied: SGLang's relaxed step must not run again
                info.acc_additive_penalties = info.acc_scaling_penalties = None
            try:
                sampled = worker.speculator.sampled
                if sampled is None or info.is_all_greedy:
                    out = original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
                else:
                    out = sampled_verify(sampled, worker.speculator.deferred, verify_input, batch, logits_output,
                                         grammar_mask)
            finally:
                info.acc_additive_penalties, info.acc_scaling_penalties = saved
            cap_acceptance(out, worker.speculator.deferred, worker.speculator.undrafted, batch.reqs)
            mark_round(batch.reqs, rows)
            return out

        return eagle_sample

    patch(ngram_worker, "eagle_sample", runtime, make)


def cap_acceptance(verified, deferred, undrafted, reqs) -> None:
    """In place on ``eagle_sample``'s (predict, accept_lens, accept_index): ``deferred`` rows
    accept nothing, ``undrafted`` rows (verified over copies of their root) the first token
    alone, every row's run ends at its first stop token (``stop_tokens``), and a row with
    stop strings or stop regexes accepts what makes SGLang's finish check end it where
    decoding would (``string_stop_cut``).

    Decoding stops at an EOS; a verify can accept the target's tokens past it, and SGLang's
    finish check then looks for stop strings in the whole run before it looks for stop
    tokens, so a stop string after the EOS would end the request there, with the tokens
    between (the output, its finish reason and a session's next prompt would differ)."""
    _, accept_lens, accept_index = verified
    if deferred:
        rows = torch.tensor(deferred, dtype=torch.int64, device=accept_lens.device)
        accept_lens[rows] = 0
        accept_index[rows] = -1
    if undrafted:
        rows = torch.tensor(undrafted, dtype=torch.int64, device=accept_lens.device)
        accept_lens[rows] = accept_lens[rows].clamp(max=1)
        accept_index[rows, 1:] = -1
    end_runs_where_decoding_ends(verified, reqs)


def stop_tokens(req) -> frozenset:
    """The token ids that end ``req`` as SGLang's ``Req._check_token_based_finish`` reads them
    (none under ``ignore_eos``)."""
    params = req.sampling_params
    if params.ignore_eos:
        return frozenset()
    ids = set(params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    tokenizer = getattr(req, "tokenizer", None)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return frozenset(ids)


def end_runs_where_decoding_ends(verified, reqs) -> None:
    """Cut each row's accepted run after its first stop token, then where its stop strings
    ask (``string_stop_cut``); one host copy of the round's accepted tokens, and only when
    some row accepted more than one."""
    predict, accept_lens, accept_index = verified
    lens = accept_lens.tolist()
    if max(lens, default=0) < 2:
        return
    runs = predict[accept_index.clamp(min=0).long()].tolist()  # [bs, width]: row b's run, then filler
    for b, (req, n) in enumerate(zip(reqs, lens)):
        if n < 2:
            continue
        keep = n
        stops = stop_tokens(req)
        for j in range(n - 1):
            if runs[b][j] in stops:
                keep = j + 1
                break
        if keep > 1:
            keep = string_stop_cut(req, runs[b][:keep])
        if keep < n:
            accept_lens[b] = keep
            accept_index[b, keep:] = -1


def string_stop_cut(req, run) -> int:
    """How much of ``run`` (tokens a verify accepted after ``req.output_ids``) to accept so that
    SGLang's stop-string / stop-regex check, run once over the accepted tokens, ends the
    request where decoding them one step at a time would, with the same length and match.

    A decode step looks for stop strings in the text of the last ``stop_str_max_len + 1``
    tokens; SGLang's check of a run of n looks in the last ``stop_str_max_len + n``, so it can
    find a stop string that spans more tokens than it does on its own (a one-token stop word
    produced as three pieces), which no decode step sees, or an earlier match than decoding's
    that ends the request at another length. Here each step is checked as decoding checks it,
    with SGLang's own code (``_string_finish``), and the run is cut: after the step decoding
    stops at if the run's check then agrees, else before the first token the run's check
    would stop at too early. A stop string found by a decode step lies in the run's text as
    well (a tokenizer alters a window's first characters only: a leading space, a partial
    UTF-8 character), so a run whose check finds none needs no step-by-step one (nor a lone
    stop regex whose windows all start at the output's first token); stop regexes
    can anchor at a window's start, and a step's window can end inside a character (text
    ending in U+FFFD that the run's longer window completes), so stop regexes and stop
    strings holding U+FFFD are always checked step by step. Tokens past ``max_new_tokens``
    are not accepted: decoding never makes them. The checks read only the output's last
    tokens the longest window reaches; a run holding ids outside the vocabulary is left to
    SGLang (it ends such a request before decoding them)."""
    params = req.sampling_params
    regexes = getattr(params, "stop_regex_strs", None)
    if not (params.stop_strs or regexes) or getattr(req, "tokenizer", None) is None:
        return len(run)
    vocab = getattr(req, "vocab_size", None)
    if any(t < 0 or (vocab is not None and t >= vocab) for t in run):
        return len(run)
    cap = params.max_new_tokens
    n = len(run) if cap is None else max(1, min(len(run), cap - len(req.output_ids)))
    if n < 2:
        return n
    reach = max(params.stop_str_max_len, getattr(params, "stop_regex_max_len", 0) or 0) + 1  # a step's window
    if not params.stop_strs and len(regexes) == 1 and len(req.output_ids) + n <= reach:
        # every window starts at the output's first token (a regex without a length bound: all
        # of them): the run's check tries each step's whole text itself, as decoding would
        return n
    prior = list(req.output_ids[-reach:])  # what the longest window reads before the run (lengths stay relative)
    whole = _string_finish(req, prior + run[:n], n)
    if whole is None and not regexes and not any("\ufffd" in stop for stop in params.stop_strs):
        return n
    stop_at, step = n, None
    for j in range(n):
        step = _string_finish(req, prior + run[: j + 1], 1)
        if step is not None:
            stop_at = j
            break
    if step is not None and _string_finish(req, prior + run[: stop_at + 1], stop_at + 1) == step:
        return stop_at + 1
    if step is None and whole is None:
        return n
    for k in range(min(stop_at, n - 1), 0, -1):  # the longest prefix the run's check lets through
        if _string_finish(req, prior + run[:k], k) is None:
            return k
    return 1


def _string_finish(req, output_ids, new):
    """(finished_len, reason, what matched) of SGLang's own ``Req._check_str_based_finish``
    (and the ``max_new_tokens`` cap after it) for ``req`` had its output been ``output_ids``,
    the last ``new`` of them accepted in one step; None where it does not finish."""
    probe = _finish_probe()()
    probe.__dict__.update(
        rid=req.rid, sampling_params=req.sampling_params, tokenizer=req.tokenizer, output_ids=output_ids,
        decoded_text=getattr(req, "decoded_text", ""), finished_reason=None, finished_len=None)
    if not probe._check_str_based_finish(new):
        return None
    probe._cap_finished_len_at_max_new_tokens()
    reason = probe.finished_reason
    return probe.finished_len, type(reason).__name__, getattr(reason, "matched", None)


@functools.cache
def _finish_probe():
    """A class that runs ``Req``'s stop-string check on an output of one's choosing (its
    methods are SGLang's own, so the check follows the installed version's rules)."""
    from sglang.srt.managers.schedule_batch import Req

    names = ("tail_str", "_stop_match_tail_len", "_locate_str_stop_finished_len", "_check_str_based_finish",
             "_cap_finished_len_at_max_new_tokens")
    return type("FinishProbe", (), {name: Req.__dict__[name] for name in names})


def engine_draw(sampler, logits, params, repeat, positions):
    """The tokens SGLang's own sampler would draw from ``logits`` (one row per position;
    each request's parameters repeated ``repeat`` times), through its own code: temperature,
    softmax, then its pytorch-backend top-k/top-p/min-p sampling with the batch's seeds
    at ``positions``. Equal logits give equal tokens to a non-speculative decode step.

    Under ``--rl-on-policy-target`` (which turns deterministic inference on) SGLang draws
    rows that filter nothing from a bf16 log-softmax instead (its trainer-matching path):
    that path is taken here too, by the same rule."""
    from sglang.srt.layers import sampler as sampler_mod

    temperatures = repeat_rows(params.temperatures, repeat)
    rows = types.SimpleNamespace(
        sampling_mask_batch_indices=None,
        sampling_seed=repeat_rows(params.sampling_seed, repeat),
        top_ks=repeat_rows(params.top_ks, repeat),
        top_ps=repeat_rows(params.top_ps, repeat),
        min_ps=repeat_rows(params.min_ps, repeat),
        need_min_p_sampling=params.need_min_p_sampling,
        max_top_k=getattr(params, "max_top_k", None),
    )
    simple = not (params.need_top_p_sampling or params.need_top_k_sampling or params.need_min_p_sampling)
    if getattr(sampler, "use_log_softmax_logprob", False) and sampler.enable_deterministic and simple:
        scaled = logits.bfloat16().div(temperatures).bfloat16()  # Sampler.forward's RL on-policy operands
        return sampler._sample_from_logprobs(torch.log_softmax(scaled, dim=-1), rows, positions).to(torch.int64)
    x = logits.clone()
    x.div_(temperatures)
    probs = torch.softmax(x, dim=-1) if sampler.enable_deterministic else sampler_mod.sampler_softmax(x)
    tokens, _ = sampler._sample_from_probs(probs, rows, positions, simple)
    return tokens.to(torch.int64)


def seeded_rows(reqs) -> list[bool]:
    """Rows speculation off draws from a seed that is the same with speculation on: a
    request's ``sampling_seed``, and under ``--enable-deterministic-inference`` every row
    (SGLang seeds the others with 42). Their rounds are matched draw for draw; the rest (the
    plugin's random seed a request) are accepted by rejection sampling."""
    from sglang.srt.runtime_context import get_exec

    if get_exec().deterministic.enable_deterministic_inference:
        return [True] * len(reqs)
    return [req.sampling_params.sampling_seed is not None for req in reqs]


def make_sampled_round(sampler, batch, rows, rng) -> SampledRound:
    """The drafting state of a round of ``batch`` (a ScheduleBatch that samples) whose rows
    ``rows`` draft."""
    seeded = seeded_rows(batch.reqs)
    draw = lambda *args: engine_draw(sampler, *args)  # noqa: E731
    return SampledRound(batch.sampling_info, seeded, rows, draw, rng)


def sampled_verify(sampled: SampledRound, deferred, verify_input, batch, logits_output, grammar_mask):
    """Acceptance for a VERICACHE verify pass over a sampling batch; returns what SGLang's
    ``eagle_sample`` returns: (predict [bs*n] int32, accept_lens [bs] int32 incl. the bonus,
    accept_index [bs, n] int32 rows into the verify pass, -1 past the accepted ones)."""
    info = batch.sampling_info
    bs, n = len(batch.reqs), verify_input.draft_token_num
    logits = logits_output.next_token_logits
    # The same relaxed penalties and logit bias SGLang's verify applies, and the grammar.
    if info.acc_additive_penalties is not None:
        logits.add_(torch.repeat_interleave(info.acc_additive_penalties, n, dim=0))
    if info.acc_scaling_penalties is not None:
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

        apply_scaling_penalties(logits, torch.repeat_interleave(info.acc_scaling_penalties, n, dim=0))
    if info.logit_bias is not None:
        logits.add_(torch.repeat_interleave(info.logit_bias, n, dim=0))
    if grammar_mask is not None:
        grammar_mask.apply(logits)

    candidates = verify_input.draft_token.reshape(bs, n).to(torch.int64)
    positions = verify_input.positions.reshape(bs, n).to(torch.int64)
    num_acc, tokens = sampled.accept(candidates, logits.reshape(bs, n, -1), positions, skip=deferred)
    num_acc, tokens = num_acc.cpu(), tokens.cpu()  # the result's index tensors are laid out here

    skipped = set(deferred)
    predict = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    for b in range(bs):
        if b in skipped:  # eagle_sample's wrapper gives it accept length 0
            continue
        k = int(num_acc[b])
        rows = torch.arange(b * n, b * n + k + 1)
        accept_index[b, : k + 1] = rows.to(torch.int32)
        predict[rows] = tokens[b, : k + 1].to(torch.int32)
    accept_lens = (num_acc + 1).to(torch.int32)
    device = logits.device
    out = predict.to(device), accept_lens.to(device), accept_index.to(device)
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp_group = get_tp_group()
    if tp_group.world_size > 1:  # every tensor-parallel rank takes the first rank's acceptance, as
        for t in out:  # SGLang's own sampled verify does (ranks that accepted apart would diverge)
            tp_group.broadcast(t, src=0)
    return out
