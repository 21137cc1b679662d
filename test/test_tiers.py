"""Full KV in host and remote tiers (SGLang's hierarchical cache) under VeriCache, on CPU.

Unit level: KV copied device -> host -> device, and host -> file backend -> host, comes back
bit-identical. End to end: a multi-turn, multi-conversation trace whose device pool is too
small to keep the conversations, so later turns reload their prefix from the host tier, and
whose first turns find their prefix in the file backend written by an earlier engine (the
remote prefix-reuse scenario): token ids equal speculation off.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

LAYERS, HEADS, HEAD_DIM, DEVICE_TOKENS = 3, 2, 8, 64


@pytest.fixture(scope="module")
def cpu_hicache():
    from sgl_vericache.cpu import compat as cpu_compat

    cpu_compat.install()
    from sgl_vericache.sglang.hicache import install_cpu_hicache
    from sgl_vericache.sglang.runtime import Runtime

    install_cpu_hicache(Runtime())


def _pools(layout, page_size=1):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(DEVICE_TOKENS, page_size, torch.float32, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    info = device.get_device_pool_infos()[0].buffer_info
    # pin_memory is left at SGLang's default (True), which needs a CUDA driver without the patch
    host = MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, device_capacity_tokens=device.size,
                                start_layer=0, end_layer=LAYERS)
    gen = torch.Generator().manual_seed(0)
    for buf in (*device.k_buffer, *device.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    return device, host


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_device_host_device_round_trip_is_bit_identical(cpu_hicache, layout):
    device, host = _pools(layout)
    assert not host.pin_memory
    src, dst = torch.arange(5, 17), torch.arange(30, 42)
    slots = host.alloc(len(src))
    want_k = [_bits(b[src]).clone() for b in device.k_buffer]
    want_v = [_bits(b[src]).clone() for b in device.v_buffer]
    host.backup_from_device_all_layer(device, slots, src, "kernel")
    for buf in (*device.k_buffer, *device.v_buffer):
        buf[src] = 0.0  # the device copy is gone; only the host has it
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, slots, dst, layer, "kernel")
    for layer in range(LAYERS):
        assert torch.equal(_bits(device.k_buffer[layer][dst]), want_k[layer])
        assert torch.equal(_bits(device.v_buffer[layer][dst]), want_v[layer])
    assert not device.k_buffer[0][src].any()  # nothing written back where it did not belong


def test_host_file_host_round_trip_is_bit_identical(cpu_hicache, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    device, host = _pools("page_first", page_size=4)
    src = torch.arange(8, 16)
    slots = host.alloc(len(src))
    host.backup_from_device_all_layer(device, slots, src, "kernel")
    store = HiCacheFile(_storage_config({}), file_path=str(tmp_path))
    keys = ["page-a", "page-b"]
    pages = [host.get_data_page(int(slots[i]), flat=True).clone() for i in (0, 4)]
    assert store.batch_set(keys, pages)
    assert store.batch_exists(keys + ["page-c"]) == 2
    got = store.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    for want, page in zip(pages, got):
        assert torch.equal(_bits(page), _bits(want))
    other = host.alloc(8)
    for i, page in zip((0, 4), got):
        host.set_from_flat_data_page(int(other[i]), page)
    dst = torch.arange(40, 48)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, other, dst, layer, "kernel")
        assert torch.equal(_bits(device.k_buffer[layer][dst]), _bits(device.k_buffer[layer][src]))
        assert torch.equal(_bits(device.v_buffer[layer][dst]), _bits(device.v_buffer[layer][src]))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_full_kv_parked_in_the_host_pool_comes_back_bit_identical(cpu_hicache, layout):
    """--vericache-full-device-budget with HiCache parks in SGLang's host pool (its slots,
    its copy kernels): a row's KV parked, its device slots overwritten, loaded back layer by
    layer into other slots, is bit-identical; the host slots are freed after the load; a full
    host pool falls back to tensors of the parking's own."""
    from sgl_vericache.mem_cache.full_kv_parking import FullKVParking, HostPoolStore

    device, host = _pools(layout)
    req_to_token = torch.zeros(2, 32, dtype=torch.int32)
    free = list(range(1, DEVICE_TOKENS))
    alloc = lambda n: torch.tensor([free.pop(0) for _ in range(n)]) if n <= len(free) else None  # noqa: E731
    req_to_token[0, :20] = alloc(20).to(torch.int32)
    slots = req_to_token[0, 4:20].to(torch.int64)
    want = [(_bits(device.k_buffer[l][slots]).clone(), _bits(device.v_buffer[l][slots]).clone())
            for l in range(LAYERS)]
    parking = FullKVParking(device.get_key_buffer, device.get_value_buffer, LAYERS, req_to_token, alloc,
                            lambda s: free.extend(s.tolist()), host_pool=HostPoolStore(host, device, "kernel"))
    host_free = host.available_size()
    parking.park("a", 0, 4, 20)
    assert parking.stats.parks_in_host_pool == 1 and host.available_size() == host_free - 16
    for buf in (*device.k_buffer, *device.v_buffer):
        buf[slots] = 0.0
    free.sort(reverse=True)  # the request gets other slots back
    parking.start_loads({"a": 0})
    parking.finish()
    back = req_to_token[0, 4:20].to(torch.int64)
    assert not torch.equal(back, slots)
    for l in range(LAYERS):
        assert torch.equal(_bits(device.k_buffer[l][back]), want[l][0])
        assert torch.equal(_bits(device.v_buffer[l][back]), want[l][1])
    assert host.available_size() == host_free
    host.alloc(host.available_size())  # the host pool is full: tensors of its own
    parking.park("b", 0, 4, 20)
    assert parking.stats.parks == 2 and parking.stats.parks_in_host_pool == 1
    assert parking.load_now("b", 0) == 16


