"""Frequency, presence and repetition penalties and min_new_tokens, position by position,
so penalized requests draft.

SGLang keeps a batch's penalty state in its ``BatchedPenalizerOrchestrator`` and adds a
request's last output token to it once an iteration, before the forward
(``ScheduleBatch.cumulate_penalty_output_tokens``); a speculative verify applies the state
of the round's start to every position of the round (``eagle_sample``: "a relaxed version
of penalties"). Decoding one token at a time, the token at position i is drawn under the
state that holds the drafts before it too. Three hooks make a VERICACHE round penalize as
decoding does, so a penalized request can draft instead of emitting one token an iteration:

- ``SamplingBatchInfo.copy_for_forward``: the forward's copy of a batch's sampling state
  keeps a reference to the orchestrator it was taken from (SGLang drops it), so the verify
  can read each penalizer's own state; and ``_apply_pre_grammar_logits_transforms`` then
  applies the penalizers one by one (``orchestrator.apply``) in an iteration VERICACHE runs
  as a plain decode step, as decoding does, instead of the copy's sum of the additive
  penalties (under speculation SGLang always forwards a copy; the sum differs from
  decoding's order by an ulp where a request has a frequency and a presence penalty);
- ``penalize_positions`` (called by the verify hook in ``sampling``): every position's
  logits get the state decoding would have there, the round's start plus the drafts before
  the position, computed with the penalizers' own operations in their order (so the values
  are bit-equal to a decode step's), and SGLang's relaxed step is skipped;
- ``ScheduleBatch.cumulate_penalty_output_tokens``: before the next forward, the tokens a
  round accepted besides its last (which SGLang adds itself) are added as well, each as
  decoding adds it.

The penalizers are SGLang 0.5.23's four (frequency, min_new_tokens, presence, repetition);
another one in a batch stops the verify with an error naming it rather than penalizing
some other way than decoding.
"""

from __future__ import annotations

import torch

from sgl_vericache.sglang.runtime import Runtime, patch

_ORCHESTRATOR = "vericache_penalizers"  # the forward copy's reference to its batch's orchestrator
_MARK = "vericache_penalty_mark"  # (output length before the round, retraction count) of a penalized row


def install_penalties_per_position(runtime: Runtime) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    def make_copy(original):
        def copy_for_forward(self):
            copy = original(self)
            if self.penalizer_orchestrator is not None:
                copy.__dict__[_ORCHESTRATOR] = self.penalizer_orchestrator
            return copy

        return copy_for_forward

    def make_cumulate(original):
        def cumulate_penalty_output_tokens(self):
            original(self)
            catch_up(self.sampling_info.penalizer_orchestrator, self.reqs)

        return cumulate_penalty_output_tokens

    def make_transforms(original):
        def _apply_pre_grammar_logits_transforms(self, logits):
            orch = self.__dict__.get(_ORCHESTRATOR)
            if orch is None or not orch.is_required or self.acc_additive_penalties is None:
                return original(self, logits)
            orch.apply(logits)  # decoding's own order, not the forward copy's sum of the additive ones

        return _apply_pre_grammar_logits_transforms

    patch(SamplingBatchInfo, "copy_for_forward", runtime, make_copy)
    patch(SamplingBatchInfo, "_apply_pre_grammar_logits_transforms", runtime, make_transforms)
    patch(ScheduleBatch, "cumulate_penalty_output_tokens", runtime, make_cumulate)


def orchestrator_of(info):
    """The penalizer orchestrator behind a batch's sampling state (the scheduler's own, or
    the one a forward copy was taken from); None where nothing is penalized."""
    orch = info.penalizer_orchestrator or info.__dict__.get(_ORCHESTRATOR)
    return orch if orch is not None and orch.is_required else None


def _penalizers(orch):
    """The prepared penalizers by kind, in the order the orchestrator applies them."""
    out = []
    for cls, pen in orch.penalizers.items():
        if not pen.is_prepared():
            continue
        kind = {"BatchedFrequencyPenalizer": "frequency", "BatchedPresencePenalizer": "presence",
                "BatchedRepetitionPenalizer": "repetition", "BatchedMinNewTokensPenalizer": "min_new_tokens"}.get(
                    cls.__name__)
        if kind is None:
            raise RuntimeError(f"VeriCache: penalizer {cls.__name__} is not one VeriCache applies per position; "
                               "known: frequency, presence, repetition, min_new_tokens (SGLang 0.5.23)")
        out.append((kind, pen))
    return out


def mark_round(reqs, rows) -> None:
    """Before a verify's tokens are appended: remember where the round's run starts in each
    penalized row's output, for ``catch_up`` before the next forward."""
    for b in rows:
        req = reqs[b]
        req.__dict__[_MARK] = (len(req.output_ids), req.retraction_count)


