"""The ``VERICACHE`` speculative algorithm in SGLang's registry.

Touches ``SpeculativeAlgorithm.register`` and ``CustomSpecAlgo``: VERICACHE takes NGRAM's
branches everywhere SGLang dispatches on the algorithm (no draft model, no draft KV, a
linear chain verified by the target), and its worker (``worker.VeriCacheWorker``) is built
for the runtime this was installed with.
"""

from __future__ import annotations

from sgl_vericache.sglang.runtime import Runtime
from sgl_vericache.sglang.server import SPEC_ALGORITHM


NGRAM_DEFAULT_BREADTH = 10  # SGLang 0.5.23's --speculative-ngram-max-bfs-breadth default


def check_draft_chain(breadth) -> None:
    """A VERICACHE round drafts one chain: --speculative-ngram-max-bfs-breadth is 1, or left at
    SGLang's default (NGRAM's, which VERICACHE then sets to 1); any other value asked for a
    tree VeriCache does not draft."""
    if breadth not in (1, NGRAM_DEFAULT_BREADTH, None):
        raise ValueError(f"--speculative-ngram-max-bfs-breadth {breadth}: VERICACHE drafts one chain; accepted: 1 "
                         "(or leave it unset)")


def install_spec_algorithm(runtime: Runtime) -> None:
    """``--speculative-algorithm VERICACHE``, whose worker is built for ``runtime``."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

    if get_spec(SPEC_ALGORITHM) is not None:
        return

    class VeriCacheSpecAlgo(CustomSpecAlgo):
        # SGLang dispatches NGRAM's scheduling, relay and verify-input branches on
        # is_ngram(); VERICACHE has the same shape (no draft model, no draft KV,
        # linear chain verified by the target), so it takes those branches.
        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        # Called on every algorithm but missing from CustomSpecAlgo in 0.5.23.
        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self):
            return None

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            from sglang.srt.arg_groups.speculative_hook import _handle_ngram

            check_draft_chain(server_args.speculative_ngram_max_bfs_breadth)
            # NGRAM's tree breadth becomes the attention backends' top-k; a VERICACHE round is one
            # chain, verified at its own width: with a top-k above 1 FA3 would plan a tree verify
            # at the server's widest width and read past a narrower round's mask, and NGRAM's
            # resolution refuses a top-k above 1 with pages above 1 on other backends. (SGLang
            # hands this callback a recorder: NGRAM's resolution reads the breadth written
            # here, and the top-k written after it is declared after NGRAM's.)
            server_args.speculative_ngram_max_bfs_breadth = 1
            _handle_ngram(server_args)
            server_args.speculative_eagle_topk = 1

    def factory(server_args):  # the worker module imports SGLang's NGRAM worker: only when one is built
        from sgl_vericache.sglang.worker import VeriCacheWorker

        VeriCacheWorker.runtime = runtime
        return VeriCacheWorker

    SpeculativeAlgorithm.register(SPEC_ALGORITHM, spec_class=VeriCacheSpecAlgo, supports_overlap=False)(factory)