def test_parked_full_kv_indices_go_where_the_host_pools_io_backend_reads_them(cpu_hicache):
    """The host pool's allocator keeps host indices in CPU memory; its kernels read them on
    the GPU, its direct copies want the device indices on the host and both in host order.
    The parking places them with the cache controller's own ``move_indices`` (SGLang's, bound
    to a stand-in controller here), as HiCache does before its copies. With the direct
    backend and a shuffled host free list, the copies see host-ordered indices with the
    device indices in step, and the KV comes back bit-identical."""
    from types import MethodType, SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController

    from sgl_vericache.mem_cache.full_kv_parking import FullKVParking
    from sgl_vericache.sglang.hicache import parking_host_pool

    device, host = _pools("layer_first")
    host.free_slots = host.free_slots[torch.randperm(len(host.free_slots), generator=torch.Generator().manual_seed(1))]
    controller = SimpleNamespace(io_backend="direct", mem_pool_host=host, device="cpu")
    controller.move_indices = MethodType(HiCacheController.move_indices, controller)
    seen = []
    for name in ("backup_from_device_all_layer", "load_to_device_per_layer"):
        def spy(device_pool, host_indices, device_indices, *args, _original=getattr(host, name), _name=name, **kw):
            seen.append((_name, host_indices.clone(), device_indices.clone()))
            return _original(device_pool, host_indices, device_indices, *args, **kw)
        setattr(host, name, spy)
    req_to_token = torch.zeros(1, 32, dtype=torch.int32)
    req_to_token[0, :12] = torch.arange(3, 15, dtype=torch.int32)
    slots = req_to_token[0, :12].to(torch.int64)
    want = [(_bits(device.k_buffer[l][slots]).clone(), _bits(device.v_buffer[l][slots]).clone())
            for l in range(LAYERS)]
    free = list(range(40, 60))
    parking = FullKVParking(device.get_key_buffer, device.get_value_buffer, LAYERS, req_to_token,
                            lambda n: torch.tensor([free.pop() for _ in range(n)]), free.extend,
                            host_pool=parking_host_pool(SimpleNamespace(cache_controller=controller), device))
    parking.park("a", 0, 0, 12)
    parking.load_now("a", 0)
    back = req_to_token[0, :12].to(torch.int64)
    for l in range(LAYERS):
        assert torch.equal(_bits(device.k_buffer[l][back]), want[l][0])
        assert torch.equal(_bits(device.v_buffer[l][back]), want[l][1])
    assert [name for name, _, _ in seen] == ["backup_from_device_all_layer"] + ["load_to_device_per_layer"] * LAYERS
    for name, host_indices, device_indices in seen:
        assert torch.equal(host_indices, host_indices.sort().values), f"{name} got host indices out of host order"
        assert device_indices.device.type == "cpu"


