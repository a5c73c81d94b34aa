"""One stage of the cascade: optional SFT warm-up, then RL, checkpointed and resumable.

A stage starts from the previous stage's ``final/`` checkpoint (or the initial model), writes
``checkpoints/step-N/`` every ``checkpoint_every`` steps and ``final/`` (an HF checkpoint plus
``run_state.json``) when done. Rerunning continues from the newest complete checkpoint.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import random
import time
from pathlib import Path

import torch

from cascade.checkpoint import COMPLETE, Checkpointer, copy_tokenizer, is_complete, load_trainer_state
from cascade.config import RunConfig, StageConfig
from train.dataclass_config import ConfigError


def expand_envs(spec: dict[str, float]) -> dict[str, float]:
    """Environment weights with glob patterns (``gym/*``) expanded; unknown ids are an error."""
    from envs.base import get_env, list_envs

    if not spec:
        raise ConfigError("a stage needs at least one environment in 'envs'")
    known = list_envs()
    out: dict[str, float] = {}
    for pat, w in spec.items():
        if any(c in pat for c in "*?["):
            hits = [e for e in known if fnmatch.fnmatch(e, pat)]
            if not hits:
                raise ConfigError(f"environment pattern {pat!r} matches nothing; `cascade envs list` shows the ids")
            for e in hits:
                out[e] = out.get(e, 0.0) + float(w)
        else:
            if ":" not in pat and pat not in known:
                get_env(pat)  # raises with close matches
            out[pat] = float(w)
    return out


def make_engine(rcfg: RunConfig, model_dir: Path, policy, tokenizer):
    if rcfg.engine == "vllm":
        try:
            from train.engine.vllm_engine import VLLMEngine
        except ImportError as e:
            raise ConfigError(f"engine=vllm needs vllm installed ({e}); see the README's vLLM section") from None
        return VLLMEngine(str(model_dir), dtype=rcfg.dtype)
    from train.engine.torch_engine import TorchEngine

    return TorchEngine(copy.deepcopy(policy), tokenizer)


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

    # ------------------------------------------------------------------------------------------
    def build_curriculum(self, tokenizer):
        from envs.base import get_env
        from envs.curriculum import Curriculum

        s = self.scfg
        weights = expand_envs(s.envs)
        environments = {}
        if s.reward_model.path:
            from cascade.reward_model import GatedRewardEnv, RewardModel

            rm = RewardModel(s.reward_model.path, s.reward_model.max_len, self.rcfg.device)
            for e in weights:
                environments[e] = GatedRewardEnv(get_env(e, **s.env_kwargs.get(e, {})), rm, s.reward_model.scale)
        return Curriculum(weights, controller=s.controller, mode=s.sampling_mode, seed=self.rcfg.seed + self.index,
                          controller_kwargs=s.controller_kwargs, env_kwargs=s.env_kwargs, environments=environments)

    def run(self, start_dir: Path) -> Path:
        """Run (or resume) the stage; returns the ``final/`` checkpoint directory."""
        from train.model.hf_io import load_pretrained
        from train.rl.trainer import RLTrainer
        from train.sft import SFTConfig, SFTTrainer
        from train.tokenizer import load_tokenizer

        if self.done:
            return self.final
        s, r = self.scfg, self.rcfg
        torch.manual_seed(r.seed + 1000 * self.index)
        ckpt = Checkpointer(self.dir / "checkpoints")
        latest = ckpt.latest()
        src = latest or Path(start_dir)
        dtype = torch.bfloat16 if r.dtype == "bfloat16" else torch.float32
        policy = load_pretrained(src, dtype=dtype, device=r.device)
        tok = load_tokenizer(src)
        from cascade.rollout import ServedEngine, served_engine

        engine = served_engine(r, src, self.dir.parent.parent, self.dir / "logs") or make_engine(r, src, policy, tok)
        pipe = None  # PipelineRL around the trainer once RL starts, when max_staleness > 0
        rl = None
        try:
            curriculum = self.build_curriculum(tok)
            mixer = None
            if s.aggregation.fraction > 0:
                from cascade.aggregation import AggregationMixer

                a = s.aggregation
                mixer = AggregationMixer(tok, a.fraction, a.tails, a.tail_tokens, a.template, a.buffer, r.seed + self.index)
            rl_cfg = copy.deepcopy(s.rl)
            rl_cfg.seed = r.seed + 7919 * (self.index + 1)
            if rl_cfg.optim.schedule != "constant" and not rl_cfg.optim.total_steps:
                rl_cfg.optim.total_steps = s.steps
            rl = RLTrainer(policy, tok, engine, curriculum, rl_cfg,
                           problem_hook=mixer.mix if mixer else None, rollout_hook=mixer.remember if mixer else None)
            sft_cfg = SFTConfig(steps=s.sft.steps, batch_size=s.sft.batch_size, micro_batch_size=s.sft.micro_batch_size,
                                optim=s.sft.optim, max_len=s.sft.max_len, chat_template=rl_cfg.chat_template,
                                system_prompt=rl_cfg.system_prompt, seed=r.seed + self.index)
            sft = SFTTrainer(policy, tok, sft_cfg) if s.sft.steps > 0 else None
            state = {"step": 0, "pool": None, "eval_before": None}
            if latest is not None:
                tstate, state = load_trainer_state(latest)
                if state["pool"] is not None:
                    rl.curriculum = self.pool_of(curriculum, state["pool"])
                rl.load_state_dict(tstate["rl"])
                if sft is not None and tstate.get("sft"):
                    sft.load_state_dict(tstate["sft"])
                if mixer is not None and tstate.get("mixer"):
                    mixer.load_state_dict(tstate["mixer"])
            if isinstance(engine, ServedEngine):  # servers (started or given) serve exactly this policy from the start
                from train.engine.remote import RemoteError

                try:
                    rl.sync_weights()
                except RemoteError as e:
                    raise ConfigError(f"the rollout servers cannot load this run's weights ({e}); servers given by "
                                      f"rollout.urls must run with --weights-dir {engine.exchange}") from None
            held = self.eval_problems(curriculum)
            if state["eval_before"] is None:
                state["eval_before"] = rl.evaluate(held)
                self.records.log(self.name, "eval", 0, {"accuracy_before": state["eval_before"]})
            total = self.total_steps()
            task = self.progress.add_task(self.name, total=total, completed=state["step"], info="") if self.progress else None
            sft_data = None
            while state["step"] < total:
                step = state["step"]
                if rl.learner is None and r.trainer.distributed:  # SFT and RL on the trainer ranks
                    rl.learner = self.start_learner(rl, policy, src, sft)
                if step < s.sft.steps:
                    if sft_data is None:
                        sft_data = self.sft_examples(sft, tok, curriculum)
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

                        pipe = Pipeline(rl)
                    m = pipe.step() if pipe is not None else rl.step()
                    if mixer is not None:
                        m["aggregation_prompts"] = mixer.made
                    if isinstance(engine, ServedEngine):
                        m["prompts_resent"] = engine.remote.resent
                        m["server_restarts"] = engine.pool.restarts if engine.pool is not None else 0
                    self.records.log(self.name, "rl", step, m)
                    info = f"reward {m['reward_mean']:.2f} acc {m['accuracy']:.2f}"
                state["step"] = step + 1
                if self.progress:
                    self.progress.update(task, completed=state["step"], info=info)
                if state["step"] % s.checkpoint_every == 0 and state["step"] < total:
                    if pipe is not None:
                        with pipe.paused():
                            self.save(ckpt, policy, src, rl, sft, mixer, state)
                    else:
                        self.save(ckpt, policy, src, rl, sft, mixer, state)
            if pipe is not None:
                pipe.close()
                pipe = None
            if rl.learner is not None:  # the ranks' last weights, whatever the sync schedule
                from train.model.hf_io import load_into

                load_into(policy, rl.learner.final())
            ckpt.wait()
            after = rl.evaluate(held)
            self.records.log(self.name, "eval", total, {"accuracy_before": state["eval_before"], "accuracy_after": after})
            self.write_final(policy, src, rl, sft, mixer, state, after)
        finally:
            if pipe is not None:
                pipe.close()
            if rl is not None and rl.learner is not None:
                rl.learner.close()
            if hasattr(engine, "close"):
                engine.close()
        return self.final

    # ------------------------------------------------------------------------------------------
    def eval_problems(self, curriculum):
        rng = random.Random(10_000 + self.index)
        ids = sorted(curriculum.envs)
        out = []
        for i in range(self.scfg.eval_problems):
            e = ids[i % len(ids)]
            out.append((e, curriculum.envs[e].generate(10**9 + rng.getrandbits(30), 0)))
        return out

    def sft_examples(self, sft, tok, curriculum):
        from cascade.trim import trim_pairs
        from train.rl.trainer import encode_prompt
        from train.sft import load_pairs, reference_pairs

        s = self.scfg.sft
        if s.data:
            pairs = load_pairs(s.data)
        else:
            env_ids = s.envs or [e for e in curriculum.envs if ":" not in e]
            pairs = reference_pairs(env_ids, s.examples, seed=self.rcfg.seed + self.index, difficulties=s.difficulties,
                                    env_kwargs=self.scfg.env_kwargs)
        cfg = sft.cfg
        pairs, dropped = trim_pairs(tok, pairs, cfg.max_len - 1,
                                    lambda p: len(encode_prompt(tok, p, cfg.chat_template, cfg.system_prompt)))
        if not pairs:
            raise ConfigError(f"stage {self.name}: no SFT example fits sft.max_len={cfg.max_len}")
        self.records.log(self.name, "sft_data", 0, {"examples": len(pairs), "dropped_by_trim": dropped})
        return sft.encode(pairs)

    def filter_pool(self, rl, curriculum) -> list:
        from cascade.pool import filter_by_pass_rate

        p = self.scfg.pool
        picks = curriculum.sample(random.Random(self.rcfg.seed + 31 * self.index), p.size)
        kept, rates = filter_by_pass_rate(rl, picks, p.samples, p.max_pass_rate, p.min_pass_rate)
        if not kept:
            kept = picks  # nothing in range: train on the whole pool rather than stop (logged)
        self.records.log(self.name, "pool", 0, {"pool_size": len(picks), "pool_kept": len(kept),
                                               "pass_rate_mean": sum(rates) / max(len(rates), 1)})
        return [[e, pr.to_dict()] for e, pr in kept]

    @staticmethod
    def pool_of(curriculum, pool: list):
        from cascade.pool import ProblemPool
        from envs.base import Problem

        return ProblemPool(curriculum, [(e, Problem.from_dict(p)) for e, p in pool])

    def _trainer_state(self, rl, sft, mixer) -> dict:
        return {"rl": rl.state_dict(), "sft": sft.state_dict() if sft else None,
                "mixer": mixer.state_dict() if mixer else None}

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
                             sft_steps=s.sft.steps, sft_optim=s.sft.optim)

    def save(self, ckpt: Checkpointer, policy, src: Path, rl, sft, mixer, state: dict) -> None:
        from cascade.checkpoint import _fault

        if rl.learner is not None:  # the ranks checkpoint the same update; this copy of the policy takes its weights
            from train.model.hf_io import load_into

            load_into(policy, rl.learner.checkpoint(self.updates_done(rl, sft)))
        _fault("before_checkpoint", state["step"])
        ckpt.save(state["step"], policy, src, self._trainer_state(rl, sft, mixer), dict(state))

    def write_final(self, policy, src: Path, rl, sft, mixer, state: dict, after: float) -> None:
        import shutil

        from train.model.hf_io import save_pretrained

        tmp = self.dir / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_pretrained(policy, tmp)
        copy_tokenizer(src, tmp)
        run_state = {"stage": self.name, "steps": state["step"], "started_from": str(src), "accuracy_before": state["eval_before"],
                     "accuracy_after": after, "difficulty": rl.curriculum.difficulties(),
                     "finished": time.time()}
        (tmp / "run_state.json").write_text(json.dumps(run_state, indent=2, default=str))
        torch.save(self._trainer_state(rl, sft, mixer), tmp / "trainer_state.pt")
        if self.final.exists():
            shutil.rmtree(self.final)
        tmp.rename(self.final)
        (self.final / COMPLETE).write_text("ok\n")
