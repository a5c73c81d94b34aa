"""Analytic per-rank memory and communication of the layouts: TSP, TP, TP+SP (``sp``), DP ZeRO-1.

Communication: bytes SENT per rank (mean over the ranks; received is the same in the mean) for one
training step on a batch of B sequences of T tokens - forward, backward (with TSP's weight
re-streaming and K/V re-gather), the gradient synchronisation, and ZeRO-1's parameter all-gather
- grouped by collective, under the accounting of :mod:`train.parallel.comm` (bandwidth-optimal
ring/chain algorithms). These are exactly what the implementations in this package issue; the DP row is
:class:`train.parallel.dp.ZeroAdamW`'s (``train_tsp --dp``: gradients all-reduced at the weights' width), while the
RL trainer ranks' ``MeshAdamW`` reduce-scatters fp32 gradients instead ((D-1)/D x P x 4 bytes in place of
2 (D-1)/D x P x b; the parameter all-gather is the same).

Memory: bytes on the largest rank (rank 0: uneven splits give it the larger part) of parameters,
gradients, AdamW state (two fp32 moments, and an fp32 master copy under bf16 weights; ZeRO-1 keeps 1/D
of them), the fp32 gradient accumulator under bf16 weights, and activations saved for backward.
The activation model counts the tensors autograd keeps per layer (see ``_act_*``); it is an
estimate that the benchmark checks against ``saved_tensors_hooks`` measurements. fp32 logits.

``cascade calc --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --ffn 14336 --seq 131072 --D 8``
or ``cascade calc --preset tiny-moe --seq 4096 --D 4`` or ``cascade calc --config DIR/config.json``.
The layout table is refused for zaya (ZAYA1): its CCA attention is not modelled here.

Rollout:trainer sizing of an RL run (``cascade calc rollout``, :func:`rollout_sizing`): one step
generates ``G = prompts x group x response`` tokens and trains on ``T = prompts x group x (prompt +
response)`` tokens. With ``g`` generated tokens/s per rollout server and ``t`` trained tokens/s per
trainer rank, a step takes ``G / (S g)`` on S servers and ``T / (N t)`` on N ranks, and generation
keeps up when ``S / N >= (G / T) x (t / g)`` servers per rank (ZAYA1 ran 2-5x rollout workers per
trainer). Give ``g`` and ``t`` as measured (``--gen-tps``, ``--train-tps``: benchmarks/rollout.py and
benchmarks/train.py measure them on your hardware); otherwise they are ASSUMED from the active
parameters N_a: ``t = train_mfu x peak / (6 N_a)`` (forward + backward, 2 + 4 FLOPs per parameter
per token) and ``g = gen_mfu x peak x gpus_per_server / (2 N_a)`` (decoding), with peak = 989 TFLOP/s
(H100 SXM, dense bf16), train_mfu = 0.35 and gen_mfu = 0.10 by default; attention's context-length
FLOPs, prefill and load imbalance are left out. Assumed rates are labelled as such in the output.
Under them the ratio is ``(G / T) x train_mfu / (3 gen_mfu)`` whatever the model size (1.17 G/T at
the defaults); 2-5 servers per rank at train_mfu = 0.35 would mean decoding at gen_mfu = 0.023-0.058.
``cascade calc rollout --preset small-moe --prompts 64 --group 8 --prompt-len 512 --response-len 4096``
or ``--params 8.4B --active-params 760M`` instead of a preset.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from train.model.config import ModelConfig
from train.parallel.shard import split_sizes
from train.parallel.tsp import check_tsp_config

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
        """Elements of the small replicated tensors: norms (q/k norms where the family has them), o_proj biases
        and routers."""
        c = self.cfg
        per_layer = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0) + (c.hidden_size if c.o_proj_bias else 0)
        return c.num_hidden_layers * per_layer + c.hidden_size + self.n_moe * c.num_experts * c.hidden_size


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
    per_attn = 2 * H * hq * d + 2 * H * kv0 * d + ((hq + 2 * kv0) * d if c.attention_bias else 0)  # q/k/v biases: rows
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
        if c.attention_bias:  # q/k/v biases travel in the bundles with their weights (o_proj's is replicated)
            bundle += L * (c.num_attention_heads * d + D * 2 * kvh * d) * b
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
            if c.qk_norm:
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
    """Rank 0's bytes. The sharded layouts' optimizer (train.parallel.dp.MeshAdamW) keeps an fp32 master copy of
    the elements it updates beside its two moments, whatever the weights' dtype; one process (torch's AdamW) keeps
    one only under bf16 (train.optim.MasterWeights). With weights under 4 bytes (bf16) gradients are also summed
    into an fp32 accumulator over the rank's parameters beside each micro-batch's low-precision gradients."""
    P = params_rank0(s, layout)
    owned = -(-s.cfg.num_parameters() // s.D) if layout == "dp" else P
    low = s.b < 4
    act = activation_bytes(s, layout)
    master = low or layout != "single"
    m = {"params": P * s.b, "grads": P * s.b + (P * 4 if low else 0), "optimizer": owned * (3 if master else 2) * 4,
         "activations": act}
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


def _add_model_args(ap: argparse.ArgumentParser) -> None:
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


def _size_flags(a: argparse.Namespace) -> list[str]:
    """The model size flags given (``--hidden``, ``--experts``, ...)."""
    return [f"--{k.replace('_', '-')}" for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                                                 "experts", "topk", "moe_ffn") if getattr(a, k, None) is not None]


def model_config(a: argparse.Namespace, max_pos: int = 4096) -> ModelConfig:
    """The model of ``--preset``, ``--config`` or the size flags (one of the three)."""
    sizes = _size_flags(a)
    given = [f for f, v in (("--preset", a.preset), ("--config", a.config)) if v] + (["size flags"] if sizes else [])
    if len(given) > 1:
        raise ValueError(f"give the model one way: --preset, --config or the size flags, not {' and '.join(given)}"
                         + (f" ({', '.join(sizes)})" if sizes else ""))
    if a.preset:
        from train.presets import preset_model_dict

        return ModelConfig.from_dict(preset_model_dict(a.preset))
    if a.config:
        from pathlib import Path

        from train.model.hf_io import load_config

        p = Path(a.config)
        if p.is_file():
            return ModelConfig.from_hf(json.loads(p.read_text()))
        return load_config(p)
    need = {"--hidden": a.hidden, "--layers": a.layers, "--heads": a.heads}
    if a.experts and not a.moe_ffn:
        need["--moe-ffn (the experts' width, with --experts)"] = None
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise ValueError(f"give --preset, --config or the model sizes ({', '.join(missing)} missing)")
    return ModelConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                       num_key_value_heads=a.kv_heads or a.heads, head_dim=a.head_dim or a.hidden // a.heads,
                       intermediate_size=a.ffn or 4 * a.hidden, vocab_size=a.vocab or 151936,
                       num_experts=a.experts or 0, num_experts_per_tok=a.topk or 2,
                       moe_intermediate_size=a.moe_ffn or 0, max_position_embeddings=max_pos).validate()


# ------------------------------------------------------------------------ rollout:trainer sizing

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16: the default device of the assumed rates
TRAIN_MFU = 0.35     # assumed model-FLOPs utilisation of a trainer rank
GEN_MFU = 0.10       # assumed model-FLOPs utilisation of decoding on a rollout server


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token passes through: :meth:`ModelConfig.num_parameters` with ``top-k`` of the
    ``E`` experts of each MoE layer (the router counted in full)."""
    if not cfg.is_moe:
        return cfg.num_parameters()
    idle = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    n_moe = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
    return cfg.num_parameters() - n_moe * idle


