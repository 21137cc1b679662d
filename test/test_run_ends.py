"""Where a verified run ends (sglang/sampling.py ``cap_acceptance``): at its first stop token,
where decoding one token at a time would end it for stop strings and stop regexes, one
token for rows that drafted nothing and none for deferred ones; and a session's next turn
starts from the finished output. Against SGLang's own ``Req`` fed one token at a time."""

import pytest
import torch


class _Tok:
    """A five-token tokenizer for SGLang's Req: 2 is EOS, 3 is a newline."""
    eos_token_id = 2
    additional_stop_token_ids = None
    vocab = {0: "a", 1: "b", 2: "</s>", 3: "\n", 4: "c"}

    def decode(self, ids, **kw):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, s, add_special_tokens=False):
        return [3] if s == "\n" else [0]


def _req(**params):
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(**{"max_new_tokens": 32, "temperature": 0, **params})
    sp.normalize(_Tok())
    req = Req("r", "p", array("q", [0, 1]), sp, eos_token_ids={2}, vocab_size=5)
    req.tokenizer = _Tok()
    return req


def _verified(runs, width):
    """eagle_sample's (predict, accept_lens, accept_index) for rows that accepted ``runs``."""
    predict = torch.zeros(len(runs) * width, dtype=torch.int32)
    index = torch.full((len(runs), width), -1, dtype=torch.int32)
    for b, run in enumerate(runs):
        index[b, : len(run)] = torch.arange(b * width, b * width + len(run), dtype=torch.int32)
        predict[b * width : b * width + len(run)] = torch.tensor(run, dtype=torch.int32)
    return predict, torch.tensor([len(r) for r in runs], dtype=torch.int32), index


def _finish(req, tokens, at_once):
    if at_once:
        req.output_ids.extend(tokens)
        req.update_finish_state(len(tokens))
    else:
        for t in tokens:
            req.output_ids.append(t)
            req.update_finish_state(1)
            if req.finished():
                break
    return type(req.finished_reason).__name__, req.finished_len


@pytest.mark.parametrize("params", [{"stop": ["\n"]}, {"stop_token_ids": [4]}, {"stop": ["\n"], "ignore_eos": True}])
def test_a_round_ends_where_decoding_stops(params):
    """A verify can accept the target's tokens past an EOS, and SGLang's finish check reads
    stop strings in the whole run before stop tokens: [a, EOS, c, newline, b] with stop
    "\\n" ended at the newline, where decoding ends at the EOS (negative control below). The
    cap ends each run at its first stop token, so SGLang's check sees what decoding saw."""
    from sgl_vericache.sglang.sampling import cap_acceptance

    run, width = [0, 2, 4, 3, 1], 6
    uncut = _finish(_req(**params), run, at_once=True)
    decoded = _finish(_req(**params), run, at_once=False)
    if "stop" in params and not params.get("ignore_eos"):
        assert uncut != decoded  # the bug, in SGLang's own Req (a stop string after the EOS)
    verified = _verified([run, [4, 4, 1]], width)
    cap_acceptance(verified, (), (), [_req(**params), _req(**params)])
    predict, lens, index = verified
    kept = [predict[index[b, : lens[b]].long()].tolist() for b in range(2)]
    assert _finish(_req(**params), kept[0], at_once=True) == decoded
    if params.get("ignore_eos"):
        assert kept[0] == [0, 2, 4, 3]  # EOS is no stop: the run goes on to the stop string
    else:
        assert kept[0] == [0, 2] and index[0, 2:].eq(-1).all()
    if "stop_token_ids" in params:
        assert kept[1] == [4]  # a stop token id of the request's own ends its run too
    else:
        assert kept[1] == [4, 4, 1]


def _in_rounds(params, stream, width, cap=True, make=None):
    """(finish reason, finished_len, output ids up to it) of a request (``make()``, else
    ``_req(**params)``) whose verifies accept ``stream`` ``width`` tokens a round, each run
    capped by cap_acceptance (or not)."""
    from sgl_vericache.sglang.sampling import cap_acceptance

    req, at = (make or (lambda: _req(**params)))(), 0
    while not req.finished() and at < len(stream):
        verified = _verified([stream[at : at + width]], width)
        if cap:
            cap_acceptance(verified, (), (), [req])
        predict, lens, index = verified
        kept = predict[index[0, : lens[0]].long()].tolist()
        req.output_ids.extend(kept)
        req.update_finish_state(len(kept))
        at += len(kept)
    return type(req.finished_reason).__name__, req.finished_len, list(req.output_ids[: req.finished_len])


def _decoded(params, stream):
    req = _req(**params)
    reason, length = _finish(req, stream, at_once=False)
    return reason, length, list(req.output_ids[:length])


