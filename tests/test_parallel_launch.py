"""torchrun: TSP SFT at D=2 on CPU trains, saves shards, gathers an HF checkpoint whose
single-process logits equal the sharded model's; plus the calc CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_parallel import world_of_one

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_torchrun_tsp_sft_checkpoint_roundtrip(tmp_path):
    from train.model.config import ModelConfig
    from train.model.hf_io import load_pretrained, save_pretrained
    from train.model.modeling import CausalLM

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                      moe_intermediate_size=16, mlp_only_layers=[0])
    start = CausalLM(cfg).init_weights(0, std=0.1)
    save_pretrained(start, tmp_path / "init")
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "train.parallel.train_tsp", "--model", str(tmp_path / "init"), "--steps", "4",
           "--out", str(out), "--seq", "19", "--batch", "2", "--lr", "1e-2", "--probe"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 4 and (log[-1]["loss"] + log[-2]["loss"]) / 2 < log[0]["loss"]
    assert (out / "shards" / "rank0.safetensors").exists() and (out / "shards" / "rank1.safetensors").exists()
    trained = load_pretrained(out)
    probe = torch.load(out / "probe.pt")
    with torch.no_grad():
        logits = trained(probe["input_ids"])
    assert (logits - probe["logits"]).abs().max().item() < 1e-5
    # the weights did move
    moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), start.parameters()))
    assert moved > 1e-4


def test_calc_cli_prints_table(capsys):
    from train.parallel.calc import main

    assert main(["--hidden", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--ffn", "14336",
                 "--seq", "131072", "--D", "8"]) == 0
    text = capsys.readouterr().out
    for lay in ("single", "tsp", "tp", "sp", "dp"):
        assert f"\n{lay} " in text
    with pytest.raises(ValueError):
        main(["--seq", "128", "--D", "2"])


def test_calc_formulas_hand_values():
    """Hand-computed figures for a 1-layer dense model at D=2, fp32."""
    from train.model.config import ModelConfig
    from train.parallel.calc import Shape, comm_bytes, params_rank0

    cfg = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=2)
    s = Shape(cfg, T=8, B=1, D=2, b=4)
    # rank 0: 5 vocab rows x 4 (embed) + 5 x 4 (head) + norms 2*4 + 2*2 + 4 + q,o (2*4*2) + k,v (2*4*2) + mlp 3*4*3
    assert params_rank0(s, "tsp") == 20 + 20 + 8 + 4 + 4 + 16 + 16 + 36
    c = comm_bytes(s, "tsp")
    # rings: embed + head (2 * 10 * 4) + mlp (3 * 4 * 6) elements, half of them leave each rank
    assert c["ring"] == 0.5 * (80 + 72) * 4
    # K/V all-gather: n = 8/2 = 4 local tokens, 1 kv head of dim 2, k and v: 16 elems, D groups, fwd + recompute
    assert c["all_gather"] == 1 * 2 * 2 * 1 * 16 * 4
    assert comm_bytes(s, "dp")["all_reduce.grad"] == 2 * 0.5 * cfg.num_parameters() * 4
    # Qwen2 (q/k/v biases, no q/k norm) and Llama with biases (o_proj's too): the formula assumed Qwen3's q/k norms
    # and no biases; one process holds every parameter
    from train.model.modeling import CausalLM

    for arch in ("qwen2", "llama"):
        c2 = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=2, attention_bias=True, architecture=arch)
        held = sum(p.numel() for p in CausalLM(c2).parameters())
        assert params_rank0(Shape(c2, T=8, B=1, D=2, b=4), "single") == held, arch
        # TSP's bundles carry q/k/v biases with their weights (left out before): 2 layers x (q, o: 2 x 4 x 2 x 2;
        # k, v for each of 2 groups: 2 x 2 x 4 x 1 x 2; biases q 2 x 2, k and v 2 x 2 x 1 x 2) x 4 bytes, half sent
        assert comm_bytes(Shape(c2, T=8, B=1, D=2, b=4), "tsp")["broadcast"] == 0.5 * 2 * (32 + 32 + 4 + 8) * 4
        # TP all-reduces q/k-norm gradients (partial over heads) only where there are q/k norms
        assert "all_reduce.grad" not in comm_bytes(Shape(c2, T=8, B=1, D=2, b=4), "tp"), arch
    assert comm_bytes(s, "tp")["all_reduce.grad"] == 2 * 0.5 * 1 * 2 * 2 * 4  # Qwen3's: 2 norms of head_dim 2


def test_calc_rank0_params_memory_and_logit_activations_hand_values():
    """More hand-computed `cascade calc` figures: a DP replica holds the whole model (ZeRO-1 shards only the
    optimizer, rank 0 the larger part of an uneven split); tied embeddings and MoE routers counted as a process
    holds them; a TSP rank with fewer KV heads than ranks owns one KV head; peak = the sum of its parts; each
    layout's fp32 logits cover its tokens x its vocabulary columns."""
    import math

    from train.model.config import ModelConfig
    from train.model.modeling import CausalLM
    from train.parallel.calc import Shape, activation_bytes, memory, params_rank0

    cfg = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=2)
    P = sum(p.numel() for p in CausalLM(cfg).parameters())
    assert P == 232 and P % 3 == 1
    assert params_rank0(Shape(cfg, T=8, B=1, D=2, b=4), "dp") == P  # replicated parameters
    m = memory(Shape(cfg, T=8, B=1, D=3, b=4), "dp")
    assert m["params"] == P * 4 and m["grads"] == P * 4
    assert m["optimizer"] == math.ceil(232 / 3) * 3 * 4 == 78 * 12  # rank 0: 78 of 232 (master + 2 moments)
    for lay in ("single", "tsp", "tp", "sp", "dp"):
        m = memory(Shape(cfg, T=8, B=1, D=2, b=2), lay)
        assert m["peak"] == m["params"] + m["grads"] + m["optimizer"] + m["activations"], lay
    # tied embeddings (one tensor) and a MoE layer's router: what one process holds
    for c in (ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=2, tie_word_embeddings=True),
              ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=3, mlp_only_layers=[0])):
        held = sum(p.numel() for p in CausalLM(c).parameters())
        assert params_rank0(Shape(c, T=8, B=1, D=2, b=4), "single") == held == c.num_parameters()
    # TSP, 1 KV head on 2 ranks: rank 0 owns it (k, v: 2 x 4 x 2), besides q, o of its 1 query head (2 x 4 x 2),
    # 5 vocab rows x 4 twice, norms 2 x 4 + q/k norms 2 x 2 + final 4, and 3 of the 6 MLP rows (3 x 4 x 3)
    c1 = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=2)
    assert params_rank0(Shape(c1, T=8, B=1, D=2, b=4), "tsp") == 20 + 20 + 8 + 4 + 4 + 16 + 16 + 36
    # 10 more vocabulary entries: 10 more fp32 logits per token of the rank, a 1/D share of them under TP/SP
    # (vocab-parallel) and on each TSP rank's 8/2 tokens, whatever the weights' width
    wide = ModelConfig(vocab_size=20, hidden_size=4, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=2)
    for lay, want in (("single", 8 * 10 * 4), ("dp", 8 * 10 * 4), ("tp", 8 * 5 * 4), ("sp", 8 * 5 * 4),
                      ("tsp", 4 * 10 * 4)):
        got = activation_bytes(Shape(wide, T=8, B=1, D=2, b=2), lay) - activation_bytes(Shape(cfg, T=8, B=1, D=2, b=2), lay)
        assert got == want, (lay, got, want)
    # sequence parallelism keeps less than plain TP (its norms and residuals hold 1/D of the tokens)
    big = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    s = Shape(big, T=4096, B=1, D=4, b=2)
    assert activation_bytes(s, "sp") < 0.9 * activation_bytes(s, "tp")