def test_a_staged_page_first_write_back_keeps_its_host_indices_on_the_host():
    """SGLang's write path leaves CPU host indices to a page_first pool's staged write-back
    kernel (it copies them itself) and places them for every other copy; so does the parking."""
    from types import SimpleNamespace

    from sgl_vericache.sglang.hicache import index_placement

    moved = []
    controller = SimpleNamespace(io_backend="kernel", move_indices=lambda h, d: moved.append(h) or (h + 100, d))
    pool = SimpleNamespace(layout="page_first", can_use_write_back_jit=True)
    backup, load = index_placement(controller, pool)
    h, d = torch.arange(4), torch.arange(4)
    assert backup(h, d)[0] is h and moved == []
    assert torch.equal(load(h, d)[0], h + 100) and len(moved) == 1
    pool.can_use_write_back_jit = False
    assert torch.equal(backup(h, d)[0], h + 100) and len(moved) == 2
    pool.layout, pool.can_use_write_back_jit = "layer_first", True
    assert torch.equal(backup(h, d)[0], h + 100)


def test_unsupported_layout_on_cpu_is_refused(cpu_hicache):
    with pytest.raises(ValueError, match="page_first_direct.*layer_first or page_first"):
        _pools("page_first_direct", page_size=4)


class MooncakeMaster:
    """``mooncake_master`` (from the ``tiers`` extra) on loopback free ports, TCP transport;
    engines and stores are its clients with ``extra_config``. Started detached (not a child
    of this process): SGLang's Engine.shutdown() kills every child of its caller."""

    def __init__(self, tmp_path):
        import shlex
        import shutil
        import subprocess
        import time

        from conftest import free_port

        binary = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
        if binary is None:
            pytest.fail("mooncake_master not found next to the interpreter: run scripts/setup.sh (tiers extra)")
        self.port = free_port()
        self.log_path = tmp_path / "mooncake_master.log"
        cmd = [binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", f"--metrics_port={free_port()}",
               "--enable_http_metadata_server=false"]
        launcher = f"setsid {shlex.join(cmd)} > {shlex.quote(str(self.log_path))} 2>&1 < /dev/null & echo $!"
        self.pid = int(subprocess.run(["bash", "-c", launcher], capture_output=True, text=True, check=True).stdout)
        deadline = time.monotonic() + 60
        while not _port_open(self.port):
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mooncake_master did not come up:\n{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)

    def extra_config(self, segment_bytes: int = 256 << 20) -> dict:
        return {"master_server_address": f"127.0.0.1:{self.port}", "protocol": "tcp",
                "metadata_server": "P2PHANDSHAKE", "global_segment_size": segment_bytes,
                "local_hostname": "127.0.0.1"}

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self):
        import signal
        import time

        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            if not self.alive():
                return
            os.kill(self.pid, sig)
            deadline = time.monotonic() + wait
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def mooncake_installed() -> bool:
    """Whether Mooncake's package is installed (scripts/setup.sh installs it, the ``tiers``
    extra): then its tests must run, and a store that does not import fails them."""
    from importlib import metadata

    try:
        metadata.distribution("mooncake-transfer-engine-non-cuda")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # libibverbs.so.1 missing, or the tiers extra not installed
        if mooncake_installed():
            pytest.fail(f"Mooncake is installed but its store does not import ({e}); run scripts/setup.sh "
                        "(it installs libibverbs1 as root)")
        pytest.skip(f"Mooncake is not installed (the tiers extra of scripts/setup.sh): {e}")
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    yield master
    assert master.alive(), "mooncake_master died during the tests"
    master.stop()


def _storage_config(extra_config):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="m", extra_config=extra_config)