def catch_up(orch, reqs) -> None:
    """Add to the penalty state the tokens each marked row's last round accepted besides its
    last one (SGLang has just added that one), as decoding would have added each: a
    frequency penalty once per token (sums of one row's penalty, so in any order the same
    float), presence and repetition set, min_new_tokens' count up by one a token. A row
    retracted since its round (its state restarted) or never marked adds nothing."""
    extra = []
    for b, req in enumerate(reqs):
        mark = req.__dict__.pop(_MARK, None)
        if mark is None or mark[1] != req.retraction_count:
            continue
        tokens = list(req.output_ids[mark[0]:-1])
        if tokens:
            extra.append((b, tokens))
    if not extra or orch is None or not orch.is_required:
        return
    pens = _penalizers(orch)
    for b, tokens in extra:
        for kind, pen in pens:
            if kind == "min_new_tokens":
                pen.len_output_tokens[b] += len(tokens)
                continue
            if kind == "frequency":
                state, value = pen.cumulated_frequency_penalties, pen.frequency_penalties
            elif kind == "presence":
                state, value = pen.cumulated_presence_penalties, pen.presence_penalties
            else:
                state, value = pen.cumulated_repetition_penalties, pen.repetition_penalties
            index = torch.tensor([tokens], dtype=torch.int64, device=state.device)
            src = value[b : b + 1].expand(1, len(tokens))
            if kind == "frequency":
                state[b : b + 1].scatter_add_(1, index, src)
            else:
                state[b : b + 1].scatter_(1, index, src)


def penalize_positions(info, logits: torch.Tensor, candidates: torch.Tensor, rows) -> bool:
    """Penalize a verify's logits ([bs * n, V], in place) as decoding would at each position:
    row b's position i under the round's starting state plus its drafts 1..i
    (``candidates`` [bs, n]: the root, then the drafts), for the rows in ``rows``; every
    other row under the round's starting state, except min_new_tokens' count, which is
    the start's plus i at position i in every row (a row that drafted nothing accepts its
    position 0 alone). As decoding does (SGLang without the
    overlap scheduler: ``penalizer_orchestrator.apply``), penalizer by penalizer in place,
    not SGLang's verify's sum of the additive penalties (which differs by an ulp where a
    request has a frequency and a presence penalty). Returns False (nothing done) where the
    batch has no penalties; otherwise the caller must not apply SGLang's step again."""
    orch = orchestrator_of(info)
    if orch is None:
        return False
    n = candidates.shape[1]
    pens = _penalizers(orch)
    fix = _fix_ups(candidates, rows)  # positions whose state differs from the round's start
    raw = logits[fix["row"] * n + fix["pos"], fix["token"]] if fix is not None else None
    _apply_in_order(pens, logits, n)
    if fix is None:
        return True
    b, tok, count = fix["row"], fix["token"], fix["count"]
    value = raw
    for kind, pen in pens:  # each penalizer's own operation, in the orchestrator's order
        if kind == "frequency":
            state, step = pen.cumulated_frequency_penalties[b, tok], pen.frequency_penalties[b, 0]
            for k in range(fix["most"]):
                state = torch.where(count > k, state + step, state)
            value = value - state
        elif kind == "presence":
            value = value - torch.where(count > 0, pen.presence_penalties[b, 0], pen.cumulated_presence_penalties[b, tok])
        elif kind == "min_new_tokens":
            value = value + torch.where(_held(pen, b, fix["pos"]), pen.stop_token_penalties[b, tok], 0.0)
        else:
            rep = torch.where(count > 0, pen.repetition_penalties[b, 0], pen.cumulated_repetition_penalties[b, tok])
            value = value[None, :].clone()
            _scale(value, rep[None, :])
            value = value[0]
    logits[b * n + fix["pos"], tok] = value
    return True


def _scale(logits, scaling) -> None:
    """SGLang's repetition scaling, in place (its own compiled function, as decoding runs it)."""
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    apply_scaling_penalties(logits, scaling)


def _apply_in_order(pens, logits: torch.Tensor, n: int) -> None:
    """Each penalizer's own ``_apply`` on logits laid out n rows a request: its state repeated."""
    rep = lambda state: torch.repeat_interleave(state, n, dim=0)  # noqa: E731
    for kind, pen in pens:
        if kind == "frequency":
            logits.sub_(rep(pen.cumulated_frequency_penalties))
        elif kind == "presence":
            logits.sub_(rep(pen.cumulated_presence_penalties))
        elif kind == "min_new_tokens":  # its count at position i is the round's start plus i
            rows = torch.arange(pen.min_new_tokens.shape[0], device=logits.device)
            held = _held(pen, rows[:, None], torch.arange(n, device=logits.device)[None, :])
            logits.add_(torch.where(held.reshape(-1, 1), rep(pen.stop_token_penalties), 0.0))
        else:
            _scale(logits, rep(pen.cumulated_repetition_penalties))