def test_calc_cli_defaults_and_refusals():
    """Without --kv-heads / --ffn the model has as many KV heads as query heads and a 4 x hidden MLP; --seq below
    2 and --D below 1 are refused."""
    import io
    from contextlib import redirect_stdout

    from train.parallel.calc import main

    base = ["--hidden", "64", "--layers", "2", "--heads", "4", "--seq", "128", "--D", "2", "--json"]
    outs = []
    for extra in ([], ["--kv-heads", "4", "--ffn", "256"]):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(base + extra) == 0
        outs.append(json.loads(buf.getvalue()))
    assert outs[0] == outs[1]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(base + ["--kv-heads", "2"]) == 0  # (the flags do change the table)
    assert json.loads(buf.getvalue()) != outs[0]
    for bad in (["--seq", "1"], ["--D", "0"]):
        with pytest.raises(ValueError, match="--D, --batch and --bytes must be >= 1 and --seq >= 2"):
            main(base + bad)


@pytest.mark.timeout(240)
def test_torchrun_data_parallel_sft_of_zaya_equals_one_process_step(tmp_path):
    """``train_tsp --dp 2`` on a zaya policy, replicas holding different numbers of target tokens (right-padded
    rows): the checkpoint equals one process's AdamW step on the whole batch (the mean over all its target
    tokens), balancing biases moved by the whole batch's routing included (they were left out of the
    checkpoint, which then failed to load)."""
    from tests.test_parallel import _cfgs, _model
    from train.model.hf_io import load_pretrained, save_pretrained
    from train.model.zaya import balance_router_biases
    from train.parallel.train_tsp import batches

    start = _model(_cfgs()["zaya"])
    save_pretrained(start, tmp_path / "init")
    rows = [[(7 * i + j) % 50 for j in range(n)] for i, n in enumerate([4, 13, 5, 13, 3, 13])]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "train.parallel.train_tsp", "--model", str(tmp_path / "init"), "--steps", "1", "--dp", "2",
           "--out", str(out), "--seq", "13", "--batch", "2", "--lr", "1e-2", "--data", str(tmp_path / "data.jsonl")]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-3000:]
    ids, mask = next(batches(str(tmp_path / "data.jsonl"), 50, 13, 4, 0))  # the step's batch, both replicas'
    replicas = [int(mask[i:i + 2, 1:].sum()) for i in (0, 2)]
    assert replicas[0] != replicas[1], replicas  # (so a mean of the replicas' means would differ)
    ref = load_pretrained(tmp_path / "init")
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    logits = ref(ids, mask)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    tgt = mask[:, 1:]
    (-(logp * tgt).sum() / tgt.sum()).backward()
    opt.step()
    balance_router_biases(ref)
    got, want = load_pretrained(out).state_dict(), ref.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
    biases = [k for k in want if k.endswith("balancing_biases")]
    assert biases and max((want[k] - start.state_dict()[k]).abs().max().item() for k in biases) > 0