def test_host_mooncake_host_round_trip_is_bit_identical(cpu_hicache, mooncake_master):
    """A real Mooncake store (master on loopback, TCP): pages of a CPU host pool put through
    SGLang's MooncakeStore and read back into other host slots are bit-identical."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    device, host = _pools("page_first", page_size=4)
    src = torch.arange(8, 16)
    slots = host.alloc(len(src))
    host.backup_from_device_all_layer(device, slots, src, "kernel")
    store = MooncakeStore(_storage_config(mooncake_master.extra_config(64 << 20)), host)
    store.register_mem_pool_host(host)
    keys = ["round-trip-a", "round-trip-b"]
    assert store.batch_set_v1(keys, slots) == [True, True]
    assert store.batch_exists(keys + ["round-trip-c"]) == 2
    other = host.alloc(len(src))
    assert store.batch_get_v1(keys, other) == [True, True]
    dst = torch.arange(40, 48)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, other, dst, layer, "kernel")
        assert torch.equal(_bits(device.k_buffer[layer][dst]), _bits(device.k_buffer[layer][src]))
        assert torch.equal(_bits(device.v_buffer[layer][dst]), _bits(device.v_buffer[layer][src]))


# --- end to end ---------------------------------------------------------------------------

ENGINE_KW = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, dtype="float32",
                 log_level="warning", sleep_on_idle=True)
TIERS_KW = dict(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_io_backend="kernel",
                hicache_mem_layout="page_first", hicache_storage_backend="file",
                hicache_storage_prefetch_policy="wait_complete")
CONVERSATIONS, ROUNDS, NEW_TOKENS = 3, 3, 16


def _engine(model_path, **kw):
    import os

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.entrypoints.engine import Engine

    return Engine(model_path=str(model_path), **ENGINE_KW, **kw)


def _agent_trace(engine, tok, rounds=ROUNDS, together=False, prompts=None):
    """Three conversations (a ~420-token system prompt each), ``rounds`` rounds each, taken
    in turn: each turn's prompt is the conversation so far. With ``together`` three short
    requests follow at once (one batch, 2 x NEW_TOKENS tokens each, small enough to decode
    together in a 1024-token device pool). Returns per turn (output ids, cached_tokens_details);
    each turn's input ids are appended to ``prompts`` if given."""
    convs = [[{"role": "system", "content": f"You are assistant number {c}. " + "Answer briefly. " * 130}]
             for c in range(CONVERSATIONS)]
    turns = []

    def prompt(rnd, c, msgs):
        msgs.append({"role": "user", "content": f"Round {rnd}: one fact about the number {rnd * 7 + c}."})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        if prompts is not None:
            prompts.append(ids)
        return ids

    for rnd in range(rounds):
        for c, msgs in enumerate(convs):
            out = engine.generate(input_ids=prompt(rnd, c, msgs),
                                  sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
            turns.append((out["output_ids"], out["meta_info"].get("cached_tokens_details") or {}))
            msgs.append({"role": "assistant", "content": tok.decode(out["output_ids"], skip_special_tokens=True)})
    if together:  # short requests, so that several fit the device pool and decode together
        ids = [prompt(rounds, c, [{"role": "user", "content": f"Request {c}: list facts about {c * 11}."}])
               for c in range(CONVERSATIONS)]
        outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2 * NEW_TOKENS, "temperature": 0,
                                                               "ignore_eos": True})
        turns.extend((o["output_ids"], o["meta_info"].get("cached_tokens_details") or {}) for o in outs)
    return turns


@pytest.fixture(scope="module")
def agent_reference(default_model_path, tmp_path_factory):
    """Engine A (speculation off, a pool large enough to keep everything) answers the agent
    trace and writes every prefix through to a file tier, with page checksums on (the
    default). Returns (its turns, the file tier's directory)."""
    from transformers import AutoTokenizer

    from sgl_vericache.config import VeriCacheConfig

    tok = AutoTokenizer.from_pretrained(default_model_path)
    kv = tmp_path_factory.mktemp("tiers") / "kv"
    VeriCacheConfig().to_env()  # speculation off, but its pages carry digests
    t0 = time.monotonic()
    engine = _engine(default_model_path, max_total_tokens=4096, **TIERS_KW, file_storage_path=str(kv))
    try:
        reference = _agent_trace(engine, tok, together=True)
    finally:
        engine.shutdown()
    print(f"\nengine A (reference): {time.monotonic() - t0:.0f} s", flush=True)
    return reference, kv


SPEC_KW = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens=9, speculative_ngram_max_bfs_breadth=1,
               disable_overlap_schedule=True, max_total_tokens=1024, radix_cache_backend="vericache")


