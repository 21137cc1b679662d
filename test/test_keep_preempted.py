"""The keep-preempted-KV hook on SGLang's ``release_req`` (no engine): which releases
insert the request's KV into the tree first, and that the release itself still runs.
The engine-level check (preempted requests resume exact, with kept tokens counted) is in
test_exactness.py."""

from types import SimpleNamespace

import pytest


class FakeTree:
    def __init__(self, sharing=True, mamba=False):
        self.sharing, self.mamba, self.checkpoints = sharing, mamba, []

    def supports_prefix_sharing(self):
        return self.sharing

    def supports_mamba(self):
        return self.mamba

    def checkpoint(self, req, *, up_to):
        self.checkpoints.append((req.rid, up_to))
        req.kv.cache_protected_len = up_to


class FakeReq:
    def __init__(self, finished=False, holds_kv=True, skip=False, session_id=None):
        self.rid, self._finished, self.skip_radix_cache_insert, self.session_id = "r", finished, skip, session_id
        self.kv = SimpleNamespace(holds_kv=holds_kv, cache_protected_len=100)
        self.refreshed = False

    def finished(self):
        return self._finished

    def refresh_fill_ids(self):
        self.refreshed = True

    def owned_kv_len(self):
        return 130


@pytest.fixture
def hook(monkeypatch):
    """SGLang's release_req replaced by a recorder, then wrapped by the hook."""
    from sglang.srt import runtime_context
    from sglang.srt.managers import schedule_batch

    from sgl_vericache.sglang.runtime import Runtime
    from sgl_vericache.sglang.scheduler import install_keep_preempted_kv

    released = []
    mode = {"value": "null"}

    def recorder(**kwargs):
        released.append(kwargs)
        return True

    monkeypatch.setattr(schedule_batch, "release_req", recorder)
    monkeypatch.setattr(runtime_context, "get_disagg", lambda: SimpleNamespace(disaggregation_mode=mode["value"]))
    runtime = Runtime()
    install_keep_preempted_kv(runtime)
    assert schedule_batch.release_req is not recorder
    return SimpleNamespace(release=schedule_batch.release_req, released=released, mode=mode, runtime=runtime,
                           install=lambda: install_keep_preempted_kv(runtime))


def _release(hook, req, tree, **kw):
    assert hook.release(req=req, tree_cache=tree, remaing_req_count=1, req_to_token_pool=None,
                        token_to_kv_pool_allocator=None, **kw) is True
    assert hook.released[-1]["req"] is req and hook.released[-1]["tree_cache"] is tree  # SGLang's release ran


def test_a_retracted_request_is_checkpointed_before_its_release(hook):
    req, tree = FakeReq(), FakeTree()
    _release(hook, req, tree, hisparse_coordinator=None)
    assert tree.checkpoints == [("r", 130)] and req.refreshed
    assert (hook.runtime.preempted_requests, hook.runtime.preempted_kept_tokens) == (1, 30)  # tokens 100..130
    assert hook.released[-1]["offload_kv"] is True


@pytest.mark.parametrize("why, req, tree, kw, mode", [
    ("finished: its release inserts it itself", FakeReq(finished=True), FakeTree(), {}, "null"),
    ("aborts and recompute paths pass offload_kv=False", FakeReq(), FakeTree(), {"offload_kv": False}, "null"),
    ("PD decode: SGLang backs the KV up itself", FakeReq(), FakeTree(), {}, "decode"),
    ("no KV held", FakeReq(holds_kv=False), FakeTree(), {}, "null"),
    ("barred from the tree", FakeReq(skip=True), FakeTree(), {}, "null"),
    ("streaming session", FakeReq(session_id="s"), FakeTree(), {}, "null"),
    ("no prefix sharing (radix cache off)", FakeReq(), FakeTree(sharing=False), {}, "null"),
    ("mamba tree", FakeReq(), FakeTree(mamba=True), {}, "null"),
    ("hisparse", FakeReq(), FakeTree(), {"hisparse_coordinator": object()}, "null"),
])
def test_other_releases_are_left_to_sglang(hook, why, req, tree, kw, mode):
    hook.mode["value"] = mode
    _release(hook, req, tree, **kw)
    assert tree.checkpoints == [], why
    assert (hook.runtime.preempted_requests, hook.runtime.preempted_kept_tokens) == (0, 0), why


def test_installing_twice_wraps_once(hook):
    from sglang.srt.managers import schedule_batch

    wrapped = schedule_batch.release_req
    hook.install()
    assert schedule_batch.release_req is wrapped
