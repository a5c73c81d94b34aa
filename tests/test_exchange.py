"""Weight versions in the exchange directory (train/rl/exchange.py): pruning around a version written
again at a resume, what a resume removes, one read of a version's bytes, and what is on disk before a
version counts as complete."""
from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import torch

from train.rl import exchange as ex


def _sd(x: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), float(x))}


def test_pruning_keeps_the_version_written_and_the_newest_below_it(tmp_path):
    """Of the versions below the one written, the newest ``keep - 1`` stay; higher ones (a run resumed from
    an older checkpoint writes its versions again) are left alone, and the version written is never pruned."""
    for v in range(1, 6):
        ex.publish_version(tmp_path, v, _sd(v))
    assert ex.complete_versions(tmp_path) == [3, 4, 5]
    ex.publish_version(tmp_path, 4, _sd(44))  # the trainer resumed after update 3
    assert ex.complete_versions(tmp_path) == [3, 4, 5] and ex.load_version(tmp_path, 4)[1]["w"].tolist() == [44.0] * 2
    ex.publish_version(tmp_path, 1, _sd(11), keep=1)
    assert ex.complete_versions(tmp_path) == [1, 3, 4, 5]


def test_clear_after_removes_what_the_ranks_did_past_a_resume(tmp_path):
    """A resume at update 12 of a run with 2 SFT updates (RL version v = update v + 2): metrics of updates
    12 on, RL versions after 10 (and their temporaries), SFT versions after 12; with checkpoints and batches
    named, checkpoints after 12 and batches of 12 on; at update 0 every checkpoint."""
    for sub, names in (("metrics", ["step-000011.json", "step-000012.json", "step-000013.json"]),
                       ("batches", ["step-000011.pt", "step-000012.pt"]),
                       ("weights", ["v000010", "v000011", "v000011.tmp77", "notes"]),
                       ("sft/weights", ["v000001"]), ("trainer_ckpt", ["step-000012", "step-000013"])):
        for n in names:
            (tmp_path / sub / n).mkdir(parents=True)
    left = lambda sub: sorted(p.name for p in (tmp_path / sub).iterdir())  # noqa: E731
    ex.clear_after(tmp_path, 12, sft_steps=2)
    assert left("metrics") == ["step-000011.json"] and left("weights") == ["notes", "v000010"]
    assert left("sft/weights") == ["v000001"] and len(left("batches")) == 2 and len(left("trainer_ckpt")) == 2
    ex.clear_after(tmp_path, 12, 2, ("trainer_ckpt", "batches"))
    assert left("trainer_ckpt") == ["step-000012"] and left("batches") == ["step-000011.pt"]
    ex.clear_after(tmp_path, 1, 2)  # inside SFT: no RL version exists yet
    assert left("weights") == ["notes"] and left("sft/weights") == ["v000001"]
    ex.clear_after(tmp_path, 0, 2, ("trainer_ckpt",))
    assert left("trainer_ckpt") == []


def test_the_bytes_loaded_are_the_bytes_verified(tmp_path, monkeypatch):
    """A version published again under the same number (v0 after the SFT warm-up) right after its checksum
    was taken: the file loaded then is not the one verified, so the version is read again (the new one,
    verified), never the new file unverified."""
    ex.publish_version(tmp_path, 0, _sd(0))

    class Sha256:  # hashes as sha256; once a digest is taken, the version is published again
        def __init__(self, *data):
            self.h = hashlib.sha256(*data)

        def update(self, data):
            self.h.update(data)

        def hexdigest(self):
            monkeypatch.setattr(ex, "hashlib", hashlib)
            ex.publish_version(tmp_path, 0, _sd(9))
            return self.h.hexdigest()

    monkeypatch.setattr(ex, "hashlib", SimpleNamespace(sha256=Sha256))
    reads = []
    read = ex._read_version
    monkeypatch.setattr(ex, "_read_version", lambda *a: reads.append(1) or read(*a))
    assert ex.load_version(tmp_path, 0)[1]["w"].tolist() == [9.0, 9.0] and len(reads) == 2


