"""Analytic per-rank memory and communication of the layouts: TSP, TP, TP+SP (``sp``), DP ZeRO-1.

Communication: bytes SENT per rank (mean over the ranks; received is the same in the mean) for one
training step on a batch of B sequences of T tokens - forward, backward (with TSP's weight
re-streaming and K/V re-gather), the gradient synchronisation, and ZeRO-1's parameter all-gather
- grouped by collective, under the accounting of :mod:`train.parallel.comm` (bandwidth-optimal
ring/chain algorithms). These are exactly what the implementations in this package issue.

Memory: bytes on the largest rank (rank 0: uneven splits give it the larger part) of parameters,
gradients, AdamW state (two moments; ZeRO-1 keeps 1/D of them) and activations saved for backward.
The activation model counts the tensors autograd keeps per layer (see ``_act_*``); it is an
estimate that the benchmark checks against ``saved_tensors_hooks`` measurements. fp32 logits.

``cascade calc --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --ffn 14336 --seq 131072 --D 8``
or ``cascade calc --preset tiny-moe --D 4`` or ``cascade calc --config DIR/config.json``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from train.model.config import ModelConfig
from train.parallel.shard import split_sizes

LAYOUTS = ("single", "tsp", "tp", "sp", "dp")


@dataclass
class Shape:
    cfg: ModelConfig
    T: int
    B: int = 1
    D: int = 1
    b: int = 4  # bytes per weight / activation element

    @property
    def n_moe(self) -> int:
        return sum(self.cfg.layer_is_moe(i) for i in range(self.cfg.num_hidden_layers))

    @property
    def n_dense(self) -> int:
        return self.cfg.num_hidden_layers - self.n_moe

    def replicated(self) -> int:
        """Elements of the small replicated tensors: norms and routers."""
        c = self.cfg
        return c.num_hidden_layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size + self.n_moe * c.num_experts * c.hidden_size


def params_rank0(s: Shape, layout: str) -> int:
    """Parameter elements held by rank 0."""
    c, D = s.cfg, (1 if layout in ("single", "dp") else s.D)
    H, d = c.hidden_size, c.head_dim
    V0 = split_sizes(c.vocab_size, D)[0]
    hq = c.num_attention_heads // D
    if layout == "tsp" and c.num_key_value_heads < D:
        kv0 = 1  # rank 0 owns the first kv head
    else:
        kv0 = c.num_key_value_heads // D
    I0 = split_sizes(c.intermediate_size, D)[0]
    Im0 = split_sizes(c.moe_intermediate_size, D)[0] if c.is_moe else 0
    per_attn = 2 * H * hq * d + 2 * H * kv0 * d
    total = V0 * H * (1 if c.tie_word_embeddings else 2) + s.replicated()
    total += c.num_hidden_layers * per_attn + s.n_dense * 3 * H * I0 + s.n_moe * 3 * c.num_experts * H * Im0
    return total


def padded_T(s: Shape, layout: str) -> int:
    if layout == "tsp":
        return -(-s.T // (2 * s.D)) * 2 * s.D
    if layout == "sp":
        return -(-s.T // s.D) * s.D
    return s.T


def comm_bytes(s: Shape, layout: str) -> dict[str, float]:
    """Mean bytes sent per rank per training step, by collective (names as recorded by comm)."""
    c, D, B, b = s.cfg, s.D, s.B, s.b
    H, d, L, V = c.hidden_size, c.head_dim, c.num_hidden_layers, c.vocab_size
    out: dict[str, float] = {}

    def add(k, v):
        if v:
            out[k] = out.get(k, 0.0) + v

    if layout == "single" or D == 1:
        return out
    f = (D - 1) / D
    if layout == "tsp":
        n = padded_T(s, "tsp") // D
        kvh = max(c.num_key_value_heads // D, 1)
        vocab = 2 * V * H * b  # the embedding ring and the LM-head ring (the same shard when tied)
        weights = vocab + (s.n_dense * 3 * H * c.intermediate_size + s.n_moe * 3 * c.num_experts * H *
                           c.moe_intermediate_size) * b
        for k in ("ring", "ring.bwd", "ring_grad.bwd"):
            add(k, f * weights)
        bundle = L * (2 * H * c.num_attention_heads * d + D * 2 * H * kvh * d) * b
        for k in ("broadcast", "broadcast.bwd", "reduce.bwd"):
            add(k, f * bundle)
        kv_local = 2 * B * kvh * n * d * b
        add("all_gather", L * D * 2 * (D - 1) * kv_local)  # forward + backward recompute
        add("reduce_scatter.bwd", L * D * (D - 1) * kv_local)
        add("all_reduce.grad", 2 * f * s.replicated() * b)
        return out
    if layout in ("tp", "sp"):
        Tp = padded_T(s, layout)
        act = Tp * B * H * b
        N = B * (s.T - 1)
        k = c.num_experts_per_tok
        add("all_reduce.ce_max", 2 * f * N * 4)
        add("all_reduce", 2 * 2 * f * N * 4)  # sum-exp and target logit
        if layout == "tp":
            add("all_reduce", 2 * f * act * (1 + 2 * L))  # embedding + two row-parallel outputs per layer
            add("all_reduce.bwd", 2 * f * (act * (2 * L + 1) + s.n_moe * Tp * B * k * b))
            add("all_reduce.grad", 2 * f * L * 2 * d * b)  # q_norm / k_norm (partial over heads)
        else:
            add("reduce_scatter", f * act * (1 + 2 * L))
            add("all_gather.bwd", f * act * (1 + 2 * L))
            add("all_gather", f * (act * (2 * L + 1) + s.n_moe * Tp * B * k * b))
            add("reduce_scatter.bwd", f * (act * (2 * L + 1) + s.n_moe * Tp * B * k * b))
            add("all_gather.idx", f * s.n_moe * Tp * B * k * 8)
            add("all_reduce.grad", 2 * f * s.replicated() * b)
        return out
    if layout == "dp":
        P = c.num_parameters()
        add("all_reduce.grad", 2 * f * P * b)
        add("all_gather.params", (D - 1) * (-(-P // D)) * b)
        return out
    raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")


def activation_bytes(s: Shape, layout: str) -> float:
    """Estimated bytes of tensors saved for backward on one rank (one micro-batch)."""
    c, D, B, b = s.cfg, s.D, s.B, s.b
    H, d, L, V = c.hidden_size, c.head_dim, c.num_hidden_layers, c.vocab_size
    E, k = c.num_experts, c.num_experts_per_tok
    moe_router = E * 4 + k * (8 + 2 * 4) + 4  # probs, top-k ids, top-k weights and their sum, per token
    if layout == "tsp":
        # per layer per token: two norms x (input, normalised, scaled) + rsqrt; weight streaming
        # saves only its inputs, so no per-head or intermediate activations are kept
        n = B * padded_T(s, "tsp") // D
        per_layer = (6 * H + 2) * b
        total = n * (L * per_layer + s.n_moe * moe_router + (3 * H + 1) * b + V * 4 + 2 * d * b + 8 + 4)
        return total
    Dm = 1 if layout in ("single", "dp") else D
    T = padded_T(s, layout)
    tok = B * T
    hq, kvh = c.num_attention_heads // Dm, c.num_key_value_heads // Dm
    Ir = c.intermediate_size / Dm
    Imr = c.moe_intermediate_size / Dm
    norm_tok = (tok / Dm if layout == "sp" else tok)
    norms = 2 * norm_tok * (3 * H + 1) * b
    # q, k after projection: raw, rsqrt, normalised, scaled, rope-rotated, roped; v raw; GQA copies;
    # attention output and its log-sum-exp; the o_proj input
    attn = tok * ((5 * hq * d + hq) + (5 * kvh * d + kvh) + kvh * d + (2 * hq * d if hq != kvh else 0) + hq * d
                  + hq * d) * b + tok * hq * 4
    if layout == "sp":
        attn += tok * H * b  # the all-gathered norm output feeding the projections
    dense = tok * 4 * Ir * b + (tok * H * b if layout == "sp" else 0)
    moe = (tok * k * (4 * 2 * Imr + H + 8) * b + norm_tok * moe_router
           + (tok * H * b if layout == "sp" else 0))
    total = L * (norms + attn) + s.n_dense * dense + s.n_moe * moe
    total += norm_tok * (3 * H + 1) * b + tok * V / Dm * 4 + 2 * T * d * b
    if layout == "sp":
        total += tok * H * b
    return total


def memory(s: Shape, layout: str) -> dict[str, float]:
    P = params_rank0(s, layout)
    if layout == "dp":
        opt = 2 * (-(-s.cfg.num_parameters() // s.D))
    else:
        opt = 2 * P
    act = activation_bytes(s, layout)
    m = {"params": P * s.b, "grads": P * s.b, "optimizer": opt * 4, "activations": act}
    m["peak"] = sum(m.values())
    return m


def table(s: Shape, layouts=("single", "tsp", "tp", "sp", "dp")) -> dict[str, dict]:
    rows = {}
    for lay in layouts:
        m = memory(s, lay)
        cb = comm_bytes(s, lay)
        rows[lay] = {**m, "comm_sent": sum(cb.values()), "comm": cb}
    return rows


def _gib(x: float) -> str:
    return f"{x / 2 ** 30:9.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cascade calc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", help="model preset name (configs/models)")
    ap.add_argument("--config", help="HF config.json (or a checkpoint directory)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ffn", type=int, help="dense intermediate size")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--moe-ffn", type=int, default=None)
    ap.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--D", type=int, required=True, help="devices on the parallel axis")
    ap.add_argument("--bytes", type=int, default=2, help="bytes per element (2 = bf16, 4 = fp32)")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    a = ap.parse_args(argv)
    if a.D < 1 or a.seq < 2:
        raise ValueError("--D must be >= 1 and --seq >= 2")
    if a.preset:
        from train.presets import load_preset

        m = dict(load_preset(a.preset)["model"])
        m.setdefault("vocab_size", load_preset(a.preset).get("tokenizer", {}).get("vocab_size", 1024))
        cfg = ModelConfig.from_dict(m)
    elif a.config:
        from pathlib import Path

        from train.model.hf_io import load_config

        p = Path(a.config)
        if p.is_file():
            cfg = ModelConfig.from_hf(json.loads(p.read_text()))
        else:
            cfg = load_config(p)
    else:
        need = {"--hidden": a.hidden, "--layers": a.layers, "--heads": a.heads}
        missing = [k for k, v in need.items() if v is None]
        if missing:
            raise ValueError(f"give --preset, --config or the model sizes ({', '.join(missing)} missing)")
        cfg = ModelConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                          num_key_value_heads=a.kv_heads or a.heads, head_dim=a.head_dim or a.hidden // a.heads,
                          intermediate_size=a.ffn or 4 * a.hidden, vocab_size=a.vocab or 151936,
                          num_experts=a.experts or 0, num_experts_per_tok=a.topk or 2,
                          moe_intermediate_size=a.moe_ffn or 0, max_position_embeddings=a.seq).validate()
    s = Shape(cfg, a.seq, a.batch, a.D, a.bytes)
    rows = table(s)
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"model: {cfg.num_parameters() / 1e9:.3f}B params, H={cfg.hidden_size} L={cfg.num_hidden_layers} "
          f"heads={cfg.num_attention_heads}/{cfg.num_key_value_heads} ffn={cfg.intermediate_size}"
          + (f" experts={cfg.num_experts}x{cfg.moe_intermediate_size} top{cfg.num_experts_per_tok}" if cfg.is_moe else "")
          + f"; seq={a.seq} batch={a.batch} D={a.D}, {a.bytes}-byte weights/activations, fp32 AdamW state")
    print(f"{'layout':8} {'params':>9} {'grads':>9} {'optim':>9} {'acts':>9} {'peak':>9} {'comm/step':>10}  (GiB per rank)")
    for lay, r in rows.items():
        print(f"{lay:8} {_gib(r['params'])} {_gib(r['grads'])} {_gib(r['optimizer'])} {_gib(r['activations'])} "
              f"{_gib(r['peak'])} {_gib(r['comm_sent'])}")
    return 0
