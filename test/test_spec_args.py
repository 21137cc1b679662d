"""SGLang's resolution of an engine's speculative arguments with VERICACHE, as any engine
gets it (``sgl.Engine``, ``sglang.launch_server`` with the plugin), not only the ones our
launcher builds."""

from __future__ import annotations

import pytest


def _resolved(page_size=1, **kw):
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.speculative_hook import handle_speculative_decoding
    from sglang.srt.server_args import ServerArgs

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.spec_algorithm import install_spec_algorithm

    install_spec_algorithm(Runtime())
    args = ServerArgs(model_path="unused", device="cpu", speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens=9, page_size=page_size, **kw)
    handle_speculative_decoding(args)
    return resolved_view(args)


@pytest.mark.parametrize("breadth, page_size", [(None, 1), (1, 1), (None, 16)])
def test_a_round_is_one_chain_to_the_attention_backends(breadth, page_size):
    """NGRAM's tree breadth (10 by default) becomes the backends' top-k; FA3 plans a top-k
    above 1 as a tree verify at the server's widest width, which reads past the mask of a
    narrower round (a device-side assert), and NGRAM's own resolution refuses a top-k above
    1 with pages of 16. VERICACHE resolves it to 1 whatever the engine's builder passed, or
    refuses a breadth asked for on purpose."""
    view = _resolved(page_size, **({} if breadth is None else {"speculative_ngram_max_bfs_breadth": breadth}))
    assert (view.speculative_eagle_topk, view.speculative_ngram_max_bfs_breadth) == (1, 1)
    assert view.speculative_num_steps == 9  # NGRAM's: one step a draft token


def test_a_tree_breadth_is_refused_by_name():
    with pytest.raises(ValueError, match="--speculative-ngram-max-bfs-breadth 4: VERICACHE drafts one chain"):
        _resolved(speculative_ngram_max_bfs_breadth=4)
