"""The seam: the only package that reaches into SGLang internals (pinned: sglang==0.5.23).

One module per SGLang subsystem it touches, each opening with the SGLang classes it
patches and why:

- ``server``: our config turned into SGLang flags, the HTTP server launch;
- ``spec_algorithm``, ``worker``: the ``VERICACHE`` speculative algorithm and its worker (NGRAM's shape);
- ``forward``: draft forward passes over compressed KV, narrowed verify batches;
- ``attention``: the draft and verify attention backends, the CPU engine's extend;
- ``sampling``: seeded sampling on the pytorch sampler, acceptance for sampled rounds;
- ``penalties``: frequency, presence and repetition penalties position by position in a verify;
- ``scheduler``: deferred rows, preempted requests keeping their KV, fetch drafting, /server_info;
- ``radix``: the ``vericache`` radix-cache backend, its integrity check, full-KV parking hooks;
- ``hicache``: HiCache on a CPU device pool, load timing;
- ``storage``: checksummed storage tiers, compressed entries as blobs;
- ``linear``: packed CPU weights, draft weight copies, row-invariant products, weight updates.
- ``validation``: bad request fields refused with a 400 before the scheduler (tokenizer manager, HTTP, OpenAI);
- ``containment``: an arriving request's own error ends that request, not the scheduler.

``register_all`` installs every hook, listed below in one place; the hooks share one
``runtime.Runtime`` per process. The VeriCache round itself is ``spec/round.py``, in the
project's own terms.
"""

from __future__ import annotations

from sgl_vericache.sglang.runtime import Runtime

_PROCESS_RUNTIME = None  # this process's Runtime, once register_all ran


def register_all() -> Runtime:
    """Run once per SGLang process by the plugin entry point; returns the process runtime."""
    global _PROCESS_RUNTIME
    if _PROCESS_RUNTIME is not None:
        return _PROCESS_RUNTIME
    from sgl_vericache.config import VeriCacheConfig
    from sgl_vericache.cpu import compat
    from sgl_vericache.sglang import attention, forward, hicache, linear, penalties, radix, sampling, scheduler, spec_algorithm
    from sgl_vericache.sglang import storage
    from sgl_vericache.sglang import containment, validation

    compat.install()
    runtime = _PROCESS_RUNTIME = Runtime()
    vc = VeriCacheConfig.from_env() or VeriCacheConfig()
    installs = [
        validation.install_chat_body_checks,  # chat bodies' response_format: a 400, before routes are built
        spec_algorithm.install_spec_algorithm,  # --speculative-algorithm VERICACHE
        sampling.install_seeded_sampling,  # sampling_seed on the pytorch sampler, per row
        sampling.install_verify_sampler,  # sampled rounds' acceptance; deferred rows accept nothing
        sampling.install_penalty_order,  # additive penalties before repetition, in every process
        penalties.install_penalties_per_position,  # penalized rows draft: each position penalized as decoding
        hicache.install_cpu_hicache,  # HiCache with a CPU device pool; load timing
        attention.install_cpu_extend_attention,  # torch_native extend: new rows only
        radix.install_radix_cache_backend,  # --radix-cache-backend vericache; integrity at idle
        storage.install_tier_checksums,  # page digests in storage tiers
        linear.install_weight_products,  # draft weight copies, packed CPU weights
        linear.install_weight_update_hook,  # rebuild weight copies after in-place updates
        scheduler.install_internal_state,  # /server_info
        scheduler.install_context_end_headroom,  # request-to-token rows wide enough for a decode's reserve
        scheduler.install_draft_memory_reserve,  # the KV pool leaves room for compressed entries
        scheduler.install_deferred_rows,  # staggered verifies: rows without a token
        scheduler.install_fetch_drafting,  # drafting while a prefix streams in
        scheduler.install_session_turns,  # a session's next turn starts from the finished output
        validation.install_tokenizer_checks,  # a bad request field is a 400 before the scheduler (any API)
        validation.install_http_checks,  # the same on native /generate bodies, before a stream starts
        validation.install_openai_checks,  # the same on OpenAI completions / chat, in OpenAI's field names
        containment.install_admission_containment,  # an arriving request's own error ends it alone (500)
        containment.install_grammar_dead_ends,  # a grammar that admits no token: a 400, not SGLang's 500
    ]
    if vc.keep_preempted_kv:
        installs.append(scheduler.install_keep_preempted_kv)  # preempted requests keep their KV
    if vc.deterministic:
        installs.append(linear.install_row_invariant_forward)  # row-invariant weight products
    installs.append(forward.install_narrowed_verify)  # staggered verifies run their verifying rows only
    installs.append(forward.install_unfused_draft_kv)  # draft passes: no KV written in the rotary embedding
    for install in installs:
        install(runtime)
    if not vc.deterministic:
        linear.install_cpu_linear(runtime, vc.cpu_linear)  # packed fp32 weights (deterministic keeps F.linear)
    return runtime