def test_calc_memory_counts_what_mesh_adamw_holds_under_bf16(tmp_path):
    """`cascade calc`'s optimizer and gradient bytes equal the tensors MeshAdamW holds on a bf16 policy (fp32
    master slice and moments, fp32 gradient accumulator beside the bf16 gradients), counted from the tensors;
    fp32 weights have no master copy and no accumulator."""
    import torch.distributed as dist

    from train.model.config import ModelConfig
    from train.model.modeling import CausalLM
    from train.parallel.calc import Shape, memory
    from train.parallel.dp import MeshAdamW

    cfg = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=4)
    with world_of_one(tmp_path):
        for dtype, b in ((torch.bfloat16, 2), (torch.float32, 4)):
            model = CausalLM(cfg).to(dtype)
            opt = MeshAdamW([(p, False, True) for p in model.parameters()], dist.group.WORLD, dist.group.WORLD)
            model(torch.tensor([[1, 2, 3]])).float().logsumexp(-1).sum().backward()
            grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
            opt.accumulate()
            acc = 0 if opt._acc is None else opt._acc.numel() * opt._acc.element_size()
            state = sum(t.numel() * t.element_size() for t in (opt.exp_avg, opt.exp_avg_sq))
            master = opt.master.numel() * opt.master.element_size()  # an fp32 copy under fp32 weights too
            m = memory(Shape(cfg, T=3, B=1, D=1, b=b), "dp")
            assert m["params"] == sum(p.numel() * p.element_size() for p in model.parameters())
            assert m["grads"] == grads + acc, (b, m["grads"], grads, acc)
            assert m["optimizer"] == state + master, (b, m["optimizer"], state, master)
            assert (acc > 0) == (b < 4)