def test_a_reader_arriving_while_a_version_is_published_again_gets_the_new_one(tmp_path, monkeypatch):
    """Between the removal of the old directory and the new one's COMPLETE, a reader found no version (a
    catching-up server's load answered 400 and it left the pool): it reads again until the version settles."""
    import threading
    import time

    ex.publish_version(tmp_path, 0, _sd(0))
    replace, removed = os.replace, threading.Event()

    def slow_replace(src, dst):  # the new directory renamed into place 0.3 s after the old one was removed
        removed.set()
        time.sleep(0.3)
        replace(src, dst)

    monkeypatch.setattr(ex.os, "replace", slow_replace)
    publishing = threading.Thread(target=ex.publish_version, args=(tmp_path, 0, _sd(9)))
    publishing.start()
    removed.wait(10)
    try:
        assert ex.load_version(tmp_path, 0)[1]["w"].tolist() == [9.0, 9.0]
    finally:
        publishing.join()
    (ex.version_dir(tmp_path, 0) / ex.COMPLETE).unlink()
    t0 = time.monotonic()
    try:
        ex.load_version(tmp_path, 0)
        raise AssertionError("an incomplete version was loaded")
    except ex.WeightVersionError as e:
        assert "not complete" in str(e) and time.monotonic() - t0 < 5


def test_a_version_is_on_disk_before_it_counts_as_complete(tmp_path, monkeypatch):
    """Its files and directory are fsynced before the rename that makes it a version, COMPLETE arrives by a
    rename of a synced file, and the weights directory is synced after (a crash leaves the old state or
    the new one)."""
    tmp_path, events = tmp_path.resolve(), []  # (paths as /proc names them)
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), replace(a, b))[1])
    final = ex.publish_version(tmp_path, 3, _sd(3)).resolve()
    tmp = next(e[1] for e in events if e[0] == "replace" and e[2] == str(final))
    at = events.index(("replace", tmp, str(final)))
    assert {("fsync", f"{tmp}/{n}") for n in (ex.WEIGHTS_FILE, ex.MANIFEST)} | {("fsync", tmp)} <= set(events[:at])
    done = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final / ex.COMPLETE))
    assert events[done - 1] == ("fsync", events[done][1]) and ("fsync", str(final.parent)) in events[done:]
    assert ex.complete_versions(tmp_path) == [3]


def test_the_version_the_servers_serve_is_never_pruned(tmp_path):
    """The trainer ranks publish at every sync and at every checkpoint (which the servers never take): with
    rl.sync_every=4 and checkpoint_every=1 the served version was pruned three checkpoints later, and a server
    restarted then had nothing to catch up to (it rejoined on the stage's start weights, or not at all)."""
    for v in range(2):
        ex.publish_version(tmp_path, v, _sd(v))
    ex.pin_serving(tmp_path, 1)
    for v in range(2, 7):
        ex.publish_version(tmp_path, v, _sd(v))
    assert ex.complete_versions(tmp_path) == [1, 4, 5, 6] and ex.serving_version(tmp_path) == 1
    assert ex.load_version(tmp_path, 1)[1]["w"].eq(1).all()
    ex.pin_serving(tmp_path, 6)  # the servers moved on: the old one goes with the next prune
    ex.publish_version(tmp_path, 7, _sd(7))
    assert ex.complete_versions(tmp_path) == [5, 6, 7]


def test_a_refused_resume_removes_nothing_the_ranks_wrote(tmp_path):
    """The orchestrator resumes after update 1 and the ranks have checkpoints of updates 2 and 3 only: the
    learner refuses to start, and the exchange is as it was (it cleared what the ranks did past update 1 first,
    their checkpoints 2 and 3 with it, then refused: a run that could have gone on from 2 had nothing left)."""
    import pytest

    from cascade.config import Trainer
    from cascade.learner import WorkerLearner

    ex_dir = tmp_path / "exchange"
    for sub, names in (("trainer_ckpt", ["step-000002", "step-000003"]), ("weights", ["v000002", "v000003"]),
                       ("metrics", ["step-000002.json"]), ("ckpt_requests", ["step-000003"])):
        for n in names:
            (ex_dir / sub / n).mkdir(parents=True)
            (ex_dir / sub / n / "COMPLETE").write_text("ok\n")
    (ex_dir / "STOP").write_text("")
    before = sorted(str(p.relative_to(ex_dir)) for p in ex_dir.rglob("*"))
    assert len(before) == 1 + 4 + 6 * 2  # STOP, 4 subdirectories, 6 directories each with its COMPLETE
    with pytest.raises(ValueError, match=r"cannot resume: the orchestrator's checkpoint is after update 1 but the "
                                         r"trainer ranks have no complete checkpoint of it"):
        WorkerLearner(ex_dir, tmp_path / "model", Trainer(nproc=2), SimpleNamespace(), 5, 1, tmp_path / "logs")
    assert sorted(str(p.relative_to(ex_dir)) for p in ex_dir.rglob("*")) == before
    assert not (tmp_path / "logs").exists()


