"""One stage of the cascade: optional SFT warm-up, then RL, checkpointed and resumable.

A stage starts from the previous stage's ``final/`` checkpoint (or the initial model), writes
``checkpoints/step-N/`` every ``checkpoint_every`` steps and ``final/`` (an HF checkpoint plus
``run_state.json``) when done. Rerunning continues from the newest complete checkpoint.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

from cascade.checkpoint import COMPLETE, Checkpointer, copy_tokenizer, is_complete
from cascade.config import RunConfig, StageConfig
from train.dataclass_config import ConfigError


def expand_envs(spec: dict[str, float]) -> dict[str, float]:
    """Environment weights with glob patterns (``gym/*``) expanded; unknown ids are an error. Patterns that
    match the same environment add their weights; an exact id sets its own weight, whatever the order the
    keys are written in (``{gym/*: 1, gym/sudoku: 3}``: sudoku 3, every other gym environment 1)."""
    from envs.base import get_env, list_envs
    from envs.check import is_pattern, match_pattern  # "A|B": the first alternative that matches, logged

    if not spec:
        raise ConfigError("a stage needs at least one environment in 'envs'")
    known = list_envs()
    out: dict[str, float] = {}
    for pat, w in sorted(spec.items(), key=lambda kv: not is_pattern(kv[0])):  # patterns first, exact ids last
        if is_pattern(pat):
            hits = match_pattern(pat, known)
            if not hits:
                raise ConfigError(f"environment pattern {pat!r} matches nothing; `cascade envs list` shows the ids")
            for e in hits:
                out[e] = out.get(e, 0.0) + float(w)
        else:
            if ":" not in pat and pat not in known:
                get_env(pat)  # raises with close matches
            out[pat] = float(w)
    return out


def sft_envs(spec) -> dict[str, float]:
    """``sft.envs`` (a list: uniform, or ``{env: weight}``) with its patterns expanded; ``{}`` when empty."""
    if not spec:
        return {}
    return expand_envs(dict(spec) if isinstance(spec, dict) else {e: 1.0 for e in spec})


def handed_over(start_dir: Path, key: str):
    """``key`` of the run state a previous stage handed over in ``start_dir/run_state.json`` (its
    ``final/``); None when the stage starts from a plain model or the key is absent."""
    f = Path(start_dir) / "run_state.json"
    if not f.exists():
        return None
    return json.loads(f.read_text()).get(key)


def make_engine(rcfg: RunConfig, model_dir: Path, policy, tokenizer):
    if rcfg.engine == "vllm":
        try:
            from train.engine.vllm_engine import VLLMEngine
        except ImportError as e:
            raise ConfigError(f"engine=vllm needs vllm installed ({e}); see the README's vLLM section") from None
        return VLLMEngine(str(model_dir), **rcfg.vllm.engine_kwargs(rcfg.dtype))
    from train.engine.torch_engine import TorchEngine

    return TorchEngine(copy.deepcopy(policy), tokenizer)


def end_ids(engine, sampling, policy=None) -> set[int]:
    """The ids a rollout of ``engine`` ends on: the engine's EOS ids, ``policy``'s configs' (when given) and
    the sampling's ``stop_token_ids``. Aggregation tails leave them out."""
    from train.engine.torch_engine import eos_ids_of

    return ((eos_ids_of(policy.config) if policy is not None else set())
            | set(getattr(engine, "eos_token_ids", ())) | set(sampling.stop_token_ids))


def level(v, high: bool = False) -> int:
    """One difficulty level from a controller's summary (an RLVE window ``[low, high]``: ``low``, or with
    ``high`` its high end, the hardest level it samples)."""
    if isinstance(v, (list, tuple)):
        return int(v[-1 if high else 0]) if v else 0
    return int(v) if isinstance(v, (int, float)) else 0


class StageRunner:
    def __init__(self, name: str, index: int, scfg: StageConfig, rcfg: RunConfig, out: Path, records, progress=None):
        self.name, self.index, self.scfg, self.rcfg = name, index, scfg, rcfg
        self.dir = Path(out) / "stages" / f"{index}-{name}"
        self.final = self.dir / "final"
        self.records, self.progress = records, progress

    @property
    def done(self) -> bool:
        return is_complete(self.final)

    def total_steps(self) -> int:
        return self.scfg.sft.steps + self.scfg.steps

    @functools.cached_property
    def mixes(self) -> list[dict[str, float]]:
        """The environment mix of each phase (cascade/stagedata.py), expanded once per stage."""
        from cascade.stagedata import stage_mixes

        return stage_mixes(self.scfg)

    # ------------------------------------------------------------------------------------------
    def build_curriculum(self, tokenizer):
        from envs.base import get_env
        from envs.curriculum import Curriculum

        s = self.scfg
        from cascade.stagedata import controller_settings, union_mix

        weights = union_mix(self.mixes)  # every phase's environments (apply_phase sets the phase's mix)
        environments = {}
        if s.reward_model.path:
            from cascade.reward_model import GatedRewardEnv, RewardModel

            rm = RewardModel(s.reward_model.path, s.reward_model.max_len, self.rcfg.device)
            for e in weights:
                environments[e] = GatedRewardEnv(get_env(e, **s.env_kwargs.get(e, {})), rm, s.reward_model.scale)
        return Curriculum(weights, controller=s.controller, mode=s.sampling_mode, seed=self.rcfg.seed + self.index,
                          controller_kwargs=controller_settings(s), env_kwargs=s.env_kwargs, environments=environments)

    def run(self, start_dir: Path) -> Path:
        """Run (or resume) the stage; returns the ``final/`` checkpoint directory."""
        from train.model.hf_io import load_pretrained
        from train.rl.trainer import RLTrainer
        from train.sft import SFTConfig, SFTTrainer
        from train.tokenizer import load_tokenizer

        if self.done:
            self.check_same_start(json.loads((self.final / "run_state.json").read_text()).get("started_from"),
                                  start_dir, finished=True)
            return self.final
        s, r = self.scfg, self.rcfg
        torch.manual_seed(r.seed + 1000 * self.index)
        ckpt = Checkpointer(self.dir / "checkpoints")
        latest, resumed = ckpt.latest_loadable(lambda line: print(f"cascade run: stage {self.name}: {line}",
                                                                  file=sys.stderr))
        src = ckpt.pinned = latest or Path(start_dir)
        dtype = torch.bfloat16 if r.dtype == "bfloat16" else torch.float32
        policy = load_pretrained(src, dtype=dtype, device=r.device)
        tok = load_tokenizer(src)
        from cascade.rollout import ServedEngine

        engine = self.start_engine(src, policy, tok)
        pipe = None  # PipelineRL around the trainer once RL starts, when max_staleness > 0
        rl = None
        try:
            curriculum = self.build_curriculum(tok)
            start_levels = self.start_levels(curriculum)  # before any resumed state moves the controllers
            mixer = self.make_mixer(tok, curriculum, policy, engine)
            rl_cfg = copy.deepcopy(s.rl)
            rl_cfg.seed = r.seed + 7919 * (self.index + 1) + s.rl.seed  # (a stage's rl.seed, 0 by default, moves it)
            rl_cfg.optim = rl_cfg.optim.over(s.steps)
            rl = RLTrainer(policy, tok, engine, curriculum, rl_cfg,
                           problem_hook=mixer.mix if mixer else None, rollout_hook=mixer.remember if mixer else None)
            if mixer is not None:  # an aggregation prompt the trainer would skip as too long is not made
                mixer.bound(rl.max_prompt_tokens)
            sft_cfg = SFTConfig(steps=s.sft.steps, batch_size=s.sft.batch_size, micro_batch_size=s.sft.micro_batch_size,
                                tokens_per_micro=s.sft.tokens_per_micro,
                                optim=s.sft.optim, max_len=s.sft.max_len, chat_template=rl_cfg.chat_template,
                                system_prompt=rl_cfg.system_prompt, seed=r.seed + self.index)
            sft = SFTTrainer(policy, tok, sft_cfg) if s.sft.steps > 0 else None
            state = {"step": 0, "pool": None, "eval_before": None, "started_from": str(start_dir)}
            carried = handed_over(start_dir, "length_reward")  # p* and the c schedule run on across stages
            if carried is not None:
                rl.length_state.load_state_dict(carried)
            pipe_state = None
            if latest is not None:
                tstate, state = resumed
                self.check_same_trainer(state, latest)
                self.check_same_start(state.setdefault("started_from", str(start_dir)), start_dir)
                pipe_state = tstate.get("pipeline")
                if state["pool"] is not None:
                    rl.curriculum = self.pool_of(curriculum, state["pool"])
                # a bf16 policy's optimizers each put their fp32 masters into its weights: the phase that trained
                # last goes last (after the SFT warm-up, SFT's masters are the weights as SFT left them)
                loads = [(rl, tstate["rl"])]
                if sft is not None and tstate.get("sft"):
                    loads.append((sft, tstate["sft"]))
                for trainer, st in (loads[::-1] if state["step"] >= s.sft.steps else loads):
                    trainer.load_state_dict(st)
                if mixer is not None and tstate.get("mixer"):
                    mixer.load_state_dict(tstate["mixer"])
            self.records.begin(self.name, state["step"])  # TensorBoard drops an abandoned attempt's later steps
            # servers (started or given) serve exactly this policy from the start; a resumed engine, built from the
            # checkpoint's weights, takes them as the checkpoint's version (else its rollouts say version 0)
            if isinstance(engine, ServedEngine) or latest is not None:
                from train.engine.remote import RemoteError

                try:
                    rl.sync_weights()
                except RemoteError as e:
                    raise ConfigError(f"the rollout servers cannot load this run's weights ({e}); servers given by "
                                      f"rollout.urls must serve this run's policy (the same architecture and "
                                      f"sizes) with --weights-dir {engine.exchange}") from None
            held = self.eval_problems(curriculum, start_levels)
            # no training draw (RL, the pass-rate pool, expert tails, SFT reference answers) is a held-out problem
            curriculum.exclude = self.held_out(curriculum, held)
            if mixer is not None and s.aggregation.expert and s.aggregation.expert_fraction > 0 and not mixer.expert:
                self.expert_tails(mixer, curriculum, rl)
            state.setdefault("difficulty_start", start_levels)
            # controllers that calibrate their start (zaya): the stage's start level is the one calibration picks
            state.setdefault("calibrating", sorted(e for e, c in curriculum.controllers.items()
                                                   if getattr(c, "calibrating", False)))
            state.setdefault("difficulty_max", dict(start_levels))
            if state["eval_before"] is None:
                ev = self.evaluate_k(rl, held, "before")
                state["eval_before"], state["eval_before_families"] = ev["accuracy"], ev["families"]
                self.records.log(self.name, "eval", 0, {"accuracy_before": ev["accuracy"], "eval_k": ev["k"],
                                                        "accuracy_before_by_family": ev["families"]})
            total = self.total_steps()
            task = self.progress.add_task(self.name, total=total, completed=state["step"], info="") if self.progress else None
            sft_data = None
            while state["step"] < total:
                step = state["step"]
                if rl.learner is None and r.trainer.distributed:  # SFT and RL on the trainer ranks
                    rl.learner = self.start_learner(rl, policy, src, sft)
                if step < s.sft.steps:
                    if sft_data is None:
                        sft_data = self.sft_examples(sft, tok, curriculum, rl)
                    if rl.learner is not None:
                        m = rl.learner.sft(sft.sample_batch(sft_data), sft.step_idx)
                        sft.step_idx += 1
                    else:
                        m = sft.step(sft.sample_batch(sft_data))
                    self.records.log(self.name, "sft", step, m)
                    info = f"sft loss {m['sft_loss']:.3f}"
                    if step + 1 == s.sft.steps:
                        if rl.learner is not None:  # the ranks' weights after SFT (published as RL version 0)
                            from train.model.hf_io import load_into

                            load_into(policy, rl.learner.weights(0))
                        rl.after_external_update()
                        rl.sync_weights()
                else:
                    if s.pool.size and state["pool"] is None:
                        state["pool"] = self.filter_pool(rl, curriculum)
                        rl.curriculum = self.pool_of(curriculum, state["pool"])
                    if pipe is None and rl_cfg.max_staleness > 0:
                        from train.rl.pipeline import Pipeline

                        # a resumed run's waiting groups first; each batch sampled under the phase and response
                        # cap of the step that trains it (the producer runs ahead), and none past the last step
                        first = step - s.sft.steps
                        pipe = Pipeline(rl, pipe_state, batches=total - step,
                                        before_batch=lambda k: self.apply_phase(rl, curriculum, mixer, first + k))
                        pipe_state = None
                    elif pipe_state is not None:  # pipelined before the resume, not now
                        print(f"cascade run: stage {self.name}: rl.max_staleness=0 now: the "
                              f"{len(pipe_state['queue'])} rollout group(s) the checkpoint holds, produced ahead "
                              "of the trainer, are not trained on", file=sys.stderr)
                        pipe_state = None
                    data = self.apply_phase(rl, curriculum, mixer, step - s.sft.steps) if pipe is None else {}
                    m = pipe.step() if pipe is not None else rl.step()
                    m.update(data)
                    # training draws of a held-out prompt drawn again, and those kept (a level with fewer problems)
                    m.update(heldout_redraws=curriculum.heldout_redraws, heldout_overlap=curriculum.heldout_overlap)
                    if mixer is not None:
                        m.update(mixer.metrics())
                    if isinstance(engine, ServedEngine):
                        m["prompts_resent"] = engine.remote.resent
                        m["servers_up"] = len(engine.remote.alive)
                        m["server_restarts"] = engine.pool.restarts if engine.pool is not None else 0
                        m["servers_readmitted"] = engine.remote.readmitted
                        if engine.broadcaster is not None:
                            m["weight_broadcast_failures"] = engine.broadcast_failures
                    self.records.log(self.name, "rl", step, m)
                    self.track_difficulty(state, rl.curriculum.difficulties(), curriculum)
                    info = f"reward {m['reward_mean']:.2f} acc {m['accuracy']:.2f}"
                state["step"] = step + 1
                if self.progress:
                    self.progress.update(task, completed=state["step"], info=info)
                if state["step"] % s.checkpoint_every == 0 and state["step"] < total:
                    if pipe is not None:
                        with pipe.paused():
                            self.save(ckpt, policy, src, rl, sft, mixer, state, pipe)
                    else:
                        self.save(ckpt, policy, src, rl, sft, mixer, state)
            if pipe is not None:
                pipe.close()
                pipe = None
            if rl.learner is not None:  # the ranks' last weights, whatever the sync schedule
                from train.model.hf_io import load_into

                load_into(policy, rl.learner.final())
            rl.sync_final()  # the engine scores the policy final/ holds, not the last sync_every's
            ckpt.wait()
            rl.cfg.sampling.max_new_tokens = s.rl.sampling.max_new_tokens  # evaluated as before the stage
            after = self.evaluate_k(rl, held, "after")
            self.records.log(self.name, "eval", total, {"accuracy_before": state["eval_before"],
                                                        "accuracy_after": after["accuracy"], "eval_k": after["k"],
                                                        "accuracy_before_by_family": state.get("eval_before_families"),
                                                        "accuracy_after_by_family": after["families"],
                                                        "difficulty_start": state.get("difficulty_start"),
                                                        "difficulty_end": rl.curriculum.difficulties(),
                                                        "difficulty_max": state.get("difficulty_max")})
            self.write_final(policy, src, rl, sft, mixer, state, after, Path(start_dir))
        finally:
            if pipe is not None:
                pipe.close()
            if rl is not None and rl.learner is not None:
                rl.learner.close()
            if rl is not None:
                engine = rl.engine  # (other_engine may have started the policy's again)
            if hasattr(engine, "close"):
                engine.close()
        return self.final

    def start_engine(self, src: Path, policy, tok):
        """The stage's rollout engine for the checkpoint ``src``: the run's servers (started or given by URL), else
        one in this process, with a progress bar while vLLM or servers start."""
        from cascade.rollout import served_engine

        r = self.rcfg
        slow_start = r.engine == "vllm" or r.rollout.servers > 0  # vLLM, or rollout servers to start
        with self.phase("engine", None, "starting the rollout engine") if slow_start else contextlib.nullcontext():
            return (served_engine(r, src, self.dir.parent.parent, self.dir / "logs")
                    or make_engine(r, src, policy, tok))

    def score(self, src: Path) -> dict:
        """``cascade eval``: the held-out score of the checkpoint ``src`` as :meth:`run` scores its policy before and
        after the stage (the same problems, levels, seed, sampling and engine), without training. Returns
        :func:`~cascade.evaluation.avg_at_k`'s dict with the levels the problems were drawn at."""
        from cascade.rollout import ServedEngine
        from train.model.hf_io import load_pretrained
        from train.rl.trainer import RLTrainer
        from train.tokenizer import load_tokenizer

        r = self.rcfg
        policy = load_pretrained(src, dtype=torch.bfloat16 if r.dtype == "bfloat16" else torch.float32, device=r.device)
        tok = load_tokenizer(src)
        engine = self.start_engine(src, policy, tok)
        try:
            curriculum = self.build_curriculum(tok)
            levels = self.start_levels(curriculum)
            rl = RLTrainer(policy, tok, engine, curriculum, copy.deepcopy(self.scfg.rl))
            if isinstance(engine, ServedEngine):  # servers given by URL serve this checkpoint from now on
                from train.engine.remote import RemoteError

                try:
                    rl.sync_weights()
                except RemoteError as e:
                    raise ConfigError(f"the rollout servers cannot load {src} ({e}); servers given by rollout.urls "
                                      f"load it from --weights-dir {engine.exchange}: start them with that, or pass "
                                      "out=DIR whose exchange/ they read") from None
            out = self.evaluate_k(rl, self.eval_problems(curriculum, levels), "of")
        finally:
            if hasattr(engine, "close"):
                engine.close()
        fixed = self.scfg.eval_difficulty
        return {**out, "difficulty": {e: fixed for e in levels} if fixed is not None else levels}

    # ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, what: str, total: int | None, info: str):
        """A progress bar for one phase of the stage (``total=None``: a pulsing one); yields
        ``advance(k)``. The bar goes when the phase ends."""
        if self.progress is None:
            yield lambda k=1: None
            return
        task = self.progress.add_task(what, total=total, info=f"{self.name}: {info}")
        try:
            yield lambda k=1: self.progress.advance(task, k)
        finally:
            self.progress.remove_task(task)

    def chunk(self, rl, samples: int) -> int:
        """Problems per engine call in the long phases (pool filter, evaluation): one RL step's rollouts."""
        return max(1, rl.cfg.prompts_per_step * rl.cfg.group_size // max(samples, 1))

    def evaluate(self, rl, held: list, when: str) -> float:
        """Held-out accuracy (:meth:`evaluate_k`'s overall figure)."""
        return self.evaluate_k(rl, held, when)["accuracy"]

    def evaluate_k(self, rl, held: list, when: str) -> dict:
        """avg@k on the held-out problems (``eval_k`` sampled answers each; 0: one greedy answer), overall
        and per environment family (cascade/evaluation.py), with a progress bar: the problems go to the
        engine one RL step's worth of rollouts at a time; prompts too long for the context are left out."""
        from cascade.evaluation import avg_at_k

        k = self.scfg.eval_k
        what = f"avg@{k}" if k else "greedy"
        with self.phase("eval", len(held), f"held-out accuracy ({what}) {when} the stage") as advance:
            return avg_at_k(rl, held, k, seed=self.rcfg.seed + self.index, chunk=self.chunk(rl, max(k, 1)),
                            advance=advance)

    # -- stage data: phases, the response cap, aggregation sources ---------------------------------
    def apply_phase(self, rl, curriculum, mixer, rl_step: int) -> dict:
        """Before RL step ``rl_step``: the phase's mix and aggregation share, and the response cap of
        ``max_new_tokens_schedule``; returns what to log."""
        from cascade.stagedata import max_new_tokens_at, phase_at, set_mix

        s = self.scfg
        out = {}
        if s.phases:
            idx, ph = phase_at(s, rl_step)
            set_mix(curriculum, self.mixes[idx])
            if mixer is not None:
                mixer.fraction = s.aggregation.fraction if ph.aggregation is None else ph.aggregation
            out["mix_phase"] = idx
        if s.max_new_tokens_schedule:
            if not rl.cfg.length_cfg.l_max:  # the length reward's l_max stays the constant it was (RECIPE.md)
                rl.cfg.length_cfg.l_max = s.rl.sampling.max_new_tokens
            rl.cfg.sampling.max_new_tokens = max_new_tokens_at(s, rl_step, s.rl.sampling.max_new_tokens)
            out["max_new_tokens"] = rl.cfg.sampling.max_new_tokens
        return out

    def make_mixer(self, tok, curriculum, policy=None, engine=None):
        """The aggregation mixer (None when no aggregation prompts are configured, in any phase). Tails leave
        out the token a rollout ended on: any id the policy's generation ends on (``policy``'s configs, the
        ``engine``'s) or the sampling's ``stop_token_ids``."""
        s, a = self.scfg, self.scfg.aggregation
        if a.fraction <= 0 and not any(p.aggregation for p in s.phases):
            return None
        from cascade.aggregation import AggregationMixer
        from train.rl.trainer import encode_prompt

        def prompt_len(text: str) -> int:
            return len(encode_prompt(tok, text, s.rl.chat_template, s.rl.system_prompt))

        return AggregationMixer(tok, a.fraction, a.tails, a.tail_tokens, a.template, a.buffer, self.rcfg.seed + self.index,
                                max_prompt_tokens=a.max_prompt_tokens, prompt_len=prompt_len,
                                expert_fraction=a.expert_fraction if a.expert else 0.0,
                                pacore_fraction=a.pacore_fraction, env_of=curriculum.envs.__getitem__,
                                stop_ids=end_ids(engine, s.rl.sampling, policy))

    def model_ref(self, ref: str) -> Path:
        """A checkpoint named in the config: an earlier stage of this run (its ``final/``), a local
        directory or an HF Hub id."""
        from envs.hub import resolve_model

        hits = sorted(self.dir.parent.glob(f"*-{ref}/final"))
        if hits and is_complete(hits[-1]):
            return hits[-1]
        p = resolve_model(ref, "checkpoint")
        if not (p / "config.json").is_file():
            raise ConfigError(f"stage {self.name}: {ref!r} is neither a finished stage of this run nor a checkpoint "
                              f"directory ({str(p)!r} has no config.json)")
        return p

    @contextlib.contextmanager
    def other_engine(self, ref: str, rl=None):
        """An engine (and its tokenizer) on the checkpoint ``ref``, closed afterwards. An in-process vLLM
        engine holds its share of the GPU (``vllm.gpu_memory_utilization``) until it is closed, so the
        policy's (``rl.engine``) is closed while this one runs and started again afterwards from its
        checkpoint: both callers run before this process's first update (the expert tails before the
        loop, the teacher's examples at its first SFT step), when that checkpoint holds the engine's
        weights. ``rl`` None: no policy engine to make room for."""
        from train.tokenizer import load_tokenizer

        r = self.rcfg
        path = self.model_ref(ref)
        tok = load_tokenizer(path)
        swap = False
        if r.engine == "vllm":
            from train.engine.vllm_engine import VLLMEngine

            swap = rl is not None and isinstance(rl.engine, VLLMEngine)  # in process (not rollout servers)
        if swap:
            policy_dir = rl.engine.model_path
            rl.engine.close()
            engine = make_engine(r, path, None, tok)  # (a vLLM engine loads the checkpoint itself)
        else:
            from train.model.hf_io import load_pretrained

            model = load_pretrained(path, dtype=torch.bfloat16 if r.dtype == "bfloat16" else torch.float32,
                                    device=r.device)
            engine = make_engine(r, path, model, tok)
        try:
            yield engine, tok
        finally:
            if hasattr(engine, "close"):
                engine.close()
            if swap:
                rl.engine = make_engine(r, policy_dir, None, None)

    def stream(self, name: str) -> random.Random:
        """The random stream of this stage's ``name``d draws of problems (``pool``, ``expert``, ``aggregation_sft``):
        each its own, in every stage (offsets ``k * index`` of the run's seed made them one stream in the first
        stage). The pool's keeps the seed it always had, so that earlier runs' pools are drawn again."""
        if name == "pool":
            return random.Random(self.rcfg.seed + 31 * self.index)
        return random.Random(f"{name}:{self.rcfg.seed}:{self.index}")

    def expert_tails(self, mixer, curriculum, rl) -> None:
        """Expert aggregation: rollouts of ``aggregation.expert`` on problems of the stage's mix, kept
        by the mixer as tails of expert-aggregation prompts (once per stage; the mixer's state keeps them)."""
        from cascade.aggregation import sample_rollouts

        a = self.scfg.aggregation
        picks = curriculum.sample(self.stream("expert"), a.expert_problems)
        c = rl.cfg
        with self.other_engine(a.expert, rl) as (engine, etok), \
                self.phase("expert", len(picks), f"expert rollouts from {a.expert}") as advance:
            rolled = sample_rollouts(engine, etok, picks, a.expert_samples, c.sampling.params(a.expert_samples, self.rcfg.seed),
                                     c.chat_template, c.system_prompt, chunk=self.chunk(rl, a.expert_samples),
                                     advance=advance)
        stops = end_ids(engine, c.sampling)
        for e, p, comps in rolled:  # the expert's tokens, decoded by its tokenizer
            mixer.remember_expert(e, p, comps, etok, stops)
        self.records.log(self.name, "expert", 0, {"expert_problems": len(rolled), "expert_pool": len(mixer.expert)})

    @staticmethod
    def aggregation_sft_prompt_cap(s, max_tokens: int) -> int:
        """The longest aggregation SFT prompt: RL's ``aggregation.max_prompt_tokens``, and ``sft.max_len`` less room
        for the teacher's answer (its ``max_tokens`` and the end token, at most half of ``sft.max_len``: a longer
        answer has its thinking trimmed to fit), tails cut from the front to fit. At RL's 20,480 four 4,096-token
        tails made every prompt longer than the SFT default 8,192: all dropped by the trim after the teacher had
        answered them."""
        room = min(max_tokens + 1, s.sft.max_len // 2)
        return min(s.aggregation.max_prompt_tokens, s.sft.max_len - room)

    def aggregation_sft(self, tok, curriculum, n_other: int, rl=None) -> list[tuple[str, str]]:
        """SFT pairs for aggregation from ``sft.aggregation.teacher`` (cascade/aggregation.py), as many
        as make ``fraction`` of the SFT examples beside the ``n_other`` others."""
        from cascade.aggregation import aggregation_sft_pairs
        from train.rl.trainer import encode_prompt

        s = self.scfg
        a = s.sft.aggregation
        rc = s.rl
        picks = curriculum.peek(self.stream("aggregation_sft"), a.problems)  # (a resume in SFT draws them again)
        params = rc.sampling.params(a.samples, self.rcfg.seed + self.index)
        if a.max_new_tokens:
            params.max_tokens = a.max_new_tokens
        with self.other_engine(a.teacher, rl) as (engine, ttok), \
                self.phase("sft data", len(picks), f"aggregation examples from {a.teacher}") as advance:
            pairs, stats = aggregation_sft_pairs(
                engine, ttok, picks, curriculum.envs.__getitem__, params, samples=a.samples, shuffles=a.shuffles,
                tails=a.tails, tail_tokens=a.tail_tokens, template=a.template,
                max_prompt_tokens=self.aggregation_sft_prompt_cap(s, params.max_tokens),
                prompt_len=lambda t: len(encode_prompt(tok, t, rc.chat_template, rc.system_prompt)),
                chat=rc.chat_template, system=rc.system_prompt, seed=self.rcfg.seed + self.index, advance=advance,
                workers=rc.verify_workers)
        want = round(a.fraction / max(1e-9, 1 - a.fraction) * n_other) if a.fraction < 1 else len(pairs)
        pairs = pairs[:max(want, 0)]
        self.records.log(self.name, "sft_aggregation", 0, {**stats, "aggregation_sft_examples": len(pairs)})
        return pairs

    @staticmethod
    def start_levels(curriculum) -> dict[str, int]:
        """Each environment's difficulty level before RL moves it (an RLVE window's low end; 0 while a
        controller calibrates its start)."""
        return {e: level(v) for e, v in curriculum.difficulties().items()}

    @staticmethod
    def track_difficulty(state: dict, now: dict, curriculum=None) -> None:
        """The highest level each environment reached during the stage, in ``state["difficulty_max"]`` (an RLVE
        window's high end: the highest level it sampled); an environment whose controller calibrated its start
        gets the level calibration ended at as its ``difficulty_start`` (its 0 before was no level)."""
        top = state["difficulty_max"]  # set from the start levels when the stage starts
        for e, v in now.items():
            top[e] = max(top.get(e, 0), level(v, high=True))
        for e in list(state.get("calibrating", [])) if curriculum is not None else []:
            if e in now and not getattr(curriculum.controllers.get(e), "calibrating", False):
                state["difficulty_start"][e] = level(now[e])
                state["calibrating"].remove(e)

    def eval_problems(self, curriculum, start_levels: dict[str, int] | None = None):
        """The stage's held-out problems, at ``eval_difficulty`` or else at each environment's start level
        (``start_levels``; default: the curriculum's levels now), so that the scores before and after the
        stage are on the same problems. Environments take shares of them in proportion to the stage's mix
        (every phase's, as :func:`~cascade.stagedata.union_mix` weighs them), dealt by smooth weighted
        round robin (equal weights take turns in name order)."""
        from cascade.stagedata import union_mix

        if start_levels is None:
            start_levels = self.start_levels(curriculum)
        rng = random.Random(10_000 + self.index)
        weights = dict(sorted(union_mix(self.mixes).items()))  # the mix the curriculum is built from
        total, turn = sum(weights.values()), dict.fromkeys(weights, 0.0)
        fixed = self.scfg.eval_difficulty
        out = []
        for _ in range(self.scfg.eval_problems):
            for k, w in weights.items():
                turn[k] += w
            e = max(turn, key=lambda k: round(turn[k], 9))  # the first in name order on a tie
            turn[e] -= total
            d = fixed if fixed is not None else start_levels.get(e, 0)
            out.append((e, curriculum.envs[e].heldout(10**9 + rng.getrandbits(30), d)))
        return out

    def held_out(self, curriculum, held) -> set[str]:
        """Normalized prompts of the stage's held-out problems and of those its environments hold out."""
        from envs.hub import normalize_text

        return {normalize_text(p.prompt) for _, p in held} | self.heldout_texts(curriculum)

    @staticmethod
    def heldout_texts(curriculum) -> set[str]:
        """Normalized texts of the problems the environments hold out for evaluation (``math`` datasets)."""
        out: set[str] = set()
        for env in (curriculum.envs.values() if curriculum is not None else ()):
            if hasattr(env, "heldout_texts"):
                out |= env.heldout_texts()
        return out

    def sft_examples(self, sft, tok, curriculum, rl=None):
        from cascade.trim import trim_pairs
        from envs.hub import normalize_text
        from train.sft import load_pairs, prompt_ids, prompt_text, reference_pairs

        s = self.scfg.sft
        extra = {}
        if s.data:
            pairs = load_pairs(s.data, s.columns, s.split, s.subset)
            # held-out evaluation never sees a prompt trained on, from SFT data either: the stage's own evaluation
            # problems and those its environments hold out (curriculum.exclude, which run() sets to both; the
            # environments' alone where it is not set)
            held = (curriculum.exclude if curriculum is not None else None) or self.heldout_texts(curriculum)
            if held:
                n = len(pairs)
                pairs = [pr for pr in pairs if normalize_text(prompt_text(pr[0])) not in held]
                extra["dropped_heldout"] = n - len(pairs)
                if not pairs:
                    raise ConfigError(f"stage {self.name}: all {n} examples of sft.data {s.data!r} are held-out "
                                      "evaluation problems")
        else:
            # by default the stage's environments that have reference answers (named ones must all have one)
            named = sft_envs(s.envs)  # patterns (gym/*) expanded, as the config check expanded them
            env_ids = list(named) or [e for e, env in curriculum.envs.items()
                                      if ":" not in e and not getattr(env, "no_reference_reason", "")]
            if not env_ids:
                raise ConfigError(f"stage {self.name}: no environment of its mix has reference answers for SFT; "
                                  "name them in sft.envs or give sft.data")
            weights = list(named.values()) if isinstance(s.envs, dict) and named else None  # (a list: uniform)
            with self.phase("sft data", s.examples, "reference solutions") as advance:
                pairs = reference_pairs(env_ids, s.examples, seed=self.rcfg.seed + self.index, weights=weights,
                                        difficulties=s.difficulties, env_kwargs=self.scfg.env_kwargs, advance=advance,
                                        exclude=curriculum.exclude if curriculum is not None else None)
        if s.aggregation.teacher and s.aggregation.fraction > 0:  # C teacher tails -> the teacher's aggregated answer
            pairs = list(pairs) + self.aggregation_sft(tok, curriculum, len(pairs), rl)
        cfg = sft.cfg
        kept, dropped, encoded = [], 0, []
        with self.phase("sft data", len(pairs), "trimming and tokenizing") as advance:
            for i in range(0, len(pairs), 256):
                part, d = trim_pairs(tok, pairs[i:i + 256], cfg.max_len - 1,
                                     lambda p: len(prompt_ids(tok, p, cfg.chat_template, cfg.system_prompt)),
                                     sft.think_open)
                kept += part
                dropped += d
                encoded += sft.encode(part)
                advance(min(256, len(pairs) - i))
        if not kept:
            raise ConfigError(f"stage {self.name}: no SFT example fits sft.max_len={cfg.max_len}")
        self.records.log(self.name, "sft_data", 0, {"examples": len(kept), "dropped_by_trim": dropped, **extra})
        return encoded

    def filter_pool(self, rl, curriculum) -> list:
        from cascade.pool import filter_by_pass_rate

        p = self.scfg.pool
        picks = curriculum.sample(self.stream("pool"), p.size)
        with self.phase("pool", len(picks), f"pass-rate filter, {p.samples} rollouts per problem") as advance:
            kept, rates = filter_by_pass_rate(rl, picks, p.samples, p.max_pass_rate, p.min_pass_rate,
                                              chunk=self.chunk(rl, p.samples), advance=advance)
        in_range = len(kept)
        if not kept:  # nothing in range: train on the whole pool rather than stop (said, and logged)
            kept = picks
            print(f"cascade run: stage {self.name}: no pool problem's pass rate is within [{p.min_pass_rate}, "
                  f"{p.max_pass_rate}] (mean {sum(rates) / max(len(rates), 1):.2f}); training on all {len(picks)}",
                  file=sys.stderr)
        self.records.log(self.name, "pool", 0, {"pool_size": len(picks), "pool_kept": len(kept),
                                               "pool_in_range": in_range, "pool_fallback": not in_range,
                                               "pass_rate_mean": sum(rates) / max(len(rates), 1)})
        return [[e, pr.to_dict()] for e, pr in kept]

    @staticmethod
    def pool_of(curriculum, pool: list):
        from cascade.pool import ProblemPool
        from envs.base import Problem

        return ProblemPool(curriculum, [(e, Problem.from_dict(p)) for e, p in pool])

    def _trainer_state(self, rl, sft, mixer, pipe=None) -> dict:
        return {"rl": rl.state_dict(), "sft": sft.state_dict() if sft else None,
                "mixer": mixer.state_dict() if mixer else None,
                "pipeline": pipe.state() if pipe is not None else None}  # (taken inside pipe.paused())

    @staticmethod
    def updates_done(rl, sft) -> int:
        """Optimizer updates of this stage so far, SFT and RL (the trainer ranks' numbering)."""
        return (sft.step_idx if sft is not None else 0) + rl.step_idx

    def start_learner(self, rl, policy, src: Path, sft=None):
        """Trainer ranks under torchrun (cascade/learner.py), starting from the policy as it is now;
        they run the stage's SFT steps too."""
        from cascade.learner import WorkerLearner
        from train.model.hf_io import save_pretrained

        start = self.dir / "trainer-start"
        save_pretrained(policy, start, tokenizer_dir=src)
        r, s = self.rcfg, self.scfg
        return WorkerLearner(self.dir.parent.parent / "exchange", start, r.trainer, rl.cfg, s.steps,
                             self.updates_done(rl, sft), self.dir / "logs", r.dtype, rl.pad_id, r.device,
                             sft_steps=s.sft.steps, sft_optim=s.sft.optim.over(s.sft.steps))  # (as SFTTrainer's)

    def save(self, ckpt: Checkpointer, policy, src: Path, rl, sft, mixer, state: dict, pipe=None) -> None:
        from cascade.checkpoint import _fault

        if rl.learner is not None:  # the ranks checkpoint the same update; this copy of the policy takes its weights
            from train.model.hf_io import load_into

            # once the previous checkpoint is written: the ranks prune theirs as they write, and a run killed while
            # it was still being written resumes from the one before, which they must still have
            ckpt.wait()
            load_into(policy, rl.learner.checkpoint(self.updates_done(rl, sft)))
        if rl.learner is None and rl.synced_version != rl.step_idx:
            # the engine takes the policy saved here (rl.sync_every > 1 may leave it a version behind): a run
            # resumed from this checkpoint samples from these weights, and so does the run that goes on
            rl.sync_weights()
        _fault("before_checkpoint", state["step"])
        state["trainer_ranks"] = self.rcfg.trainer.distributed  # where the optimizer state of this checkpoint lives
        ckpt.save(state["step"], policy, src, self._trainer_state(rl, sft, mixer, pipe), state)

    def check_same_trainer(self, state: dict, latest: Path) -> None:
        """A checkpoint's optimizer state lives where its updates ran: on the trainer ranks (their sharded
        checkpoints in OUT/exchange) or in this process (trainer_state.pt). Resuming on the other side
        would restart the optimizer and its schedule unseen: refuse it in one line."""
        ranks, now = state.get("trainer_ranks"), self.rcfg.trainer.distributed
        if ranks is None or ranks == now:
            return
        where = ("trainer ranks (trainer.nproc/nnodes > 1), which hold its optimizer state in OUT/exchange: resume "
                 "with trainer ranks again (any mesh)" if ranks else
                 "this process (trainer.nproc=1), whose optimizer state the ranks do not read: resume with "
                 "trainer.nproc=1 trainer.nnodes=1")
        raise ValueError(f"stage {self.name}: checkpoint {latest.name} was taken by {where}, or pass overwrite=true "
                         f"to start the run over")

    def check_same_start(self, started: str | None, start_dir: Path, finished: bool = False) -> None:
        """The stage continues (or, ``finished``, keeps) what it started from: a stage resumed from a checkpoint of
        another start (``stage=rlve`` alone, then the whole cascade: rlve went on from the fresh model while its
        ``final/`` said the warm-up's) is refused in one line; a finished one keeps what it ran, said so. A start
        inside the run directory (``init-model/``, an earlier stage's ``final/``) is compared within it: a run
        directory moved elsewhere resumes."""
        if started is None or Path(started).resolve() == Path(start_dir).resolve():
            return
        try:
            inside = Path(start_dir).resolve().relative_to(self.dir.parent.parent.resolve()).parts
        except ValueError:
            inside = ()
        if inside and Path(started).parts[-len(inside):] == inside:
            return
        if finished:
            print(f"cascade run: note: stage {self.name} finished, started from {started}; this run would start it "
                  f"from {start_dir}: it keeps what it ran (delete {self.dir} to run it again from there)",
                  file=sys.stderr)
            return
        raise ConfigError(f"stage {self.name}: its checkpoints continue a stage started from {started}, and this run "
                          f"starts it from {start_dir}; delete {self.dir} to run it from there, or pass overwrite=true "
                          f"to start the run over")

    def write_final(self, policy, src: Path, rl, sft, mixer, state: dict, after: dict, start_dir: Path) -> None:
        """``final/``: the policy, the tokenizer of ``src`` and the run state (``started_from``: the stage's start,
        ``start_dir``, also after a resume from a checkpoint)."""
        import shutil

        from train.model.hf_io import save_pretrained

        tmp = self.dir / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_pretrained(policy, tmp)
        copy_tokenizer(src, tmp)
        run_state = {"stage": self.name, "steps": state["step"], "started_from": state.get("started_from", str(start_dir)),
                     "accuracy_before": state["eval_before"],
                     "accuracy_after": after["accuracy"], "eval_k": after["k"], "eval_skipped": after["skipped"],
                     "accuracy_before_by_family": state.get("eval_before_families"),
                     "accuracy_after_by_family": after["families"], "difficulty": rl.curriculum.difficulties(),
                     "difficulty_start": state.get("difficulty_start"), "difficulty_max": state.get("difficulty_max"),
                     "eval_difficulty": self.scfg.eval_difficulty,
                     "length_reward": rl.length_state.state_dict(), "finished": time.time()}
        (tmp / "run_state.json").write_text(json.dumps(run_state, indent=2, default=str))
        torch.save(self._trainer_state(rl, sft, mixer), tmp / "trainer_state.pt")
        if self.final.exists():
            shutil.rmtree(self.final)
        tmp.rename(self.final)
        (self.final / COMPLETE).write_text("ok\n")
