"""Weight versions over a process group (train/rl/weight_group.py): the packing and checksums on a
real gloo group, and `cascade serve` subprocesses taking versions from the trainer's broadcast, one
of them killed and restarted in between (the group is formed again), the files still written."""
from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest
import torch

from cascade.rollout import ServedEngine, ServerPool
from train.engine import SamplingParams, TorchEngine
from train.rl.exchange import complete_versions
from train.rl.weight_group import Group, WeightGroupError, choose_backend, device_tag, join, plan, receive, send

KEY = "k-group"


def _group(world: int) -> list[Group]:
    """A weight group of ``world`` members in this process (threads), as the trainer and servers form it."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
    out: dict[int, Group] = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, join("127.0.0.1", store.port, r, world, "t")))
               for r in range(1, world)]
    for t in threads:
        t.start()
    out[0] = join("127.0.0.1", store.port, 0, world, "t", store=store)
    for t in threads:
        t.join()
    return [out[r] for r in range(world)]


def _broadcast(groups, sd, layout, corrupt: bool = False) -> list:
    """Rank 0 sends ``sd``; every other rank receives: [state dict or exception] per receiver."""
    got: list = [None] * (len(groups) - 1)

    def recv(i):
        try:
            got[i] = receive(groups[i + 1], layout)
        except Exception as e:  # noqa: BLE001 - returned to the test
            got[i] = e

    threads = [threading.Thread(target=recv, args=(i,)) for i in range(len(got))]
    for t in threads:
        t.start()
    if corrupt:  # one byte of the first tensor flipped on the wire: checksums taken before it
        import train.rl.weight_group as wg

        real, calls = wg.checksum, []

        def flip_after_sum(buf):
            s = real(buf)
            if not calls:
                buf[0] ^= 1
            calls.append(1)
            return s

        wg.checksum = flip_after_sum
        try:
            send(groups[0], sd, layout)
        finally:
            wg.checksum = real
    else:
        send(groups[0], sd, layout)
    for t in threads:
        t.join()
    return got


def test_packed_buckets_arrive_bit_exact_and_a_bad_checksum_is_refused():
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(33, 7, generator=g), "b16": torch.randn(5, 3, generator=g).bfloat16(),
          "ids": torch.arange(11), "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
          "empty": torch.zeros(0, 4), "h16": torch.randn(9, generator=g).half()}
    sd["tied"] = sd["w"]
    layout = plan(sd, bucket_bytes=512)  # several buckets
    assert len(layout["buckets"]) >= 3 and all(off % 16 == 0 for *_, off in layout["tensors"])
    groups = _group(3)
    try:
        for got in _broadcast(groups, sd, layout):
            assert set(got) == set(sd)
            for k, v in sd.items():
                assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
        for err in _broadcast(groups, sd, layout, corrupt=True):
            assert isinstance(err, WeightGroupError) and "checksum mismatch in bucket(s) [0]" in str(err)
    finally:
        for gr in groups:
            gr.close()
    for bad in ({"tensors": [], "buckets": []}, {"tensors": [["w", "float32", [4], 0, 8]], "buckets": [16]},
                {"tensors": [["w", "complex64", [1], 0, 0]], "buckets": [16]}):
        with pytest.raises(WeightGroupError):
            receive(Group(None, 1, 2, torch.device("cpu")), bad)  # refused before any collective


def _perturbed(model_dir, seed):
    eng = TorchEngine.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in eng.model.state_dict().items()}


def _reference(model_dir, sd, prompts, sp):
    eng = TorchEngine.from_pretrained(model_dir)
    eng.model.load_state_dict(sd)
    return [c.token_ids for c in eng.generate(prompts, sp)]


def test_servers_take_broadcast_versions_and_a_restarted_one_rejoins(tiny_moe_dir, tmp_path):
    exchange = tmp_path / "exchange"
    exchange.mkdir()
    pool = ServerPool(2, tiny_moe_dir, exchange, KEY, 1, tmp_path / "logs")
    eng = ServedEngine(pool.urls, exchange, KEY, pool, transport="broadcast")
    prompts, sp = [[5, 17, 33, 2], [120, 4, 8], [9, 31, 64]], SamplingParams(temperature=0.0, max_tokens=8)
    try:
        sd1 = _perturbed(tiny_moe_dir, 1)
        eng.load_weights(sd1, version=1)
        assert eng.broadcast_failures == 0 and eng.broadcaster.formed == 1
        for u in pool.urls:
            assert eng.remote._conn(u).call("GET", "/v1/weights")["version"] == 1
        out = eng.generate(prompts, sp)
        assert [c.token_ids for c in out] == _reference(tiny_moe_dir, sd1, prompts, sp)
        assert {v for c in out for v in c.versions} == {1}
        eng.wait_published()  # the durable record is written behind the broadcast
        assert complete_versions(exchange) == [1]
        os.kill(pool.procs[pool.urls[0]].pid, signal.SIGKILL)  # restarted by the pool, catching up from files
        pool.procs[pool.urls[0]].wait()
        assert [c.token_ids for c in eng.generate(prompts * 4, sp)] == _reference(tiny_moe_dir, sd1, prompts, sp) * 4
        assert pool.restarts == 1
        sd2 = _perturbed(tiny_moe_dir, 2)
        eng.load_weights(sd2, version=2)
        assert eng.broadcast_failures == 0 and eng.broadcaster.formed == 2, (pool.urls, {u: p.poll() for u, p in pool.procs.items()})
        out = eng.generate(prompts * 4, sp)
        assert [c.token_ids for c in out] == _reference(tiny_moe_dir, sd2, prompts, sp) * 4
        assert {v for c in out for v in c.versions} == {2}
        assert pool.restarts == 1 and all(p.poll() is None for p in pool.procs.values())  # the restarted one lives on
        # a server that cannot read the run's files (another host): restarted, it takes the newest version
        # over a group formed with it alone
        eng.wait_published()
        shutil.rmtree(exchange / "weights")
        os.kill(pool.procs[pool.urls[1]].pid, signal.SIGKILL)
        pool.procs[pool.urls[1]].wait()
        out = eng.generate(prompts * 4, sp)
        assert [c.token_ids for c in out] == _reference(tiny_moe_dir, sd2, prompts, sp) * 4
        assert {v for c in out for v in c.versions} == {2} and pool.restarts == 2 and eng.broadcaster.formed == 3
        assert eng.remote._conn(pool.urls[1]).call("GET", "/v1/weights")["version"] == 2
    finally:
        eng.close()


def test_weights_group_requests_are_checked(tiny_moe_dir, tmp_path):
    """Joining needs the key and weight loading on; a malformed body, or a broadcast load before any
    group, is a one-line 400 and the server keeps serving version 0."""
    from tests.test_rollout_server import call
    from train.engine.server import serve_in_thread

    srv, url = serve_in_thread(TorchEngine.from_pretrained(tiny_moe_dir), api_key="k", weights_dir=tmp_path)
    off, url_off = serve_in_thread(TorchEngine.from_pretrained(tiny_moe_dir), api_key="k")
    try:
        good = {"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2, "name": "x"}
        assert call(url, "/v1/weights_group", good, key="wrong")[0] == 401
        assert call(url_off, "/v1/weights_group", good, key="k")[0] == 403
        for bad in ({}, {**good, "rank": 0}, {**good, "rank": 2}, {**good, "port": "1"}, {**good, "timeout_s": -1},
                    {**good, "backend": "mpi"}):
            code, obj = call(url, "/v1/weights_group", bad, key="k")
            assert code == 400 and "weights_group needs" in obj["error"]["message"], (bad, obj)
        layout = plan({"w": torch.zeros(3)})
        code, obj = call(url, "/v1/load_weights", {"version": 1, "broadcast": layout}, key="k")
        assert code == 400 and "has not joined a weight group" in obj["error"]["message"]
        assert call(url, "/v1/weights", key="k")[1]["version"] == 0
    finally:
        for s in (srv, off):
            s.shutdown()
            s.server_close()


def test_rank_0_chooses_one_backend_for_every_member():
    """NCCL only when every member, the trainer included, has a GPU of its own; a CPU member, one that
    did not say (an older server), or two members on one GPU (NCCL refuses them) give gloo, whose
    buffers stay on CPU whatever the member's device."""
    a, b = "cuda:GPU-aaaa", "cuda:GPU-bbbb"
    assert choose_backend(a, [b]) == "nccl"
    assert choose_backend(a, [b, "cuda:GPU-cccc"]) == "nccl"
    assert choose_backend(a, [a]) == "gloo"          # a server on the trainer's GPU
    assert choose_backend(a, [b, b]) == "gloo"       # two workers on one GPU
    assert choose_backend("cpu", [b]) == "gloo"      # a CPU trainer feeding GPU servers
    assert choose_backend(a, ["cpu"]) == "gloo"
    assert choose_backend(a, ["?"]) == "gloo"
    assert device_tag("cpu") == device_tag(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="backend must be one of"):
        join("127.0.0.1", 1, 1, 2, "x", backend="mpi")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        join("127.0.0.1", 1, 1, 2, "x", device="cpu", backend="nccl", store=object())