def _held(pen, b, pos):
    """Whether min_new_tokens still holds row b's stop tokens back at position ``pos`` of a
    round: decoding's count there is the round's start plus the drafts before it."""
    return pen.len_output_tokens[b, 0] + pos < pen.min_new_tokens[b, 0]


def _fix_ups(candidates: torch.Tensor, rows):
    """For each of ``rows`` and each position i >= 1, every distinct draft among its drafts
    1..i with how often it occurs there: {row, pos, token, count} as device tensors (and
    ``most``, the largest count, on the host), or None."""
    if not rows or candidates.shape[1] < 2:
        return None
    host = candidates[list(rows)].tolist()
    row, pos, token, count = [], [], [], []
    for b, run in zip(rows, host):
        seen: dict[int, int] = {}
        for i in range(1, len(run)):
            seen[run[i]] = seen.get(run[i], 0) + 1
            for t, c in seen.items():
                row.append(b)
                pos.append(i)
                token.append(t)
                count.append(c)
    device = candidates.device
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return {"row": as_tensor(row), "pos": as_tensor(pos), "token": as_tensor(token), "count": as_tensor(count),
            "most": max(count, default=0)}


class DraftPenalty:
    """Penalties on a round's draft steps, so penalized requests' drafts follow what their
    verify will pick: the round's starting state (SGLang's accumulated tensors), then each
    drafted token counted as decoding would count it for frequency, presence and repetition
    (the additive ones summed, as SGLang's verify sums them: an ulp from decoding's order at
    most), and min_new_tokens' stop tokens held back at the steps decoding holds them (draft
    step j proposes the round's output token j). Drafts are proposals the verify checks, so
    this only steers them; it never changes an output."""

    def __init__(self, info, rows: list[int], reqs):
        index = torch.tensor(rows, dtype=torch.int64, device=info.temperatures.device)
        self.add = None if info.acc_additive_penalties is None else info.acc_additive_penalties[index].clone()
        self.scale = None if info.acc_scaling_penalties is None else info.acc_scaling_penalties[index].clone()
        params = [reqs[b].sampling_params for b in rows]
        column = lambda xs: torch.tensor(xs, dtype=torch.float32, device=index.device)[:, None]  # noqa: E731
        self.frequency = column([p.frequency_penalty or 0.0 for p in params])
        self.repetition = column([p.repetition_penalty or 1.0 for p in params])
        self.presence = column([p.presence_penalty or 0.0 for p in params])
        orch = orchestrator_of(info)
        pens = dict(_penalizers(orch)) if orch is not None else {}
        presence = pens.get("presence")
        # which tokens already carry the presence penalty (it is set once, not added per token)
        self.present = None if presence is None else presence.cumulated_presence_penalties[index] != 0
        self.step, self.stop, self.held_steps = 0, None, None
        held = pens.get("min_new_tokens")
        if held is not None and self.add is not None:
            # the accumulated sum holds the stop tokens back for the whole round (-inf, which
            # no later step can take out): keep the other additive penalties there, and the
            # stop tokens' -inf apart, for the steps still short of the count
            self.stop = held.stop_token_penalties[index]
            self.held_steps = (held.min_new_tokens[index] - held.len_output_tokens[index]).float()  # [rows, 1]
            rest = torch.zeros_like(self.add)
            for kind in ("frequency", "presence"):
                if kind in pens:
                    rest -= getattr(pens[kind], f"cumulated_{kind}_penalties")[index]
            self.add = torch.where(torch.isinf(self.stop) & (self.held_steps > 0), rest, self.add)

    @classmethod
    def of(cls, info, rows: list[int], reqs):
        """None where the batch carries no penalties."""
        if info.acc_additive_penalties is None and info.acc_scaling_penalties is None:
            return None
        return cls(info, rows, reqs)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, V] draft logits, penalized (a new tensor in fp32)."""
        out = logits.float()
        out = out + self.add if self.add is not None else out.clone()
        if self.stop is not None:
            out = out + torch.where(self.held_steps > self.step, self.stop, 0.0)
        if self.scale is not None:
            _scale(out, self.scale)
        return out

    def count(self, tokens: torch.Tensor) -> None:
        """The step drafted ``tokens`` [rows]: the next step is penalized for them too."""
        self.step += 1
        index = tokens.to(torch.int64)[:, None]
        if self.add is not None:
            self.add.scatter_add_(1, index, -self.frequency)
            if self.present is not None:
                new = ~self.present.gather(1, index)
                self.add.scatter_add_(1, index, -self.presence * new)
                self.present.scatter_(1, index, True)
        if self.scale is not None:
            self.scale.scatter_(1, index, self.repetition)