def test_a_relative_run_directory_loads_its_versions(tmp_path, monkeypatch):
    """``cascade serve --weights-dir RUN/exchange`` as the README writes it (relative): the version path built
    from the relative root was joined onto it a second time and every load was refused as outside the run."""
    monkeypatch.chdir(tmp_path)
    ex.publish_version("run/exchange", 1, _sd(1))
    assert ex.load_version("run/exchange", 1)[0] == 1 and ex.load_version("run/exchange")[0] == 1
    assert ex.load_version("run/exchange", path="v000001")[0] == 1


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_batch_file_is_read_as_data_never_run_as_code(tmp_path, monkeypatch):
    """A batch round-trips (routing tensor, meta and all), and a file holding a pickled object that would run
    code when loaded (written by anyone who can write to the exchange directory) is refused without running it."""
    monkeypatch.chdir(tmp_path)
    s = ex.TrainSample([1, 2], [3], [-0.5], 1.0, versions=[0], routed_experts=torch.zeros(3, 1, 2, dtype=torch.int16))
    ex.write_batch(tmp_path, ex.TrainBatch(4, [s], 0.7, {"kind": "rl", "schedule_step": 4}))
    b = ex.read_batch(tmp_path, 4)
    assert (b.step, b.temperature, b.meta, b.samples[0].completion_ids) == (4, 0.7, {"kind": "rl", "schedule_step": 4}, [3])
    assert torch.equal(b.samples[0].routed_experts, s.routed_experts)
    torch.save({"step": 5, "samples": [], "x": _Payload()}, ex.batch_path(tmp_path, 5))
    try:
        ex.read_batch(tmp_path, 5)
    except Exception as e:
        assert "weights_only" in str(e) or "Unsupported" in str(e), e
    else:
        raise AssertionError("a pickled object was loaded")
    assert not (tmp_path / "PWNED").exists()


def test_a_stage_starting_at_update_0_keeps_no_earlier_stages_version_0(tmp_path):
    """Every stage of a run shares OUT/exchange: a later stage starting at update 0 finds the earlier stage's
    version 0 (RL and SFT), which the ranks would not publish again at a checkpoint before the first update
    (`already published`), so the orchestrator loaded the earlier stage's start weights into its policy. They
    go at update 0, but for the version the orchestrator published for this stage's servers (pinned; with SFT
    steps every RL version goes, as before: version 0 is the one published after them)."""
    ex.publish_version(tmp_path, 0, _sd(1))
    ex.publish_version(tmp_path / "sft", 0, _sd(2))
    ex.clear_after(tmp_path, 0, 0)
    assert ex.complete_versions(tmp_path) == [] and ex.complete_versions(tmp_path / "sft") == []
    ex.publish_version(tmp_path, 0, _sd(3))
    ex.pin_serving(tmp_path, 0)
    ex.clear_after(tmp_path, 0, 0)
    assert ex.complete_versions(tmp_path) == [0] and ex.load_version(tmp_path, 0)[1]["w"].tolist() == [3.0] * 2
    ex.clear_after(tmp_path, 1, 0)  # past update 0: version 0 is this stage's
    assert ex.complete_versions(tmp_path) == [0]


def test_a_load_request_names_one_non_negative_version_or_a_path():
    """The body of ``POST /v1/load_weights``: a version (an int >= 0, never a bool) or a path (a string), not
    both, not neither; with ``broadcast`` a version is needed and a path is ignored."""
    import pytest

    assert ex.load_request({"version": 0}) == (0, None) and ex.load_request({"path": "v000003"}) == (None, "v000003")
    assert ex.load_request({"version": 4, "broadcast": {}}) == (4, None)
    assert ex.load_request({"version": 4, "path": "v000001", "broadcast": {}}) == (4, None)
    for body, msg in [({"version": -1}, "non-negative int"), ({"version": True}, "non-negative int"),
                      ({"version": 1.0}, "non-negative int"), ({"path": 5}, "path must be a string"),
                      ({"path": None}, "exactly one"), ({"broadcast": {}}, "non-negative int"),
                      ({"broadcast": {}, "version": -2}, "non-negative int"), ({"version": 1, "path": "v1"}, "exactly one")]:
        with pytest.raises(ValueError, match=msg):
            ex.load_request(body)