@pytest.mark.parametrize("user", [None, "1"])
def test_an_nccl_group_raises_on_errors_and_closes_by_abort(monkeypatch, user):
    """torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (3) ends the process on a failed or timed-out
    collective: the run's orchestrator or a server would die of one failed version. The weight group's
    ``ProcessGroupNCCL`` is built with 2 (abort and raise) unless the user set a value, which stays; the
    variable is as it was after. Closing aborts (``shutdown`` waits for kernels a dead member never ends).
    (No GPU here: a stand-in for the NCCL class records what torch's constructor would read.)"""
    import torch.distributed as dist

    seen, ended = [], []

    class FakeNCCL:
        class Options:
            pass

        def __init__(self, store, rank, world, opts):
            seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

        def abort(self):
            ended.append("abort")

        def shutdown(self):
            ended.append("shutdown")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    if user is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", user)
    g = join("127.0.0.1", 1, 0, 2, "x", device="cuda:0", backend="nccl", store=dist.HashStore())
    assert seen == [user or "2"] and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == user
    g.close()
    assert ended == ["abort"]


@pytest.mark.parametrize("checked", [True, False], ids=["found-before", "mid-collective"])
def test_a_member_gone_since_the_last_version_costs_no_group_timeout(tiny_moe_dir, tmp_path, monkeypatch, checked):
    """Servers by URL, weights by broadcast with a 300 s group timeout. One is killed between two
    versions: the next version finds it down before any collective (the survivor is not left receiving
    until the timeout), goes by files, and the one after by broadcast to the survivor alone. The survivor
    is then killed and started again at its URL with no request noticing: the next version finds a new
    process there (its ``instance``), not the group's member, and goes by files to it. Without that check
    (``mid-collective``: as when a member dies during a transfer) the collective fails on the dead member,
    and rank 0 closes the group and tells the others to give the broadcast up (``/v1/weights_group/abort``;
    a closed gloo rank 0 does not always end their receives), so they answer at once too: the same versions
    go by files, as soon."""
    import time

    import train.rl.weight_group as wg
    from tests.test_rollout_server import KEY as SERVER_KEY, _start_servers, _stop

    exchange = tmp_path / "exchange"
    exchange.mkdir()
    procs = sorted(_start_servers(tiny_moe_dir, exchange, [0, 0]), key=lambda p: p[1])  # the first is rank 1
    urls = [u for _, u in procs]
    eng = ServedEngine(urls, exchange, SERVER_KEY, transport="broadcast", group_timeout_s=300)
    sends = []
    real_send = wg.send
    monkeypatch.setattr(wg, "send", lambda group, sd, layout: (sends.append(group.world_size),
                                                               real_send(group, sd, layout)))
    if not checked:
        monkeypatch.setattr(wg.Broadcaster, "_check_members", lambda self: None)
        # rank 0's groups stay open: closing one does not always end its members' receives (gloo), so the
        # survivor is released by the abort the failed broadcast sends it, not by the close
        kept = []
        monkeypatch.setattr(wg.Group, "close", lambda self: kept.append(self))
    failed = [] if checked else [None]  # a collective started and failed: one more send

    def load(version):
        t0 = time.monotonic()
        eng.load_weights(_perturbed(tiny_moe_dir, version), version=version)
        assert time.monotonic() - t0 < 60  # far below the group's 300 s: nobody waited it out
        return {u: eng.remote._conn(u).call("GET", "/v1/weights")["version"] for u in eng.remote.alive}

    try:
        assert load(1) == {u: 1 for u in urls} and sends == [3]
        os.kill(procs[0][0].pid, signal.SIGKILL)
        procs[0][0].wait()
        assert load(2) == {urls[1]: 2} and sends == [3] + [3 for _ in failed] and eng.broadcast_failures == 1
        assert load(3) == {urls[1]: 3} and sends[-1] == 2 and eng.broadcaster.members == (urls[1],)
        os.kill(procs[1][0].pid, signal.SIGKILL)
        procs[1][0].wait()
        procs.extend(_start_servers(tiny_moe_dir, exchange, [int(urls[1].rsplit(":", 1)[1])]))
        n = len(sends)
        assert load(4) == {urls[1]: 4} and len(sends) == n + len(failed) and eng.broadcast_failures == 2
        assert load(5) == {urls[1]: 5} and len(sends) == n + len(failed) + 1 and eng.broadcast_failures == 2
    finally:
        eng.close()
        _stop(procs)