def test_multi_turn_exact_with_host_and_file_tiers(default_model_path, agent_reference, monkeypatch, capfd):
    """Then the file tier A wrote goes bad: one page file gets a bit flipped, and every
    storage call is delayed. Engine B (VERICACHE, a device pool of 1024 tokens for ~1400
    tokens of conversations) starts with an empty device and host tier: its first turns
    find their prefix in A's files (the page digests catch the corrupt page, which is
    recomputed), its later turns reload prefixes the device had to evict from the host
    tier, and it is preempted while its last three short requests decode together. B's
    token ids must equal A's."""
    from transformers import AutoTokenizer

    from sgl_vericache.config import VeriCacheConfig

    tok = AutoTokenizer.from_pretrained(default_model_path)
    reference, kv = agent_reference
    files = dict(file_storage_path=str(kv))
    # One page goes bad: the 100th A wrote, in the middle of the first conversation's first
    # prompt (~420 one-token pages, all written before the second conversation's first
    # request). B's first turn there loads up to it from the files and recomputes the rest;
    # the other conversations' first turns load their whole prefix from the files.
    pages = sorted(kv.glob("*.bin"), key=lambda path: path.stat().st_mtime_ns)
    assert len(pages) > 400, f"engine A wrote {len(pages)} pages to the file backend"
    raw = bytearray(pages[100].read_bytes())
    raw[len(raw) // 2] ^= 0x10
    pages[100].write_bytes(bytes(raw))
    capfd.readouterr()

    # VERICACHE engines use the `vericache` radix backend, which checks the tree, the device
    # allocator and the host pool at every scheduler idle point (a violation stops the engine).
    monkeypatch.setenv("VERICACHE_CHECK_INTEGRITY", "1")
    # Device budget 0 for full KV: one request verifies per iteration (with any that own no
    # KV yet); the others draft with their own KV (their prompt beyond the tree's prefix and
    # what they generated) parked in host memory, copied back while the drafts of the round
    # they verify in run.
    VeriCacheConfig(compressor="kivi4", ratio=4.0, draft_len=8, full_device_budget=0).to_env()
    t0 = time.monotonic()
    # Both read when B's scheduler starts: SGLang's storage fault injector (a random delay
    # before every storage call), and its retraction hook (a decoding request retracted
    # every 3 passes while two or more decode): preempted requests leave their KV in the
    # tree (HiCache writes it through to the host tier) and resume from it.
    with monkeypatch.context() as env:
        env.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
        env.setenv("SGLANG_TEST_RETRACT", "1")
        env.setenv("SGLANG_TEST_RETRACT_INTERVAL", "3")
        engine = _engine(default_model_path, **TIERS_KW, **files, **SPEC_KW, enable_metrics=True)
    try:
        from_files = _agent_trace(engine, tok, together=True)
        state = engine.get_server_info()["internal_states"][0]
        preempted, parked = state["vericache_preempted"], state["vericache"]
        counters = _tier_counters()
    finally:
        engine.shutdown()
    err = capfd.readouterr().err
    _report("B (corrupt, slow files; preempted)", from_files, time.monotonic() - t0, capfd)
    with capfd.disabled():
        print("engine B preempted requests kept:", preempted, "tier counters:", counters, flush=True)
        print("engine B parked full KV:", {k: v for k, v in parked.items() if k.startswith("full_kv")}, flush=True)
    first_turns = [d.get("storage", 0) for _, d in from_files[:CONVERSATIONS]]
    assert 0 < first_turns[0] < 300 and min(first_turns[1:]) > 400, first_turns
    assert sum(d.get("host", 0) for _, d in from_files[CONVERSATIONS:]) > 0
    assert len(from_files) == len(reference) == (ROUNDS + 1) * CONVERSATIONS
    assert preempted["requests"] >= 1 and preempted["kept_tokens"] > 0, preempted
    # what was parked while a request only drafted was loaded back for its verify
    assert parked["full_kv_loaded_tokens"] == parked["full_kv_parked_tokens"] > 0, parked
    assert parked["full_kv_bytes_to_device"] == parked["full_kv_bytes_to_host"] > 0, parked
    assert parked["full_kv_parks_in_host_pool"] > 0, parked  # HiCache's host pool holds them
    assert "does not match its digest (corrupt)" in err
    assert counters.get("vericache:tier_pages_corrupt", 0) == 1, counters
    assert counters.get("vericache:tier_pages_read", 0) > 0, counters
    # SGLang's own per-tier byte counters work on this CPU path too (device -> host backups,
    # host -> device loads for the turns that hit the host tier)
    assert counters.get("sglang:hicache_backup_bytes", 0) > 0, counters
    assert counters.get("sglang:load_back_bytes", 0) > 0, counters
    assert counters.get("vericache:full_kv_load_seconds", 0) > 0, counters
    _check_identical(from_files, reference)


def test_multi_turn_exact_with_mooncake_tier(default_model_path, agent_reference, mooncake_master, capfd):
    """Engine C (VERICACHE, streamingllm, Mooncake as the remote tier) answers A's trace from
    its device and host tiers, then has both flushed and answers the first turns again,
    loading their prefixes back from Mooncake. C's token ids must equal A's."""
    from transformers import AutoTokenizer

    from sgl_vericache.config import VeriCacheConfig

    tok = AutoTokenizer.from_pretrained(default_model_path)
    reference, _ = agent_reference
    VeriCacheConfig(compressor="streamingllm", ratio=4.0, draft_len=8).to_env()
    # A host tier twice the device pool: HiCache keeps a host copy of every device page, so
    # with host == device no host room is left to prefetch into and storage hits are deferred
    # ("host_capacity"; measured: 2238 of 2709 hit tokens deferred, most turns recomputed).
    mooncake = {**TIERS_KW, "hicache_ratio": 2.0, "hicache_storage_backend": "mooncake",
                "hicache_storage_backend_extra_config": json.dumps(mooncake_master.extra_config())}
    t0 = time.monotonic()
    engine = _engine(default_model_path, **mooncake, **SPEC_KW)
    try:
        prompts = []
        from_mooncake = _agent_trace(engine, tok, prompts=prompts)
        t1 = time.monotonic()
        _flush(engine)  # device and host tiers emptied; Mooncake keeps every page written through
        again = [engine.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
                 for ids in prompts[:CONVERSATIONS]]
        again = [(o["output_ids"], o["meta_info"].get("cached_tokens_details") or {}) for o in again]
    finally:
        engine.shutdown()
    _report("C (mooncake)", from_mooncake, t1 - t0, capfd)
    _report("C after flush", again, time.monotonic() - t1, capfd)
    assert sum(d.get("host", 0) for _, d in from_mooncake) > 0
    assert min(d.get("storage", 0) for _, d in again) > 400, again  # each first prompt's prefix from Mooncake
    _check_identical(from_mooncake, reference)
    _check_identical(again, reference[:CONVERSATIONS])


def _flush(engine, timeout_s=60):
    """``flush_cache`` once the scheduler is idle (it refuses while HiCache work is pending)."""
    deadline = time.monotonic() + timeout_s
    while not engine.flush_cache().success:
        assert time.monotonic() < deadline, "flush_cache kept failing"
        time.sleep(0.5)


def _tier_counters() -> dict:
    """The ``vericache:tier_*`` counters and SGLang's HiCache byte counters as the engine's
    /metrics would show them (SGLang's Prometheus multiprocess directory, summed over
    processes and labels)."""
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    out = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.startswith(("vericache:tier_", "vericache:full_kv_load", "sglang:hicache_backup_bytes", "sglang:load_back_bytes",
                                       "sglang:backuped_tokens", "sglang:prefetched_tokens")) \
                    and sample.name.endswith("_total"):
                out[sample.name[:-len("_total")]] = out.get(sample.name[:-len("_total")], 0) + sample.value
    return out


def _report(name, turns, seconds, capfd):
    with capfd.disabled():
        print(f"\nengine {name}: {seconds:.0f} s; cached tokens per turn (device/host/storage):",
              [(d.get("device", 0), d.get("host", 0), d.get("storage", 0)) for _, d in turns], flush=True)


def _check_identical(ours, reference):
    failures = [f"turn {i}: ours {o[:8]}... vs reference {r[:8]}..."
                for i, ((o, _), (r, _)) in enumerate(zip(ours, reference)) if o != r]
    assert not failures, "\n".join(failures)