def test_a_sample_refuses_per_token_lists_of_another_length_and_a_batch_keeps_its_temperature(tmp_path):
    """Log-probs and versions come one per completion token; a sample with no completion (or not kept) is not
    trained; a batch without a temperature reads as 1.0; a step not written yet reads as None."""
    import pytest

    with pytest.raises(ValueError, match="2 logprobs for 1 completion tokens"):
        ex.TrainSample([1], [2], [-0.1, -0.2], 0.5)
    with pytest.raises(ValueError, match="2 versions for 1 completion tokens"):
        ex.TrainSample([1], [2], [-0.1], 0.5, versions=[0, 1])
    assert ex.TrainSample([1], [2], [-0.1], 0.5).trained
    assert not ex.TrainSample([1], [], [], 0.5).trained and not ex.TrainSample([1], [2], [-0.1], 0.5, keep=False).trained
    b = ex.TrainBatch.from_dict({"step": "3", "samples": [{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1.0],
                                                            "advantage": 0.0}]})
    assert (b.step, b.temperature, b.meta, b.num_tokens) == (3, 1.0, {}, 2)
    assert ex.read_batch(tmp_path, 3) is None
    ex.write_batch(tmp_path, b)
    assert ex.read_batch(tmp_path, 3).samples[0].completion_ids == [2] and ex.read_batch(tmp_path, 4) is None


def test_routing_that_is_not_int16_ids_of_three_dimensions_is_refused():
    """decode_routing takes encode_routing's dict (int16 only, a [T, layers, k] shape its bytes fill) or a nested
    list of three levels; anything else is a ValueError, never a tensor of another shape or type."""
    import pytest

    r = torch.arange(12, dtype=torch.int16).reshape(2, 3, 2)
    enc = ex.encode_routing(r)
    assert torch.equal(ex.decode_routing(enc), r) and torch.equal(ex.decode_routing(r.tolist()), r)
    with pytest.raises(ValueError, match="dtype 'int32' is not int16"):
        ex.decode_routing(dict(enc, dtype="int32"))
    with pytest.raises(ValueError, match="not an int16 array of shape"):
        ex.decode_routing(dict(enc, shape=[6, 2]))  # the same 24 bytes, two dimensions
    with pytest.raises(ValueError, match="not \\[tokens, MoE layers, k\\]"):
        ex.decode_routing([[1, 2], [3, 4]])


def test_the_newest_complete_version_is_loaded_when_none_is_named(tmp_path):
    """Without a version or path, load_version takes the highest complete version: not the oldest kept, not one
    whose COMPLETE is missing (still being written)."""
    for v in (2, 5, 7):
        ex.publish_version(tmp_path, v, _sd(v))
    (ex.version_dir(tmp_path, 9) / "x").parent.mkdir(parents=True)  # a version without COMPLETE
    assert ex.complete_versions(tmp_path) == [2, 5, 7] and ex.latest_version(tmp_path) == 7
    v, sd = ex.load_version(tmp_path)
    assert v == 7 and sd["w"].tolist() == [7.0, 7.0]


def test_keep_versions_stay_and_tied_tensors_are_published(tmp_path):
    """With keep=2 the version written and the one below it stay (not one fewer); a state dict whose tensors share
    storage (tied embeddings) is written with each name's values."""
    for v in range(4):
        ex.publish_version(tmp_path, v, _sd(v), keep=2)
    assert ex.complete_versions(tmp_path) == [2, 3]
    emb = torch.arange(6.0).reshape(3, 2)
    ex.publish_version(tmp_path, 4, {"embed": emb, "lm_head": emb, "b": torch.ones(1)}, keep=2)
    sd = ex.load_version(tmp_path, 4)[1]
    assert sd["embed"].tolist() == sd["lm_head"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_only_a_version_directory_of_the_weights_directory_is_loaded_by_path(tmp_path):
    """By path, the weights directory's other entries (a version still being written under its temporary name,
    the SERVING file, anything named otherwise) are refused at once as not a weight version of this run."""
    import pytest

    ex.publish_version(tmp_path, 1, _sd(1))
    ex.pin_serving(tmp_path, 1)
    tmp = tmp_path / "weights" / "v000002.tmp77"
    import shutil

    shutil.copytree(ex.version_dir(tmp_path, 1), tmp)
    (tmp_path / "weights" / "backup").mkdir()
    for path in ("v000002.tmp77", tmp, "SERVING", "backup", "v", "1"):
        with pytest.raises(ex.WeightVersionError, match="is not a weight version of this run"):
            ex.load_version(tmp_path, path=path)
    assert ex.load_version(tmp_path, path=ex.version_dir(tmp_path, 1))[0] == 1
