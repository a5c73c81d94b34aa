"""Per-shard loading: TSP and TP ranks read only their slices of a checkpoint.

On a real 2-rank gloo group (the harness of tests/test_parallel.py), the shards that
``tsp_from_pretrained`` / ``tp_from_pretrained`` read from a saved tiny checkpoint must equal, bit for
bit, the shards cut from the full model; and every read that reaches the safetensors files is
recorded (``safe_open`` wrapped in the ranks): no sharded parameter is ever read whole, and the
elements read add up to exactly the rank's shards. Checkpoints: Qwen3 dense with tied embeddings,
Qwen3-MoE with per-expert names split over several files, the same MoE with fused expert tensors
(transformers 5's naming), Qwen2 with q/k/v biases, and ZAYA1 (CCA's convolution channels read as two
slices, the value projections' rows, the routers' balancing biases).
"""
from __future__ import annotations

import pytest
import torch

from tests.test_parallel import _cfgs, _model, spawn

WORLD = 2


def _checkpoints(root) -> dict[str, str]:
    from train.model.hf_io import save_pretrained, write_weights

    cfgs = _cfgs()
    out = {}
    for name, cfg, kw in (("dense", cfgs["dense"], {}), ("moe", cfgs["moe"], {"max_shard_size": 20_000}),
                          ("qwen2", cfgs["qwen2"], {}), ("zaya", cfgs["zaya"], {})):
        d = root / name
        save_pretrained(_model(cfg), d, **kw)
        out[name] = str(d)
    d = root / "moe_fused"  # transformers 5's fused experts on disk
    save_pretrained(_model(cfgs["moe"]), d)
    write_weights(_model(cfgs["moe"]).state_dict(), d)
    out["moe_fused"] = str(d)
    return out


class _Recorder:
    """``safe_open`` that records (key, elements read, elements of the whole tensor) for every read."""

    reads: list[tuple[str, int, int]] = []

    def __init__(self, real, *a, **k):
        self.h = real(*a, **k)

    def keys(self):
        return self.h.keys()

    def get_tensor(self, k):
        t = self.h.get_tensor(k)
        _Recorder.reads.append((k, t.numel(), t.numel()))
        return t

    def get_slice(self, k):
        sl = self.h.get_slice(k)

        class S:
            def get_shape(self):
                return sl.get_shape()

            def get_dtype(self):
                return sl.get_dtype()

            def __getitem__(self, index):
                t = sl[index]
                full = 1
                for n in sl.get_shape():
                    full *= n
                _Recorder.reads.append((k, t.numel(), full))
                return t

        return S()


def _check_loading(W, out, ckpts):
    import train.model.hf_io as hf_io
    from train.model.hf_io import _EXPERT, load_pretrained
    from train.parallel.tp import TPCausalLM, tp_from_pretrained
    from train.parallel.tsp import TSPCausalLM, tsp_from_pretrained

    real = hf_io.safe_open
    for name, path in ckpts.items():
        layouts = [("tsp", TSPCausalLM, lambda: tsp_from_pretrained(path))]
        if name.startswith("moe"):
            layouts.append(("tp", TPCausalLM, lambda: tp_from_pretrained(path)))
        for lay, cls, load in layouts:
            key = f"{lay}.{name}"
            want = cls(load_pretrained(path))
            _Recorder.reads = []
            hf_io.safe_open = lambda *a, **k: _Recorder(real, *a, **k)
            try:
                got = load()
            finally:
                hf_io.safe_open = real
            a, b = want.named_shards(), got.named_shards()
            out[key + ".same_names"] = set(a) == set(b) and want.kinds == got.kinds
            out[key + ".unequal"] = sorted(n for n in a if n in b and not torch.equal(a[n], b[n]))
            # every read of a sharded parameter takes a strict part of it (D = 2: at most half)
            frac = 0.0
            for k, n, full in _Recorder.reads:
                m = _EXPERT.match(k)
                ours = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}" if m else k
                # (a zaya router's balancing biases: a replicated buffer; zaya's value projections: at D = 2 with 4
                # KV heads rank 0's value rows are the whole current-token projection, rank 1's the delayed one)
                if got.kinds.get(ours, "rep") != "rep" and ".v_proj_" not in ours:
                    frac = max(frac, n / full)
            out[key + ".max_read_fraction"] = frac
            out[key + ".read_elements"] = sum(n for _, n, _ in _Recorder.reads)
            buffers = got.model_buffers() if lay == "tsp" else {}
            out[key + ".shard_elements"] = sum(p.numel() for p in list(b.values()) + list(buffers.values()))
            if buffers:
                out[key + ".unequal"] += sorted(n for n, t in want.model_buffers().items()
                                                if not torch.equal(t, buffers[n]))


def _worker(rank, world, port, path, ckpts):
    from tests.test_parallel import run_checks

    run_checks(rank, world, port, path, [lambda W, out: _check_loading(W, out, ckpts)])


@pytest.mark.timeout(300)
def test_rank_reads_only_its_slices_and_gets_the_same_shards(tmp_path):
    ranks = spawn(WORLD, _worker, _checkpoints(tmp_path))
    for r in ranks:
        assert "error" not in r, r.get("trace")
    keys = {k.rsplit(".", 1)[0] for k in ranks[0]}
    assert keys == {"tsp.dense", "tsp.moe", "tsp.moe_fused", "tsp.qwen2", "tsp.zaya", "tp.moe", "tp.moe_fused"}, keys
    for r in ranks:
        for k in keys:
            assert r[k + ".same_names"], k
            assert r[k + ".unequal"] == [], (k, r[k + ".unequal"])
            assert 0 < r[k + ".max_read_fraction"] <= 0.5, (k, r[k + ".max_read_fraction"])
            # nothing read twice, nothing read beyond the shards (replicated tensors count once)
            assert r[k + ".read_elements"] == r[k + ".shard_elements"], k


def test_sharded_loader_is_strict_and_refuses_the_fallback(tmp_path, monkeypatch):
    """A checkpoint that does not match its config fails when the reader is made (as stream_into), and a
    checkpoint that would go through the transformers fallback is refused in one line."""
    from safetensors.torch import load_file, save_file

    from train.model.hf_io import CheckpointError, CheckpointSlices, save_pretrained

    monkeypatch.delenv("CASCADE_MODEL_BACKEND", raising=False)
    d = tmp_path / "moe"
    save_pretrained(_model(_cfgs()["moe"]), d)
    src = CheckpointSlices(d)
    full = _model(_cfgs()["moe"]).state_dict()
    n = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(src.read(n, slice(None), slice(3, 30)), full[n][:, 3:30])  # across the gate/up seam
    with src:
        assert src._files
    assert not src._files  # the files are released once the reader is done
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    save_file(sd, str(d / "model.safetensors"))
    closed = []
    real_close = CheckpointSlices.close
    monkeypatch.setattr(CheckpointSlices, "close", lambda self: (closed.append(1), real_close(self)))
    with pytest.raises(CheckpointError, match="per-expert tensors"):
        CheckpointSlices(d)
    assert closed  # a reader that fails to index its files releases them before raising
    with pytest.raises(ValueError, match="transformers fallback .*qwen3.*trainer.nproc=1") as e:
        CheckpointSlices(d, backend="transformers")
    assert "\n" not in str(e.value)