def parse_count(text: str, flag: str) -> float:
    """``"8B"``, ``"760M"``, ``"1.5e9"``, ``"4096"`` -> a positive number; a one-line ValueError otherwise."""
    t = str(text).strip()
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:].upper(), 1.0)
    try:
        v = float(t[:-1] if mult != 1.0 else t) * mult
    except ValueError:
        raise ValueError(f"{flag}: expected a positive number like 8e9 or 8B, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise ValueError(f"{flag}: expected a positive number like 8e9 or 8B, got {text!r}")
    return v


def rollout_sizing(active_params: float, prompts: int, group: int, prompt_len: float, response_len: float,
                   gen_tps: float | None = None, train_tps: float | None = None, trainer_ranks: int = 8,
                   servers: int | None = None, gpus_per_server: int = 1, total_params: float | None = None,
                   peak_tflops: float = PEAK_TFLOPS, train_mfu: float = TRAIN_MFU, gen_mfu: float = GEN_MFU,
                   weight_bytes: int = 2) -> dict:
    """Tokens/s and time per step on the rollout and trainer sides, and the servers per trainer rank
    that keep generation up with training (see the module docstring for the model)."""
    checks = {"active_params": active_params, "prompts": prompts, "group": group, "response_len": response_len,
              "trainer_ranks": trainer_ranks, "gpus_per_server": gpus_per_server, "peak_tflops": peak_tflops,
              "train_mfu": train_mfu, "gen_mfu": gen_mfu, "gen_tps": gen_tps, "train_tps": train_tps,
              "servers": servers, "total_params": total_params, "bytes": weight_bytes}
    for k, v in checks.items():
        if v is not None and not 0 < v < float("inf"):
            raise ValueError(f"{k} (--{k.replace('_', '-')}) must be > 0, got {v!r}")
    if not 0 <= prompt_len < float("inf"):
        raise ValueError(f"prompt_len (--prompt-len) must be >= 0, got {prompt_len!r}")
    peak = peak_tflops * 1e12
    gen_src = "measured" if gen_tps is not None else "assumed"
    train_src = "measured" if train_tps is not None else "assumed"
    g = gen_tps if gen_tps is not None else gen_mfu * peak * gpus_per_server / (2 * active_params)
    t = train_tps if train_tps is not None else train_mfu * peak / (6 * active_params)
    gen_tokens = prompts * group * response_len
    train_tokens = prompts * group * (prompt_len + response_len)
    per_rank = (gen_tokens / train_tokens) * (t / g)  # servers per trainer rank for equal step times
    n_servers = servers if servers is not None else max(1, math.ceil(per_rank * trainer_ranks - 1e-9))
    gen_s, train_s = gen_tokens / (n_servers * g), train_tokens / (trainer_ranks * t)
    out = {
        "active_params": active_params, "total_params": total_params,
        "gen_tokens_per_step": gen_tokens, "train_tokens_per_step": train_tokens,
        "gen_tps_per_server": g, "gen_tps_source": gen_src, "train_tps_per_rank": t, "train_tps_source": train_src,
        "trainer_ranks": trainer_ranks, "servers": n_servers, "servers_given": servers is not None,
        "gpus_per_server": gpus_per_server,
        "gen_tps_total": n_servers * g, "train_tps_total": trainer_ranks * t,
        "gen_s_per_step": gen_s, "train_s_per_step": train_s,
        "step_s_sync": gen_s + train_s,       # generate, then train (max_staleness = 0)
        "step_s_pipelined": max(gen_s, train_s),  # generation ahead of the trainer (max_staleness >= 1)
        "servers_per_rank": per_rank, "servers_needed": max(1, math.ceil(per_rank * trainer_ranks - 1e-9)),
        "rollout_gpus_per_trainer_gpu": per_rank * gpus_per_server,
        "bottleneck": "generation" if gen_s > train_s else "trainer",
    }
    if total_params is not None:
        out["weight_bytes_per_version"] = total_params * weight_bytes
    if gen_src == "assumed" or train_src == "assumed":
        out["assumptions"] = {"peak_tflops": peak_tflops, "train_mfu": train_mfu, "gen_mfu": gen_mfu}
    return out


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags are a ValueError (one line through the ``cascade`` CLI), not usage text + exit."""

    def error(self, message: str):
        raise ValueError(message)


def _si(x: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def rollout_main(argv: list[str]) -> int:
    ap = _OneLineParser(prog="cascade calc rollout",
                        description="Rollout:trainer sizing of an RL run: tokens/s and time per step on each side, "
                                    "and rollout servers per trainer rank so that generation keeps up.")
    _add_model_args(ap)
    ap.add_argument("--params", help="total parameters (8e9, 8B, 760M), instead of a model")
    ap.add_argument("--active-params", help="parameters active per token (default: --params, or from the model)")
    ap.add_argument("--prompts", type=int, required=True, help="prompts per step")
    ap.add_argument("--group", type=int, required=True, help="completions per prompt (group size)")
    ap.add_argument("--prompt-len", type=float, required=True, help="mean prompt tokens")
    ap.add_argument("--response-len", type=float, required=True, help="mean response tokens")
    ap.add_argument("--gen-tps", type=float, help="measured generated tokens/s per rollout server "
                    "(default: assumed, gen_mfu x peak x gpus_per_server / (2 x active))")
    ap.add_argument("--train-tps", type=float, help="measured trained tokens/s per trainer rank "
                    "(default: assumed, train_mfu x peak / (6 x active))")
    ap.add_argument("--trainer-ranks", type=int, default=8, help="trainer ranks (GPUs), default 8")
    ap.add_argument("--servers", type=int, help="rollout servers (default: as many as keep up)")
    ap.add_argument("--gpus-per-server", type=int, default=1, help="GPUs per rollout server, default 1")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                    help=f"assumption: peak TFLOP/s per GPU (default {PEAK_TFLOPS:g}, H100 SXM dense bf16)")
    ap.add_argument("--train-mfu", type=float, default=TRAIN_MFU, help=f"assumption, default {TRAIN_MFU}")
    ap.add_argument("--gen-mfu", type=float, default=GEN_MFU, help=f"assumption, default {GEN_MFU}")
    ap.add_argument("--bytes", type=int, default=2, help="bytes per published weight (2 = bf16)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    has_model = bool(a.preset or a.config or _size_flags(a))
    if (a.params or a.active_params) and has_model:
        raise ValueError("give --params/--active-params or a model (--preset, --config, sizes), not both")
    if a.params or a.active_params:
        total = parse_count(a.params, "--params") if a.params else None
        active = parse_count(a.active_params, "--active-params") if a.active_params else total
        if total is not None and active > total:
            raise ValueError(f"--active-params ({a.active_params}) exceeds --params ({a.params})")
    elif has_model:
        cfg = model_config(a)
        total, active = float(cfg.num_parameters()), float(active_parameters(cfg))
    else:
        raise ValueError("give the model: --params (and --active-params for MoE), --preset, --config or sizes")
    r = rollout_sizing(active, a.prompts, a.group, a.prompt_len, a.response_len, gen_tps=a.gen_tps,
                       train_tps=a.train_tps, trainer_ranks=a.trainer_ranks, servers=a.servers,
                       gpus_per_server=a.gpus_per_server, total_params=total, peak_tflops=a.peak_tflops,
                       train_mfu=a.train_mfu, gen_mfu=a.gen_mfu, weight_bytes=a.bytes)
    if a.json:
        print(json.dumps(r))
        return 0
    tot = f"{_si(total)} params, " if total else ""
    print(f"model: {tot}{_si(active)} active; step: {a.prompts} prompts x {a.group} = {a.prompts * a.group} "
          f"completions, {a.prompt_len:g} + {a.response_len:g} tokens each")
    print(f"tokens per step: generated {_si(r['gen_tokens_per_step'])}, trained {_si(r['train_tokens_per_step'])}")
    n = "given" if r["servers_given"] else "needed to keep up"
    print(f"rollout: {r['servers']} servers ({n}) x {_si(r['gen_tps_per_server'])} tok/s "
          f"({r['gen_tps_source']}) = {_si(r['gen_tps_total'])} tok/s, {r['gen_s_per_step']:.3g} s per step")
    print(f"trainer: {a.trainer_ranks} ranks x {_si(r['train_tps_per_rank'])} tok/s ({r['train_tps_source']}) "
          f"= {_si(r['train_tps_total'])} tok/s, {r['train_s_per_step']:.3g} s per step")
    print(f"step: {r['step_s_sync']:.3g} s synchronous (generate, then train), {r['step_s_pipelined']:.3g} s "
          f"pipelined (max_staleness >= 1); bottleneck: {r['bottleneck']}")
    print(f"rollout servers per trainer rank to keep up: {r['servers_per_rank']:.3g} "
          f"({r['rollout_gpus_per_trainer_gpu']:.3g} rollout GPUs per trainer GPU); "
          f"{r['servers_needed']} servers for {a.trainer_ranks} ranks")
    if "weight_bytes_per_version" in r:
        print(f"weights per published version: {r['weight_bytes_per_version'] / 2 ** 30:.3g} GiB")
    if "assumptions" in r:
        s = r["assumptions"]
        print(f"ASSUMED rates (peak {s['peak_tflops']:g} TFLOP/s per GPU, trainer MFU {s['train_mfu']:g}, "
              f"decoding MFU {s['gen_mfu']:g}); measure and pass --gen-tps/--train-tps")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rollout"]:
        return rollout_main(argv[1:])
    ap = argparse.ArgumentParser(prog="cascade calc", description=__doc__.split("\n\n")[0],
                                 epilog="cascade calc rollout --help: rollout:trainer sizing of an RL run")
    _add_model_args(ap)
    ap.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--D", type=int, required=True, help="devices on the parallel axis")
    ap.add_argument("--bytes", type=int, default=2, help="bytes per element (2 = bf16, 4 = fp32)")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    a = ap.parse_args(argv)
    if a.D < 1 or a.seq < 2 or a.batch < 1 or a.bytes < 1:
        raise ValueError("--D, --batch and --bytes must be >= 1 and --seq >= 2")
    cfg = model_config(a, max_pos=a.seq)
    if cfg.architecture == "zaya":
        raise ValueError(f"the layout table models Qwen/Llama-style attention, not zaya's CCA (the model has "
                         f"{cfg.num_parameters() / 1e6:.4g}M parameters); `cascade calc rollout` sizes a zaya run")
    try:
        check_tsp_config(cfg, a.D)
    except ValueError as e:  # the rule a run applies (KV heads may also be a divisor of D: replicated)
        print(f"cascade calc: note: {e}: the TSP and TP rows are not runnable layouts (a run refuses them)",
              file=sys.stderr)
    s = Shape(cfg, a.seq, a.batch, a.D, a.bytes)
    rows = table(s)
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"model: {cfg.num_parameters() / 1e9:.3f}B params, H={cfg.hidden_size} L={cfg.num_hidden_layers} "
          f"heads={cfg.num_attention_heads}/{cfg.num_key_value_heads} ffn={cfg.intermediate_size}"
          + (f" experts={cfg.num_experts}x{cfg.moe_intermediate_size} top{cfg.num_experts_per_tok}" if cfg.is_moe else "")
          + f"; seq={a.seq} batch={a.batch} D={a.D}, {a.bytes}-byte weights/activations, fp32 AdamW state"
          + (" and master weights, fp32 gradient accumulator" if a.bytes < 4 else ""))
    print(f"{'layout':8} {'params':>9} {'grads':>9} {'optim':>9} {'acts':>9} {'peak':>9} {'comm/step':>10}  (GiB per rank)")
    for lay, r in rows.items():
        print(f"{lay:8} {_gib(r['params'])} {_gib(r['grads'])} {_gib(r['optimizer'])} {_gib(r['activations'])} "
              f"{_gib(r['peak'])} {_gib(r['comm_sent'])}")
    return 0
