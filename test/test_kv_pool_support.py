"""Which of SGLang's KV pools a VERICACHE worker reads, decided on SGLang's own pool classes
(built small on CPU): a plain pool with keys and values of one shape is served; a model whose
KV is laid out otherwise is refused when the worker starts, naming what it has, instead of
failing inside its first round and taking the scheduler with it (a tiny DeepSeek-V2 did:
"k and v must both be [T, H_kv, D]; got (40, 1, 48) and (40, 1, 32)")."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (HybridReqToTokenPool, MHATokenToKVPool,  # noqa: E402
                                              MLATokenToKVPool, ReqToTokenPool)

from sgl_vericache.sglang.server import check_kv_pool  # noqa: E402


def mha_pool(head_dim=8, v_head_dim=None):
    return MHATokenToKVPool(16, page_size=1, dtype=torch.float32, head_num=2, head_dim=head_dim,
                            v_head_dim=v_head_dim, layer_num=2, device="cpu", enable_memory_saver=False)


def token_table():
    return ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)


def test_a_plain_pool_is_served():
    check_kv_pool(mha_pool(), token_table())
    check_kv_pool(mha_pool(head_dim=16))


def test_multi_head_latent_attention_is_refused():
    """MLA (DeepSeek V2 / V3, Kimi K2) keeps a latent vector per token, [slots, 1, 48] here,
    whose value is its first 32 channels."""
    pool = MLATokenToKVPool(16, page_size=1, dtype=torch.float32, kv_lora_rank=32, qk_rope_head_dim=16,
                            layer_num=2, device="cpu", enable_memory_saver=False)
    with pytest.raises(ValueError, match=r"multi-head latent attention \(MLA, MLATokenToKVPool.*--no-vericache-enable"):
        check_kv_pool(pool, token_table())


def test_values_narrower_than_keys_are_refused():
    with pytest.raises(ValueError, match=r"at layer 0, keys \(17, 2, 8\) and values \(17, 2, 4\).*--no-vericache-enable"):
        check_kv_pool(mha_pool(head_dim=8, v_head_dim=4), token_table())


def test_a_model_with_state_space_layers_is_refused():
    """Qwen3-Next, Nemotron-H, Falcon-H1: SGLang keeps their attention layers' KV in an
    ordinary pool and their Mamba / linear-attention state in the token table's state pool,
    which a draft pass would advance."""
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8,
                                    state_size=4, conv_kernel=4)
    table = HybridReqToTokenPool(size=4, mamba_size=4, mamba_spec_state_size=4, max_context_len=64, device="cpu",
                                 enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
                                 mamba_layer_ids=[0], enable_mamba_extra_buffer=False, speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match=r"linear-attention or state-space layers.*--no-vericache-enable"):
        check_kv_pool(mha_pool(), table)