def test_a_group_that_fails_to_form_is_retried_after_doubling_waits():
    """A member that cannot join leaves the others in the rendezvous for the group's timeout: with the
    same servers, the next tries come 1, 2, 4, ... at most 32 versions later (those go by files at once);
    other servers, or a restarted one (``reform``), try at once."""
    from types import SimpleNamespace

    from train.rl.weight_group import BackingOff, Broadcaster

    b = Broadcaster(SimpleNamespace(alive={"http://a", "http://b"}))
    tries = []

    def form(urls):
        tries.append((version, urls))
        raise WeightGroupError("cannot join")

    b._form = form
    sd = {"w": torch.zeros(2)}
    for version in range(1, 140):
        with pytest.raises(WeightGroupError) as e:
            b.push(sd, version)
        assert isinstance(e.value, BackingOff) == (not tries or tries[-1][0] != version)
    assert [v for v, _ in tries] == [1, 3, 6, 11, 20, 37, 70, 103, 136]
    b.remote.alive = {"http://a"}  # a server left: at once
    with pytest.raises(WeightGroupError):
        b.push(sd, version := 140)
    with pytest.raises(BackingOff):
        b.push(sd, version := 141)
    b.reform()  # a server restarted at its URL: at once
    with pytest.raises(WeightGroupError):
        b.push(sd, version := 142)
    assert [v for v, _ in tries][-2:] == [140, 142] and tries[-1][1] == ("http://a",)