# _Tok encodes any stop string as one token, so a decode step reads the text of the last two
# tokens (three for a regex of two characters) and a run of n the last n + 1
@pytest.mark.parametrize("params,stream", [
    ({"stop": ["abc", "\n"]}, [1, 0, 1, 4, 3, 0, 1]),  # "abc" in three pieces: decoding stops at the newline
    ({"stop": ["abc"]}, [0, 1, 4] * 14),  # no decode step sees "abc": decoding runs to max_new_tokens
    ({"stop": ["abc"], "max_new_tokens": 5}, [0, 1, 4] * 3),
    ({"stop_regex": ["^bc"]}, [0, 0, 1, 4, 1, 1, 0, 1, 4]),  # anchored at the window's start: the run's check misses it
    ({"stop_regex": ["c\\n"], "stop": ["aa"]}, [1, 4, 3, 0, 0, 1]),
    ({"stop_regex": ["b.*c\\n"]}, [0, 1, 0, 0, 4, 0, 4, 3, 1]),  # no length bound: every window is the whole output
    ({"stop_regex": ["^a{2}b"]}, [1, 0, 0, 1, 4, 0, 0, 1, 4]),
])
@pytest.mark.parametrize("width", [3, 5, 8])
def test_stop_strings_end_a_run_where_decoding_ends(params, stream, width):
    """SGLang's finish check reads a run of n accepted tokens through a window n - 1 tokens
    longer than a decode step's, so it finds stop strings spanning more tokens than the stop
    string's own tokenization (which no decode step sees) and matches decoding never makes;
    an anchored stop regex can match a decode step's window and not the run's. Each round is
    cut so that SGLang's own check ends the request where decoding one token at a time does:
    the same ids, length and finish reason."""
    decoded = _decoded(params, stream)
    assert _in_rounds(params, stream, width) == decoded
    if width == 8 and params.get("max_new_tokens") is None and "b.*c" not in str(params):
        assert _in_rounds(params, stream, width, cap=False) != decoded  # negative control: whole runs


class _ByteTok(_Tok):
    """Byte-level pieces: 5 and 6 are the two bytes of "\u00e9", so a window ending between
    them decodes to U+FFFD (as a byte-level BPE tokenizer's would)."""
    vocab = {0: b"a", 1: b"b", 2: b"</s>", 3: b"\n", 4: b"c", 5: b"\xc3", 6: b"\xa9"}

    def decode(self, ids, **kw):
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("width", [3, 5])
def test_a_stop_string_a_step_sees_inside_a_character_ends_the_run_there(width):
    """A decode step's window can end inside a character: its text ends in U+FFFD, which the
    run's longer window completes. A stop string holding U+FFFD is checked step by step."""
    from sgl_vericache.sglang import sampling

    stream, params = [0, 5, 6, 1, 0, 1], {"stop": ["\ufffd"]}
    tok = _ByteTok()

    def req():
        r = _req(**params)
        r.tokenizer, r.vocab_size = tok, len(tok.vocab)
        return r

    decoded = req()
    reason, length = _finish(decoded, stream, at_once=False)
    assert (reason, length, decoded.finished_reason.matched) == ("FINISH_MATCHED_STR", 2, "\ufffd")  # after 0xc3
    assert _in_rounds(params, stream, width, make=req)[:2] == (reason, length)
    assert sampling.string_stop_cut(req(), [0, 5, 7]) == 3  # an id past the vocabulary: left to SGLang


def test_stop_string_cut_leaves_ordinary_runs_whole():
    """A run in which neither decoding nor the run's check finds a stop string is accepted
    whole, and a stop string inside a run ends it after its last token, as decoding does."""
    from sgl_vericache.sglang.sampling import string_stop_cut

    req = _req(stop=["ca"])
    assert string_stop_cut(req, [0, 1, 1, 0, 4]) == 5
    assert string_stop_cut(req, [0, 1, 4, 0, 1]) == 4
    req.output_ids.extend([1, 4])
    assert string_stop_cut(req, [0, 1]) == 1  # the stop spans the last round's token and this one's first


def test_rows_without_drafts_accept_one_token_and_deferred_rows_none():
    """Rows that drafted nothing are verified over copies of their root; a target that
    predicts the root again would have them accept several tokens under one penalty state.
    They accept the first alone; deferred rows accept nothing."""
    from sgl_vericache.sglang.sampling import cap_acceptance

    verified = _verified([[7, 7, 7, 7], [5, 6, 7], [7, 7, 7]], 4)
    cap_acceptance(verified, (2,), (0,), [_req(), _req(), _req()])
    _, lens, index = verified
    assert lens.tolist() == [1, 3, 0]
    assert index[0].tolist() == [0, -1, -1, -1] and index[1].tolist() == [4, 5, 6, -1] and index[2].eq(-1).all()


def test_a_sessions_next_turn_starts_from_the_finished_output():
    """A non-streaming session's next prompt is the last turn's prompt and output ids, which
    SGLang cuts at max_new_tokens only: a round that accepted tokens past a stop string
    (finished_len) handed them to the next turn. The hook cuts at finished_len; decoding's
    turns (finished_len is the output's length) are unchanged."""
    from types import SimpleNamespace as N

    from sglang.srt.session.session_controller import Session

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.scheduler import install_session_turns

    install_session_turns(Runtime())
    hook = Session.__dict__["_concat_token_arrays"]
    assert isinstance(hook, staticmethod)  # still called as self._concat_token_arrays(last_req, req, params)
    last = N(origin_input_ids=[1, 2], origin_input_ids_unpadded=[1, 2], output_ids=[5, 6, 7, 8],
             sampling_params=N(max_new_tokens=32), finished_len=2)
    params = N(drop_previous_output=False, offset=None)
    session = Session.__new__(Session)
    assert session._concat_token_arrays(last, N(input_ids=[9]), params) == ([1, 2, 5, 6, 9], [1, 2, 5, 6, 9])
    assert hook.__func__.sglang_original(last, N(input_ids=[9]), params)[0] == [1, 2, 5, 6, 7, 8, 9]  # SGLang's own
    last.finished_len = 4
    assert session._concat_token_arrays(last, N(input_ids=[9]), params)[0] == [1, 2, 5, 6, 7, 8, 9]
    assert last.output_ids == [5, 6, 7, 8]  # the finished request is left as it was