def test_train_tsp_refuses_a_mesh_or_batch_below_one_in_one_line(tmp_path):
    """--dp 0 divided by zero, --dp -1 passed the divisibility check (2 % -1 == 0) and failed on a negative tensor
    size, --batch 0 failed reshaping; each is now named before any work."""

    from train.parallel.train_tsp import main
    from train.presets import init_model

    init_model("tiny-dense", tmp_path / "m")
    with world_of_one(tmp_path):
        for flag, value in (("--dp", "0"), ("--dp", "-1"), ("--batch", "0"), ("--batch", "-1")):
            with pytest.raises(ValueError, match="bad arguments: .*batch=.*dp="):
                main(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--steps", "1", flag, value])
    assert not (tmp_path / "out").exists()


def test_train_tsp_data_rows_are_cut_padded_and_checked(tmp_path):
    """``batches`` from a jsonl file: a row longer than ``--seq`` is cut to it, a shorter one right-padded with
    zeros that the mask leaves out; a line of fewer than 2 tokens, a token id outside [0, vocab) or a file with
    no example is refused naming the line. Without data: rows of ``seq`` tokens, each a repeated 5-token motif."""
    from train.parallel.train_tsp import batches

    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6]}) + "\n\n" + json.dumps({"input_ids": [7, 8]}) + "\n")
    ids, mask = next(batches(str(f), 10, 4, 16, 0))
    assert ids.shape == mask.shape == (16, 4)
    rows = {tuple(r) for r in ids.tolist()}
    assert rows == {(1, 2, 3, 4), (7, 8, 0, 0)}, rows
    for r, m in zip(ids.tolist(), mask.tolist()):
        assert m == ([True] * 4 if r[0] == 1 else [True, True, False, False])
    for lines, needle in (([[1, 2], [3]], ":2: each line needs an 'input_ids' list of at least 2 tokens"),
                          ([[1, 10]], r":1: token id out of range \[0, 10\)"), ([[1, 2], [-1, 2]], ":2: token id out of range"),
                          ([], "no examples")):
        f.write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in lines))
        with pytest.raises(ValueError, match=needle):
            next(batches(str(f), 10, 4, 2, 0))
    f.write_text(json.dumps({"input_ids": [0, 9]}) + "\n")  # the edges of the range
    assert next(batches(str(f), 10, 4, 1, 0))[0].tolist() == [[0, 9, 0, 0]]
    ids, mask = next(batches(None, 50, 7, 3, 0))
    assert ids.shape == (3, 7) and bool(mask.all())
    assert torch.equal(ids[:, 5:], ids[:, :2])  # the motif again after 5 tokens, cut at 7


def test_train_tsp_refuses_a_sequence_below_two_or_negative_steps_in_one_line(tmp_path):
    from train.parallel.train_tsp import main

    # (refused before the model is read: the directory needs no checkpoint)
    with world_of_one(tmp_path):
        for flag, value in (("--seq", "1"), ("--seq", "0"), ("--steps", "-1")):
            with pytest.raises(ValueError, match="bad arguments: steps=.* seq=") as e:
                main(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--steps", "1", flag, value])
            assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_async_shard_saver_writes_the_snapshot_and_surfaces_a_failed_write(tmp_path, monkeypatch):
    """The saver copies the shards when it is made (a change after that, before the background write, is not
    saved), and ``wait`` raises the write's error (here: the target path is a directory)."""
    import threading

    import safetensors.torch as st

    from train.parallel.train_tsp import AsyncShardSaver

    go, real = threading.Event(), st.save_file
    monkeypatch.setattr(st, "save_file", lambda *a, **k: (go.wait(10), real(*a, **k)))
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    saver = AsyncShardSaver({"w": w}, tmp_path / "s" / "rank0.safetensors")
    w.add_(100.0)  # the training goes on while the shards are written
    go.set()
    assert torch.equal(st.load_file(str(saver.wait()))["w"], torch.arange(6, dtype=torch.float32).view(2, 3))
    (tmp_path / "bad" / "rank1.safetensors").mkdir(parents=True)
    with pytest.raises(Exception, match="Is a directory"):
        AsyncShardSaver({"w": w}, tmp_path / "bad" / "rank1.safetensors").wait()