def test_a_server_that_cannot_join_costs_one_group_timeout_not_one_per_version(tiny_moe_dir, tmp_path, monkeypatch):
    """Servers by URL; one refuses to join the weight group (here: a rank it rejects). The first version
    waits out the group's timeout and goes by files; the next goes by files at once; once the server is
    back (restarted: ``reform``), versions are broadcast again."""
    import time

    from tests.test_rollout_server import KEY as SERVER_KEY, _start_servers, _stop
    from train.rl.weight_group import Broadcaster

    exchange = tmp_path / "exchange"
    exchange.mkdir()
    procs = _start_servers(tiny_moe_dir, exchange, [0, 0])
    urls = [u for _, u in procs]
    broken = {urls[1]}
    real_call = Broadcaster._call

    def call(self, url, method, path, body=None, timeout_s=None):
        if path == "/v1/weights_group" and url in broken:
            body = {**body, "rank": 99}
        return real_call(self, url, method, path, body, timeout_s)

    monkeypatch.setattr(Broadcaster, "_call", call)
    eng = ServedEngine(urls, exchange, SERVER_KEY, transport="broadcast", group_timeout_s=5)

    def load(version):
        t0 = time.monotonic()
        eng.load_weights(_perturbed(tiny_moe_dir, version), version=version)
        took = time.monotonic() - t0
        assert {eng.remote._conn(u).call("GET", "/v1/weights")["version"] for u in urls} == {version}
        return took

    try:
        assert load(1) >= 5 and eng.broadcast_failures == 1  # waited out the rendezvous once
        assert load(2) < 5 and eng.broadcast_failures == 2  # by files, no wait
        broken.clear()
        eng.broadcaster.reform()
        load(3)
        assert eng.broadcast_failures == 2 and eng.broadcaster.members == tuple(sorted(urls))
    finally:
        eng.close()
        _stop(procs)


