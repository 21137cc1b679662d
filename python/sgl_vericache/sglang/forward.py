"""Forward batches: the draft passes over compressed KV, and narrowing a batch to the rows
that verify.

Touches ``ForwardBatch`` (built from the ScheduleBatch, run in DECODE mode with our draft
attention backend; narrowed row by row), ``forward_context`` (which backend a forward
uses), ``ModelRunner.forward`` (a staggered round's verify runs over its verifying rows
only), ``models.utils.enable_fused_set_kv_buffer`` (off in draft passes) and NGRAM's
``NgramVerifyInput`` stride (``widen_draft_input``).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from contextlib import contextmanager

import torch

from sgl_vericache.sglang.attention import make_draft_backend
from sgl_vericache.sglang.runtime import Runtime, patch


class DraftPasses:
    """Forward passes of the target model whose attention reads a ``CompressedKVStore``
    (the draft's); they never write the KV pool. ``run`` yields ``forward(tokens,
    positions, tokens_of_one=False) -> next-token logits [rows, V]``."""

    def __init__(self, model_runner, runtime: Runtime, draft_weights):
        self.model_runner = model_runner
        self.runtime = runtime
        self.draft_weights = draft_weights  # DraftWeights, or None: the model's own
        self._backends = {}  # id(store) -> its draft attention backend
        # multimodal rotary models (Qwen2-VL / 2.5-VL / 3-VL, GLM-4.1V...) read positions
        # from ``mrope_positions``, which every draft step must move with ``positions``
        self.mrope = bool(getattr(model_runner.model_config, "model_is_mrope", False))

    def for_rows(self, batch, keep: list):
        """A DECODE ForwardBatch of the ScheduleBatch ``batch``'s rows ``keep``."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        fb = ForwardBatch.init_new(batch, self.model_runner, return_hidden_states_before_norm=False)
        fb.forward_mode = ForwardMode.DECODE
        fb.out_cache_loc = None
        if len(keep) < len(batch.reqs):
            narrow_rows(fb, keep, len(batch.reqs))
        if self.mrope:
            deltas = mrope_deltas(batch.multimodal_inputs)
            fb.vericache_mrope_deltas = torch.tensor([deltas[i] for i in keep], dtype=torch.int64,
                                                     device=self.model_runner.device)
        return _needs_no_plan(fb)

    def one_row(self, req=None):
        """A DECODE ForwardBatch of one request (``req``: its multimodal positions), placed at
        position 0 (``place`` moves it)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        one = torch.ones(1, dtype=torch.int64, device=self.model_runner.device)
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=one,
                          req_pool_indices=one * 0, seq_lens=one, out_cache_loc=None, seq_lens_sum=1,
                          positions=one * 0, seq_lens_cpu=torch.ones(1, dtype=torch.int64),
                          capture_hidden_mode=CaptureHiddenMode.NULL)
        if self.mrope:
            fb.vericache_mrope_deltas = one * mrope_deltas([getattr(req, "multimodal_inputs", None)])[0]
        return _needs_no_plan(fb)

    @staticmethod
    def place(fb, n: int) -> None:
        """A ``one_row`` batch drafts after ``n`` tokens of its request."""
        fb.seq_lens, fb.positions, fb.seq_lens_sum = fb.seq_lens * 0 + n + 1, fb.positions * 0 + n, n + 1
        fb.seq_lens_cpu = fb.seq_lens_cpu * 0 + n + 1

    def _backend(self, store):
        backend = self._backends.get(id(store))
        if backend is None:
            backend = self._backends[id(store)] = make_draft_backend(self.model_runner, store)
        return backend

    @contextmanager
    def run(self, fb, store):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        backend, rt, device = self._backend(store), self.runtime, self.model_runner.device

        def forward(tokens, positions, tokens_of_one=False):
            fb.input_ids = torch.as_tensor(tokens, dtype=torch.int64, device=device)
            fb.positions = torch.as_tensor(positions, dtype=torch.int64, device=device)
            if self.mrope:  # a row's delta: [rows] a step, or [1] for one request's tokens
                fb.mrope_positions = (fb.positions + fb.vericache_mrope_deltas).unsqueeze(0).repeat(3, 1)
            backend.tokens_of_one = tokens_of_one  # rows are consecutive tokens of one request
            try:
                logits = self.model_runner.forward(fb).logits_output.next_token_logits
            finally:
                backend.tokens_of_one = False
            if self.draft_weights is not None:  # an fp16 overflow must not reach the sampler
                logits = torch.nan_to_num(logits)
            return logits

        rt.draft_weights, rt.drafting = self.draft_weights, True
        try:
            with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
                yield forward
        finally:
            rt.draft_weights, rt.drafting = None, False


def _needs_no_plan(fb):
    """A draft batch's attention is the draft backend's, which reads the store and needs no
    plan; but SGLang's eager decode plans on the model runner's own backend unless the batch
    says it is planned (as EAGLE's draft batches do). Unmarked, a GPU backend planned every
    draft step over the scheduler's leftover ``spec_info`` (the last round's
    NgramVerifyInput): Triton's reads its ``kv_indptr``, which it lacks (the first round
    failed), FA3 took its draft-decode branch, FlashInfer planned for nothing."""
    fb.spec_info = None
    fb.mark_forward_metadata_ready()
    return fb


def mrope_deltas(mm_inputs) -> list[int]:
    """Per request of a multimodal rotary (M-RoPE) model, how far its text positions run
    ahead of its token count: a token after the prompt at position p has temporal, height
    and width positions p + delta (0 for a request without images), as SGLang's decode
    computes them."""
    deltas = []
    for mm in mm_inputs:
        delta = getattr(mm, "mrope_position_delta", None) if mm is not None else None
        deltas.append(0 if delta is None else int(torch.as_tensor(delta).reshape(-1)[0]))
    return deltas


def narrow_rows(fb, keep: list, bs: int, width: int = 1) -> None:
    """A decode (``width`` 1) or target-verify (``width`` tokens a row) ForwardBatch of ``bs``
    rows -> the rows ``keep``, in place: every per-row tensor and list (leading dimension
    ``bs``) and every per-token tensor (leading dimension ``bs * width``: input ids,
    positions, KV write slots; a multimodal rotary model's ``mrope_positions``, [3, tokens],
    along its tokens) is indexed, ``batch_size``, ``seq_lens_sum`` and the count of
    real tokens follow. The draft passes narrow to the rows that verify (their attention
    reads only the compressed entries, row order: the store's round); the verify forward
    too (``install_narrowed_verify``)."""
    idx = torch.tensor(keep, dtype=torch.int64)
    tok = (idx[:, None] * width + torch.arange(width)).reshape(-1)
    for f in dataclasses.fields(fb):
        value = getattr(fb, f.name)
        if f.name == "mrope_positions":  # [3, tokens]: by token, along its second dimension
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == bs * width:
                fb.mrope_positions = value[:, tok.to(value.device)]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == bs:
            setattr(fb, f.name, value[idx.to(value.device)])
        elif width > 1 and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == bs * width:
            setattr(fb, f.name, value[tok.to(value.device)])
        elif isinstance(value, list) and len(value) == bs:
            setattr(fb, f.name, [value[i] for i in keep])
    fb.batch_size = len(keep)
    if fb.seq_lens_cpu is not None:
        fb.seq_lens_sum = int(fb.seq_lens_cpu.sum())
    real = getattr(fb, "num_token_non_padded", None)
    if isinstance(real, torch.Tensor) and real.dim() == 0:
        fb.num_token_non_padded = torch.tensor(len(keep) * width, dtype=real.dtype, device=real.device)
    if getattr(fb, "num_token_non_padded_cpu", None) is not None:
        fb.num_token_non_padded_cpu = len(keep) * width


def install_narrowed_verify(runtime: Runtime) -> None:
    """Staggered verifies: run a round's verify forward over the rows that verify only. A
    deferred row's logits are never used (it accepts 0 tokens), so projections, MLP and LM
    head over its draft block were wasted work. SGLang builds the verify ForwardBatch
    inside its worker, so the model runner's ``forward`` is wrapped: a target-verify batch
    of the active VeriCache worker's runner with deferred rows is run as a narrowed copy,
    and the logits are laid back out over every row (deferred rows' left at 0, never
    sampled; a logprob batch's logprobs are taken from the laid-out logits afterwards, and
    its deferred rows' are never read). CUDA-graph runners (fixed shapes) run whole."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    def make(original):
        def forward(self, forward_batch, *args, **kwargs):
            worker = forward.runtime.active_worker
            deferred = () if worker is None or worker.model_runner is not self else worker.speculator.deferred
            if not deferred or worker.cuda_graphs or not forward_batch.forward_mode.is_target_verify():
                return original(self, forward_batch, *args, **kwargs)
            return _narrowed_verify(original, self, worker, deferred, forward_batch, *args, **kwargs)

        return forward

    patch(ModelRunner, "forward", runtime, make)


def _narrowed_verify(original, runner, worker, deferred, forward_batch, *args, **kwargs):
    bs = forward_batch.batch_size
    width = forward_batch.input_ids.shape[0] // bs
    skipped = set(deferred)
    keep = [i for i in range(bs) if i not in skipped]
    narrow = copy.copy(forward_batch)
    narrow_rows(narrow, keep, bs, width)
    mask = getattr(forward_batch.spec_info, "custom_mask", None)
    if mask is not None and mask.numel() == bs * width * width:
        narrow.spec_info = copy.copy(forward_batch.spec_info)
        narrow.spec_info.custom_mask = mask.reshape(bs, -1)[torch.tensor(keep, device=mask.device)].reshape(-1)
    backend = worker.verify_backend
    skip, backend.skip_rows = backend.skip_rows, ()  # row numbers of the whole batch
    try:
        out = original(runner, narrow, *args, **kwargs)
    finally:
        backend.skip_rows = skip
    logits = out.logits_output
    rows = torch.tensor(keep, device=logits.next_token_logits.device)
    for name, value in list(vars(logits).items()):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == len(keep) * width:
            whole = value.new_zeros((bs, width) + tuple(value.shape[1:]))
            whole[rows] = value.reshape((len(keep), width) + tuple(value.shape[1:]))
            setattr(logits, name, whole.reshape((bs * width,) + tuple(value.shape[1:])))
    worker.speculator.stats.add("verify_rows_skipped", len(deferred))
    return out


def widen_draft_input(info, bs: int, width: int, max_width: int) -> None:
    """A round verified at ``width`` < the server's: the result's next-round input keeps
    SGLang's fixed row stride (``max_width``), which batch filtering and merging assume;
    the result's own output tokens stay at the round's stride, as the result says."""
    tokens = info.accept_tokens.reshape(bs, width)
    padded = torch.zeros((bs, max_width), dtype=tokens.dtype, device=tokens.device)
    padded[:, :width] = tokens
    info.accept_tokens = padded.flatten()
    info.draft_token_num = info.num_tokens_per_req = info.num_tokens_for_logprob_per_req = max_width


def install_unfused_draft_kv(runtime: Runtime) -> None:
    """Draft passes write no KV. On CUDA with a bfloat16 pool several of SGLang's models
    (Qwen3-MoE, gpt-oss, Bailing-MoE, SDAR, Mellum, LLaDA2) write K/V into the pool inside
    their rotary embedding, at the batch's ``out_cache_loc``, when
    ``models.utils.enable_fused_set_kv_buffer`` says so; a draft pass has no write slots
    (None, which the fused op refuses: the first round would take the scheduler down) and
    must not write the pool anyway. While a worker drafts the models are told the fused
    write is off, so they hand k and v to attention, which the draft backend reads and never
    stores. Verify and plain forwards keep SGLang's choice. Patched where the models look
    it up: ``models.utils`` (a model module imported later takes it from there) and every
    model module already imported with its own reference."""
    from sglang.srt.models import utils

    def make(original):
        def enable_fused_set_kv_buffer(forward_batch):
            if enable_fused_set_kv_buffer.runtime.drafting:
                return False
            return original(forward_batch)

        return enable_fused_set_kv_buffer

    patch(utils, "enable_fused_set_kv_buffer", runtime, make)
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang.srt.models.") and callable(getattr(module, "enable_fused_set_kv_buffer", None)):
            patch(module, "enable_fused_set_kv_buffer", runtime, make)