def _formed_broadcaster(monkeypatch, send):
    """A Broadcaster whose group with servers a and b is formed (no real group or servers: ``send`` stands for
    the collective, the requests to the servers are recorded and answered)."""
    from types import SimpleNamespace

    import train.rl.weight_group as wg

    b = wg.Broadcaster(SimpleNamespace(alive=["http://a", "http://b"]))
    b.group, b.members = Group(None, 0, 3, torch.device("cpu"), "g0"), ("http://a", "http://b")
    b._instances = dict.fromkeys(b.members, "i")
    calls = []

    def call(url, method, path, body=None, timeout_s=None):
        calls.append((url, path))
        return {"version": body["version"]} if path == "/v1/load_weights" else {"instance": "i"}

    b._call = call
    monkeypatch.setattr(wg, "send", send)
    return b, calls


def _on_another_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_a_reform_during_a_push_is_for_the_next_push(monkeypatch):
    """``reform()`` (a restarted server's catch-up, on another thread) while a push is under way: the push
    still tells every member of its group to load the version, and reports what they loaded; the next push
    forms a new group (here it fails to: these stand-in servers have no group support), and with no live
    server left a reformed group is refused rather than broadcast on."""
    sent = []
    b, calls = _formed_broadcaster(monkeypatch, lambda group, sd, layout: sent.append(group.name))
    check = b._check_members
    b._check_members = lambda: (check(), _on_another_thread(b.reform))  # right after the member check
    sd = {"w": torch.ones(4)}
    assert b.push(sd, 7) == {"http://a": 7, "http://b": 7} and sent == ["g0"]
    assert [c for c in calls if c[1] == "/v1/load_weights"] == [("http://a", "/v1/load_weights"),
                                                               ("http://b", "/v1/load_weights")]
    with pytest.raises(WeightGroupError, match="without weight-group support"):
        b.push(sd, 8)
    b, calls = _formed_broadcaster(monkeypatch, lambda group, sd, layout: sent.append(group.name))
    b.reform()
    b.remote.alive = []  # every server gone
    with pytest.raises(WeightGroupError, match="no live server"):
        b.push(sd, 9)
    assert sent == ["g0"] and not calls and b.group is None


def test_a_failed_push_tells_every_member_to_give_up_despite_a_reform_meanwhile(monkeypatch):
    """A member dies mid-broadcast and its restart's catch-up calls ``reform()`` while rank 0 is still
    sending: the survivors (every member of the push's group) are told to give the broadcast up, not left
    waiting for the group's timeout."""
    def send(group, sd, layout):
        _on_another_thread(b.reform)
        raise RuntimeError("Connection reset by peer")

    b, calls = _formed_broadcaster(monkeypatch, send)
    with pytest.raises(WeightGroupError, match="Connection reset"):
        b.push({"w": torch.ones(4)}, 7)
    assert sorted(c for c in calls if c[1].endswith("/abort")) == [("http://a", "/v1/weights_group/abort"),
                                                                   ("http://b", "/v1/weights_group/abort")]


def test_plan_fills_each_bucket_up_to_its_size_and_never_leaves_one_empty():
    """Tensors go into the current bucket while they fit it exactly (16 + 16 bytes in a 32-byte bucket: one
    bucket); a tensor larger than a bucket gets one of its own, with no empty bucket before it; a state dict of
    empty tensors still travels in one 16-byte bucket (a bucket of 0 bytes would be refused)."""
    from train.rl.weight_group import _check_layout

    four = torch.zeros(4)  # 16 bytes
    assert plan({"a": four, "b": four}, bucket_bytes=32) == {
        "tensors": [["a", "float32", [4], 0, 0], ["b", "float32", [4], 0, 16]], "buckets": [32]}
    assert plan({"a": four, "b": four, "c": four}, bucket_bytes=32)["buckets"] == [32, 16]
    assert plan({"big": torch.zeros(25), "a": four}, bucket_bytes=32) == {
        "tensors": [["big", "float32", [25], 0, 0], ["a", "float32", [4], 1, 0]], "buckets": [112, 16]}
    assert plan({"e": torch.zeros(0), "big": torch.zeros(25)}, bucket_bytes=32)["buckets"] == [112]
    empty = plan({"e": torch.zeros(0, 3)})
    assert empty == {"tensors": [["e", "float32", [0, 3], 0, 0]], "buckets": [16]}
    _check_layout(empty)


def test_a_layout_that_does_not_describe_its_buckets_is_refused_before_any_collective():
    """Bucket sizes that are not positive multiples of 16 bytes, a tensor that runs past the end of its bucket,
    lies in a bucket that does not exist (a negative index too) or has a negative dimension: refused as a
    WeightGroupError before anything is received."""
    ok = {"tensors": [["w", "float32", [4], 0, 0], ["v", "int64", [2], 1, 0]], "buckets": [16, 16]}
    from train.rl.weight_group import _check_layout

    _check_layout(ok)
    for bad in ({**ok, "buckets": [16, 24]}, {**ok, "buckets": [16, True]},
                {**ok, "tensors": [["w", "float32", [5], 0, 0]]},
                {**ok, "tensors": [["w", "float32", [4], 0, 16]]},
                {**ok, "tensors": [["w", "float32", [4], 2, 0]]},
                {**ok, "tensors": [["w", "float32", [4], -1, 0]]},
                {**ok, "tensors": [["w", "float32", [-2, -2], 0, 0]]}):
        with pytest.raises(WeightGroupError):
            receive(Group(None, 1, 2, torch.device("cpu")), bad)


def test_a_join_request_needs_int_ranks_and_a_positive_timeout():
    from train.rl.weight_group import join_request

    good = {"host": "h", "port": 29500, "rank": 1, "world_size": 3, "name": "n"}
    assert join_request(good) == ("h", 29500, 1, 3, "n", 120.0, None)
    assert join_request({**good, "rank": 2, "timeout_s": 0.5, "backend": "gloo"}) == ("h", 29500, 2, 3, "n", 0.5, "gloo")
    for bad in ({**good, "timeout_s": 0}, {**good, "rank": True}, {**good, "port": True}, {**good, "world_size": 3.0},
                {**good, "host": 1}, {**good, "name": None}, {**good, "timeout_s": "x"}):
        with pytest.raises(ValueError, match="weights_group needs"):
            join_request(bad)
