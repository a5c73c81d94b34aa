"""The RL loop: curriculum -> engine rollouts -> verify -> curriculum update -> gates -> dynamic sampling
-> advantages -> policy loss -> optimizer step -> weight sync (every ``sync_every`` steps).

Each arrow is a plain call on plain data (see cascade/docs/DESIGN.md). One :class:`RLTrainer` holds the policy,
its optimizer, an engine, a curriculum and the run's RNG; ``step()`` does one RL step and returns
its metrics; ``state_dict()`` holds everything needed to resume (model weights are saved apart,
in Hugging Face format).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from envs.base import Problem, Score, verify_all, verify_workers
from train.batching import even_slices, make_batch
from train.engine.base import Completion, SamplingParams
from train.model.modeling import CausalLM
from train.optim import (OptimConfig, accumulate_grads, build_optimizer, clip_and_step, load_training_state,
                         training_state)
from train.rl.advantages import compute_advantages
from train.rl.losses import (LossConfig, MetricSums, check_ratio_options, effective_agg, get_loss, loss_count,
                             mismatch_metrics)
from train.rl.shaping import (DynamicSampler, LengthRewardConfig, LengthRewardState, OverlongConfig, data_source,
                              overlong_shaping, rare_token_fractions, repetition_gate)
from train.tokenizer import open_think_of

REWARD_MODES = ("correct", "score")


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS (as vLLM's)

    def __post_init__(self):
        self.params(1, None)  # the engine's own checks (temperature >= 0, top_p in (0, 1], ...), before any work

    def params(self, n: int, seed: int | None) -> SamplingParams:
        return SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, max_tokens=self.max_new_tokens, stop=list(self.stop),
                              stop_token_ids=list(self.stop_token_ids), seed=seed)


@dataclass
class RLConfig:
    group_size: int = 8                 # G rollouts per prompt
    prompts_per_step: int = 8           # groups per optimizer step (after dynamic sampling)
    advantage: str = "maxrl"            # grpo | drgrpo | maxrl | rloo
    loss: str = "dppo_tv"               # see train.rl.losses
    loss_cfg: LossConfig = field(default_factory=LossConfig)
    # KL penalty (loss_cfg.kl_coef > 0, off in ZAYA1): the reference policy. None: a frozen copy of
    # the policy as the first RL update finds it (after any SFT warm-up), kept in state_dict() so a
    # resume keeps it; else an HF checkpoint directory. kl_coef = 0 builds no reference at all.
    kl_reference: str | None = None
    reward: str = "correct"             # correct: 1/0 full credit; score: the verifier's reward
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    dynamic_sampling: bool = True
    max_sampling_rounds: int = 4
    length_reward: bool = False         # ZAYA1 eqs. 8-10, see LengthRewardConfig (l_max, T_l, T_acc, the c schedule)
    length_cfg: LengthRewardConfig = field(default_factory=LengthRewardConfig)
    repetition_gate: bool = True        # ZAYA1 eq. 16: LZ77 ratio of the token-id bytes; reward -> min(reward, 0)
    repetition_threshold: float = 0.05
    repetition_chunk_tokens: int = 512  # C, tokens per chunk (not given in the report; Cascade's choice)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    micro_batch_size: int = 32          # at most this many rollouts in one packed micro-batch
    tokens_per_micro: int = 16384       # token budget of a packed micro-batch (sequences back to back)
    # recompute each decoder layer in backward instead of keeping its activations (less memory, one
    # more forward of the layers per micro-batch); also on the trainer ranks with trainer.tsp = 1
    # (TSP ranks always recompute their blocks)
    activation_checkpointing: bool = False
    router_replay: bool = True          # MoE: the trainer routes each token to the experts the engine chose
    updates_per_batch: int = 1          # optimizer steps per rollout batch (mini-batches)
    sync_every: int = 1                 # weight sync to the engine every k optimizer steps
    # Off-policy correction. behaviour: the PPO/GSPO/CISPO ratio and the DPPO weight are taken
    # against the log-probs the engine recorded while sampling (mu), as prime-rl and the DPPO
    # authors do; recompute: against the trainer's own log-probs of the batch before the update
    # (decoupled PPO), with the engine mismatch corrected by truncated IS (loss_cfg.tis_cap).
    ratio_against: str = "behaviour"
    # PipelineRL (train/rl/pipeline.py): 0 is the synchronous loop; k > 0 lets rollouts run up to k
    # policy versions ahead of the trainer (groups older than that are dropped and counted).
    max_staleness: int = 0
    min_ready_batches: int = 2          # the trainer pulls once this many batches are buffered
    buffer_groups: int = 0              # buffer capacity in groups (oldest evicted); 0: (max_staleness + 2) batches
    # PipelineRL on CPU with the engine and the update in this process: intra-op threads of the rollout
    # thread, the update keeping the rest (two thread pools on the same cores slow both); 0: half of
    # torch's threads when there are >= 2, else no split; >= torch's threads: no split.
    rollout_threads: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    system_prompt: str | None = None
    chat_template: bool = True
    max_prompt_tokens: int = 0          # longer prompts are skipped (and count as failed); 0: context - max_new_tokens,
    # but at least half the context (a prompt past context - max_new_tokens gets a response budget cut by the context)
    # threads verifying responses of environments that wait on other processes (sandboxed code, math
    # workers: envs.base.verify_all); 0: one per core, at most 8; 1: one response at a time
    verify_workers: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.reward not in REWARD_MODES:
            raise ValueError(f"unknown reward mode {self.reward!r}; choose from {', '.join(REWARD_MODES)}")
        if self.group_size < 2:  # a group of one: every advantage r - mean is 0, nothing trains
            raise ValueError(f"group_size must be >= 2 (every advantage estimator compares a rollout with the "
                             f"others of its group), got {self.group_size}")
        small = [f"{k}={getattr(self, k)}" for k in ("prompts_per_step", "max_sampling_rounds", "micro_batch_size",
                                                     "tokens_per_micro", "updates_per_batch") if getattr(self, k) < 1]
        if small:
            raise ValueError(f"{small[0].split('=')[0]} must be >= 1, got {', '.join(small)}")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0 (0: the context less max_new_tokens, at least half of it), "
                             f"got {self.max_prompt_tokens}")
        if self.repetition_chunk_tokens < 1 or not 0 < self.repetition_threshold < 1:
            raise ValueError(f"repetition_chunk_tokens must be >= 1 (got {self.repetition_chunk_tokens}) and "
                             f"repetition_threshold in (0, 1) (got {self.repetition_threshold})")
        check_ratio_options(self.ratio_against, self.loss_cfg)
        if self.verify_workers < 0:
            raise ValueError(f"verify_workers must be >= 0 (0: one per core, at most 8), got {self.verify_workers}")
        if self.rollout_threads < 0:
            raise ValueError(f"rollout_threads must be >= 0 (0: split torch's threads in half), got {self.rollout_threads}")
        if self.sync_every < 1 or self.max_staleness < 0 or self.min_ready_batches < 1:
            raise ValueError("sync_every and min_ready_batches must be >= 1 and max_staleness >= 0")
        if self.buffer_groups and self.buffer_groups < self.prompts_per_step:
            raise ValueError(f"buffer_groups={self.buffer_groups} holds less than one batch (prompts_per_step="
                             f"{self.prompts_per_step}); raise it, or 0 for (max_staleness + 2) batches")
        if self.max_staleness and self.max_staleness < self.sync_every - 1:
            raise ValueError(f"max_staleness={self.max_staleness} with sync_every={self.sync_every}: rollouts are "
                             f"up to sync_every - 1 = {self.sync_every - 1} versions old between syncs; raise "
                             "max_staleness or lower sync_every")
        get_loss(self.loss)  # raise early on an unknown name
        from train.rl.advantages import get_advantage

        get_advantage(self.advantage)
        if self.kl_reference and not self.loss_cfg.kl_coef:
            raise ValueError("kl_reference is set but loss_cfg.kl_coef is 0: set kl_coef > 0 or drop kl_reference")
        ov = self.overlong
        if self.advantage == "maxrl" and (ov.mode == "soft" or (ov.mode == "reward" and ov.truncated_reward < 0)):
            raise ValueError(f"advantage maxrl needs rewards >= 0, but overlong mode {ov.mode!r} makes them negative; "
                             "use overlong mode 'mask' (or 'reward' with truncated_reward >= 0), or advantage grpo")
        if ov.mode == "soft" and ov.max_len > self.sampling.max_new_tokens:
            raise ValueError(f"overlong.max_len={ov.max_len} is above sampling.max_new_tokens="
                             f"{self.sampling.max_new_tokens}: no response gets that long, so the full penalty is "
                             "never reached (and none at all when max_len - buffer_len >= max_new_tokens); set "
                             "max_len <= max_new_tokens (DAPO: max_len = the response limit)")
        if self.advantage == "maxrl" and self.reward == "score":
            raise ValueError("advantage maxrl needs rewards >= 0, but reward=score takes the verifier's score, which "
                             "is on [-1, 1] (e.g. -1 for an answer with no \\boxed{}); use reward=correct (0/1), or "
                             "advantage grpo or drgrpo")


@dataclass
class Rollout:
    env_id: str
    problem: Problem
    prompt_ids: list[int]
    completion: Completion
    score: Score
    reward: float = 0.0
    keep: bool = True


@dataclass
class Group:
    env_id: str
    problem: Problem
    rollouts: list[Rollout]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


def encode_prompt(tokenizer, text: str, chat: bool = True, system: str | None = None) -> list[int]:
    if chat:
        from train.tokenizer import chat_prompt_ids

        return chat_prompt_ids(tokenizer, text, system)
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)


class RLTrainer:
    def __init__(self, policy: CausalLM, tokenizer, engine, curriculum, cfg: RLConfig,
                 problem_hook: Callable[[list[tuple[str, Problem]]], list[tuple[str, Problem]]] | None = None,
                 rollout_hook: Callable[[list[Group]], None] | None = None):
        self.policy, self.tokenizer, self.engine, self.curriculum, self.cfg = policy, tokenizer, engine, curriculum, cfg
        self.opt, self.sched = build_optimizer(policy, cfg.optim)
        self.rng = random.Random(cfg.seed)
        self.step_idx = 0
        self.pad_id = int(policy.config.pad_token_id or 0)
        self.problem_hook, self.rollout_hook = problem_hook, rollout_hook
        self.loss_fn = get_loss(cfg.loss)
        ctx = policy.config.max_position_embeddings
        self.max_prompt_tokens = cfg.max_prompt_tokens or max(ctx - cfg.sampling.max_new_tokens, ctx // 2)
        self.prompts_too_long = 0
        self.rollout_times = {"generate": 0.0, "verify": 0.0}  # seconds in rollout(), since collect() began
        # the thinking a chat template opens in the prompt: responses are verified with it in front (train/tokenizer.py)
        self.think_open = open_think_of(tokenizer, cfg.chat_template, cfg.system_prompt)
        self.agg = effective_agg(cfg.loss, cfg.loss_cfg)
        self.synced_version = 0  # the weight version the engine was last given
        self.learner = None  # trainer ranks in other processes (cascade/learner.py); None: update in-process
        # the length reward's run state (p* per data source, the cross-stage c schedule): checkpointed, and
        # handed to the next stage by cascade/stage.py
        self.length_state = LengthRewardState()
        self.length_metrics: dict[str, float] = {}
        # router replay: ask the engine for its expert choices where it can give them
        self.replay = (cfg.router_replay and policy.config.is_moe and _takes(engine.generate, "return_routed_experts")
                       and getattr(engine, "records_routing", True))
        self.ref_policy: CausalLM | None = None  # KL reference, built by reference_policy() when kl_coef > 0
        # called before each forward, backward and optimizer step of an update (the pipeline resizes the
        # update's thread pool there: train.rl.pipeline.Pipeline.lend_threads)
        self.between_kernels: Callable[[], None] = lambda: None

    def env_of(self, env_id: str):
        """The curriculum's environment instance (configured with its kwargs), else one by id."""
        if env_id not in self.curriculum.envs:
            from envs.base import get_env

            self.curriculum.envs[env_id] = get_env(env_id)
        return self.curriculum.envs[env_id]

    # -- rollouts -----------------------------------------------------------------------------
    def reward_of(self, score: Score, token_ids) -> float:
        """The rollout's reward: full credit 1/0 or the verifier's score, through the LZ77 repetition gate
        on its completion token ids (a positive reward becomes 0; a negative one stays)."""
        r = (1.0 if score.correct else 0.0) if self.cfg.reward == "correct" else float(score.reward)
        if self.cfg.repetition_gate:
            r = repetition_gate(r, token_ids, self.cfg.repetition_threshold, self.cfg.repetition_chunk_tokens)
        return r

    def rollout(self, n_prompts: int) -> list[Group]:
        """Sample ``n_prompts`` problems, generate G completions each, verify and score them."""
        picks = self.curriculum.sample(self.rng, n_prompts)
        if self.problem_hook is not None:
            picks = self.problem_hook(picks)
        groups = self.generate_groups(picks)
        if self.rollout_hook is not None:
            self.rollout_hook(groups)
        return groups

    def generate_groups(self, picks: list[tuple[str, Problem]], group_size: int | None = None,
                        update_curriculum: bool = True) -> list[Group]:
        """G completions for each given problem, verified and scored (rewards after the gates)."""
        cfg = self.cfg
        G = group_size or cfg.group_size
        prompts = [encode_prompt(self.tokenizer, p.prompt, cfg.chat_template, cfg.system_prompt) for _, p in picks]
        fits = [len(x) <= self.max_prompt_tokens for x in prompts]

        def moves_level(env_id: str, prob: Problem) -> bool:  # an aggregation prompt never moves a level
            return update_curriculum and env_id in self.curriculum.controllers and not prob.meta.get("aggregation")

        for ok, (env_id, prob) in zip(fits, picks):  # too long for the context: a failed problem
            if not ok and moves_level(env_id, prob):
                self.curriculum.update(env_id, prob.difficulty, [Score.zero("prompt too long")] * G)
        self.prompts_too_long += len(fits) - sum(fits)
        picks = [pk for pk, ok in zip(picks, fits) if ok]
        prompts = [x for x, ok in zip(prompts, fits) if ok]
        if not picks:
            return []
        v0 = engine_version(self.engine, self.synced_version)
        kw = {"return_routed_experts": True} if self.replay else {}
        t0 = time.perf_counter()
        comps = self.engine.generate(prompts, cfg.sampling.params(G, self.rng.getrandbits(62)), **kw)
        t1 = time.perf_counter()
        for c in comps:  # engines that do not track versions per token sampled all of it with v0
            if c.versions is None:
                c.versions = [v0] * len(c.token_ids)
        scores = self.verify([(env_id, prob, c.text) for i, (env_id, prob) in enumerate(picks)
                              for c in comps[i * G:(i + 1) * G]])
        self.rollout_times["generate"] += t1 - t0
        self.rollout_times["verify"] += time.perf_counter() - t1
        groups = []
        for i, (env_id, prob) in enumerate(picks):
            rs = [Rollout(env_id, prob, prompts[i], c, score, self.reward_of(score, c.token_ids))
                  for c, score in zip(comps[i * G:(i + 1) * G], scores[i * G:(i + 1) * G])]
            ov = cfg.overlong
            if ov.mode != "none":
                r, keep = overlong_shaping([x.reward for x in rs], [len(x.completion.token_ids) for x in rs],
                                           [x.completion.finish_reason == "length" for x in rs], ov)
                for x, rv, k in zip(rs, r.tolist(), keep.tolist()):
                    x.reward, x.keep = rv, k
            groups.append(Group(env_id, prob, rs))
            if moves_level(env_id, prob):
                self.curriculum.update(env_id, prob.difficulty, [x.score for x in rs])
        return groups

    # -- update -------------------------------------------------------------------------------
    def _advantages(self, groups: list[Group]) -> torch.Tensor:
        cfg = self.cfg
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        gid = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts])
        bonus = None
        if cfg.length_reward:  # one step of the length reward's run state per call (once per update)
            lengths = [len(r.completion.token_ids) for g in groups for r in g.rollouts]
            sources = [data_source(g.env_id, g.problem.meta) for g in groups for _ in g.rollouts]
            bonus, self.length_metrics = self.length_state.bonus(
                cfg.length_cfg, rewards, lengths, gid, sources, cfg.length_cfg.l_max or cfg.sampling.max_new_tokens)
        return compute_advantages(cfg.advantage, rewards, gid, bonus=bonus)

    def update(self, groups: list[Group]) -> dict[str, float]:
        """Policy-gradient update(s) on the given groups; returns loss metrics.

        The ratio is taken against the behaviour log-probs the engine recorded (``ratio_against:
        behaviour``) or the trainer's own log-probs before the update (``recompute``), see
        :class:`RLConfig`. ``mismatch_kl`` / ``mismatch_max_abs`` compare the behaviour log-probs with
        the trainer's at the start of the update (stale weights and engine numerics both show there).
        With ``loss_cfg.kl_coef > 0`` the reference policy's log-probs (:meth:`reference_policy`) are
        computed once per batch, without grad, and the loss adds ``kl_coef * KL`` per token. The
        ``seq_*`` aggregations divide by the rollouts that have a loss token (``keep=False`` and empty
        rollouts do not count).
        """
        cfg = self.cfg
        rolls = [r for g in groups for r in g.rollouts]
        adv = self._advantages(groups)
        keep = torch.tensor([r.keep for r in rolls])
        batch = make_batch([r.prompt_ids for r in rolls], [r.completion.token_ids for r in rolls], self.pad_id)
        batch = batch.to(self.policy.device)
        rollout_lp = batch.scatter_completion([r.completion.logprobs for r in rolls])
        mask = batch.loss_mask * keep.to(batch.loss_mask)[:, None]
        adv = adv.to(self.policy.device)
        n = len(rolls)
        temp = cfg.sampling.temperature or 1.0
        behaviour = cfg.ratio_against == "behaviour"
        old_lp = None if behaviour else self._logprobs_no_grad(rolls, batch, temp)
        # KL reference log-probs: once per batch, without grad (None and no reference model when kl_coef = 0)
        ref_lp = self._logprobs_no_grad(rolls, batch, temp, self.reference_policy()) if cfg.loss_cfg.kl_coef else None
        self.policy.train()
        minis = even_slices(n, cfg.updates_per_batch)  # one optimizer step each
        # token-weighted sums of the loss function's metrics and the totals, read once after the loop
        acc = MetricSums()
        # the trainer's policy vs the behaviour policy before any update, over the whole batch: from the first
        # mini-batch's own forward when it is the batch, else from a forward of the batch before the first update
        # (the mini-batches after the first were left out of it)
        pre_lp = self._logprobs_no_grad(rolls, batch, temp) if behaviour and len(minis) > 1 else None
        if pre_lp is not None:
            W = pre_lp.shape[1]
            mm = mismatch_metrics(pre_lp, rollout_lp[:, :W], mask[:, :W])
            acc.add("mismatch_kl_sum", mm["mismatch_kl"] * mask[:, :W].sum())
            acc.add("mismatch_tokens", mask[:, :W].sum())
            acc.max("mismatch_max_abs", mm["mismatch_max_abs"])
        grad_norms = []  # one per optimizer step (mini-batch): the metric is their mean, as verl reports it
        for mi, mini in enumerate(minis):
            # mask[mini]'s count, from the rollouts: no device read
            denom = loss_count([len(r.completion.token_ids) for r in rolls[mini] if r.keep], self.agg)
            # rollouts without a loss token (dropped, empty) are not forwarded: nothing to learn from them, and
            # a zaya router must not count their tokens (RLUpdater skips them too)
            live = [i for i in range(mini.start, mini.stop) if trained(rolls[i])]
            for rows in self._packs(rolls, live):
                self.between_kernels()
                lp, ent = self._packed_logprobs(rolls, rows, batch, temp)
                W = lp.shape[1]
                idx = torch.tensor(rows, device=mask.device)
                m, mu = mask[idx, :W], rollout_lp[idx, :W]
                ref = None if ref_lp is None else ref_lp[idx, :W]
                if behaviour:
                    loss, mets = self.loss_fn(lp, mu, None, adv[idx], m, cfg.loss_cfg, ref_logprobs=ref, denom=denom)
                    if pre_lp is None:  # (one mini-batch: the whole batch, before its update)
                        mm = mismatch_metrics(lp, mu, m)
                        acc.add("mismatch_kl_sum", mm["mismatch_kl"] * m.sum())
                        acc.add("mismatch_tokens", m.sum())
                        acc.max("mismatch_max_abs", mm["mismatch_max_abs"])
                else:
                    loss, mets = self.loss_fn(lp, old_lp[idx, :W], mu, adv[idx], m, cfg.loss_cfg, ref_logprobs=ref,
                                              denom=denom)
                self.between_kernels()
                loss.backward()
                accumulate_grads(self.opt)
                acc.add("loss_total", loss)  # micro-batch losses add up to the mini-batch loss
                mets.pop("loss", None)
                if "mismatch_max_abs" in mets:
                    acc.max("mismatch_max_abs", mets.pop("mismatch_max_abs"))
                w = m.sum()
                acc.add_weighted(mets, w)
                acc.add("loss_tokens", w)
                acc.add("entropy_sum", (ent * m).sum())
            self.between_kernels()
            gn = clip_and_step(self.policy, self.opt, None, cfg.optim.grad_clip)
            if live:  # a mini-batch with nothing to learn from has no gradient (and makes no update)
                grad_norms.append(gn)
        # the LR schedule counts RL steps (as verl's and the sharded trainer's): every mini-batch of a batch takes
        # the step's rate, and cosine/linear decay over a stage's steps ends at its last step whatever
        # updates_per_batch is
        lr = self.sched.get_last_lr()[0]  # the rate this step applied
        self.sched.step()
        self.policy.eval()
        sums, maxes = acc.floats()
        weight, loss_total, ent_sum = (sums.pop(k, 0.0) for k in ("loss_tokens", "loss_total", "entropy_sum"))
        mis_sum, mis_w = sums.pop("mismatch_kl_sum", 0.0), sums.pop("mismatch_tokens", 0.0)
        metrics = {k: v / max(weight, 1.0) for k, v in sums.items()}
        if behaviour:
            metrics["mismatch_kl"] = mis_sum / max(mis_w, 1.0)
        metrics.update(maxes)
        # (both means over the mini-batches that had something to learn from: one without is no update)
        metrics.update(loss=loss_total / max(len(grad_norms), 1), entropy=ent_sum / max(weight, 1.0),
                       grad_norm=sum(grad_norms) / max(len(grad_norms), 1),
                       lr=lr, advantage_abs_mean=advantage_abs_mean(rolls, adv))
        return metrics

    def _packs(self, rolls: list[Rollout], rows) -> list[list[int]]:
        """Rows grouped into packed micro-batches: at most ``tokens_per_micro`` tokens and
        ``micro_batch_size`` rollouts each."""
        from train.rl.packing import pack_micro_batches

        rows = list(rows)
        lengths = [len(rolls[i].prompt_ids) + len(rolls[i].completion.token_ids) for i in rows]
        return [[rows[j] for j in mb]
                for mb in pack_micro_batches(lengths, self.cfg.tokens_per_micro, self.cfg.micro_batch_size)]

    def _packed_logprobs(self, rolls: list[Rollout], rows: list[int], batch, temp: float, model=None):
        """Log-probs (with grad) and entropies of the completions of ``rows`` from one packed forward,
        laid out [len(rows), W] like ``batch.loss_mask`` with W = the longest of those rows - 1
        (router replay when the engine recorded the experts)."""
        from train.rl.exchange import stack_routing
        from train.rl.packing import Pair, packed_token_logprobs, scatter_rows

        seqs = [Pair(rolls[i].prompt_ids, rolls[i].completion.token_ids) for i in rows]
        routed = [rolls[i].completion.routed_experts for i in rows]
        routed = [stack_routing(r) for r in routed] if all(r is not None for r in routed) else None
        lps, ents = packed_token_logprobs(self.policy if model is None else model, seqs, temp, routed_experts=routed,
                                          checkpoint_layers=self.cfg.activation_checkpointing)
        starts = [batch.prompt_lens[i] - 1 for i in rows]
        width = max(batch.prompt_lens[i] + batch.completion_lens[i] for i in rows) - 1
        return scatter_rows(lps, starts, width), scatter_rows(ents, starts, width)

    @torch.no_grad()
    def _logprobs_no_grad(self, rolls: list[Rollout], batch, temp: float, model=None) -> torch.Tensor:
        out = torch.zeros(batch.loss_mask.shape, device=batch.loss_mask.device)
        for rows in self._packs(rolls, range(len(rolls))):
            self.between_kernels()
            lp = self._packed_logprobs(rolls, rows, batch, temp, model)[0]
            out[torch.tensor(rows, device=out.device), :lp.shape[1]] = lp
        return out

    def after_external_update(self) -> None:
        """The policy's weights were changed outside this trainer (an SFT phase, weights loaded from
        trainer ranks): low-precision policies' fp32 master copies take them up, so the next update
        starts from them rather than from the masters' stale values."""
        if hasattr(self.opt, "resync"):
            self.opt.resync()

    def sync_weights(self) -> float:
        """Send the policy's weights to the engine as version ``self.step_idx``; returns seconds taken.
        With trainer ranks elsewhere (``self.learner``) the version is the one they published: it is
        loaded into this process's policy too, and servers read it from the exchange directory."""
        t = time.perf_counter()
        if self.learner is None:
            load_weights(self.engine, self.policy.state_dict(), self.step_idx)
        else:
            from train.model.hf_io import load_into

            sd = self.learner.weights(self.step_idx)
            load_into(self.policy, sd)
            if hasattr(self.engine, "load_published"):  # the servers read it, or take it by broadcast
                self.engine.load_published(self.step_idx, sd)
            else:
                load_weights(self.engine, sd, self.step_idx)
        self.synced_version = self.step_idx
        return time.perf_counter() - t

    def sync_final(self) -> None:
        """After the last update: the engine takes the policy's version ``step_idx`` if its last sync is behind
        (``sync_every`` > 1 leaves up to ``sync_every - 1`` updates unsent), so what runs on the engine next (the
        held-out score after a stage) is the policy that is saved. With trainer ranks the caller has loaded their
        final weights into the policy; a version they published already is taken as published."""
        if self.synced_version == self.step_idx:
            return
        if self.learner is not None:
            from train.rl.exchange import COMPLETE, version_dir

            if (version_dir(self.learner.exchange, self.step_idx) / COMPLETE).exists():
                self.sync_weights()
                return
        load_weights(self.engine, self.policy.state_dict(), self.step_idx)
        self.synced_version = self.step_idx

    def collect(self) -> tuple[list[Group], dict[str, Any]]:
        """Rollouts for one step (with dynamic sampling): the groups to train on and the rollout
        metrics over everything sampled. Uses the run's RNG and curriculum, nothing of the trainer."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self.rollout_times = {"generate": 0.0, "verify": 0.0}
        sampled: list[Group] = []

        def sample(k: int) -> list[Group]:
            gs = self.rollout(k)
            sampled.extend(gs)
            return gs

        if cfg.dynamic_sampling:
            # a group none of whose rollouts is trained (overlong.mode=mask: every one truncated) carries no signal
            # either, whatever its rewards (a truncated answer may have boxed the right one before the cut)
            report = DynamicSampler(sample, cfg.prompts_per_step, cfg.max_sampling_rounds,
                                    rewards_of=lambda g: g.rewards if any(r.keep for r in g.rollouts) else []).fill()
            groups, dropped = report.groups, report.dropped
        else:
            groups, dropped = sample(cfg.prompts_per_step), 0
        t_roll = time.perf_counter() - t0
        rolls = [r for g in sampled for r in g.rollouts]
        gen_tokens = sum(len(r.completion.token_ids) for r in rolls)
        return groups, {
            "reward_mean": _mean([r.reward for r in rolls]),
            "accuracy": _mean([float(r.score.correct) for r in rolls]),
            "format_ok": _mean([float(r.score.format_ok) for r in rolls]),
            "response_len": _mean([len(r.completion.token_ids) for r in rolls]),
            "truncated_frac": _mean([float(r.completion.finish_reason == "length") for r in rolls]),
            **rare_token_fractions([r.completion.token_ids for r in rolls], self.policy.config.vocab_size),
            "groups_sampled": len(sampled), "groups_dropped": dropped, "groups_trained": len(groups),
            "prompts_too_long": self.prompts_too_long,
            "rollout_tokens_per_s": gen_tokens / max(t_roll, 1e-9), "time_rollout_s": t_roll,
            # of which generation and verification (the rest: sampling problems, gates, shaping)
            "time_generate_s": self.rollout_times["generate"], "time_verify_s": self.rollout_times["verify"],
        }

    def train_on(self, groups: list[Group]) -> dict[str, Any]:
        """The update on ``groups`` and, every ``sync_every`` steps, the weight sync."""
        m: dict[str, Any] = {}
        t1 = time.perf_counter()
        if groups:
            m.update(version_lag(groups, self.step_idx))
            if self.learner is not None:
                adv = self._advantages(groups)
                m.update(self.learner.update(groups, adv, self.step_idx, self.cfg.sampling.temperature or 1.0))
                m["advantage_abs_mean"] = advantage_abs_mean([r for g in groups for r in g.rollouts], adv)
            else:
                m.update(self.update(groups))
            m.update(self.length_metrics)
            trained_tokens = sum(len(r.prompt_ids) + len(r.completion.token_ids) for g in groups for r in g.rollouts)
            m["train_tokens_per_s"] = trained_tokens / max(time.perf_counter() - t1, 1e-9)
            self.step_idx += 1
        elif self.cfg.length_reward:
            # a step that trains nothing (every group equal or stale) moves neither the optimizer nor the learning
            # rate's schedule, but the length reward's c follows the run's RL steps (its ramp_steps count them)
            self.length_state.steps += 1
        m["time_train_s"] = time.perf_counter() - t1
        if groups and self.step_idx % self.cfg.sync_every == 0:
            m["time_sync_s"] = self.sync_weights()
        return m

    def step(self) -> dict[str, Any]:
        """One synchronous RL step (rollouts, then the update); returns its metrics."""
        t0 = time.perf_counter()
        m: dict[str, Any] = {"step": self.step_idx}
        groups, rm = self.collect()
        m.update(rm)
        m.update(self.train_on(groups))
        m["difficulty"] = self.curriculum.difficulties()
        m["time_step_s"] = time.perf_counter() - t0
        return m

    # -- evaluation and state ------------------------------------------------------------------
    def evaluate(self, problems: list[tuple[str, Problem]], n: int = 1, greedy: bool = True, seed: int = 0) -> float:
        """Mean full-credit rate of the engine's answers on fixed problems."""
        cfg = self.cfg
        problems = [pk for pk in problems if len(encode_prompt(self.tokenizer, pk[1].prompt, cfg.chat_template,
                                                                 cfg.system_prompt)) <= self.max_prompt_tokens]
        if not problems:
            return 0.0
        prompts = [encode_prompt(self.tokenizer, p.prompt, cfg.chat_template, cfg.system_prompt) for _, p in problems]
        sp = cfg.sampling.params(n, seed)
        if greedy:
            sp.temperature = 0.0
        comps = self.engine.generate(prompts, sp)
        scores = self.verify([(*problems[c.prompt_index], c.text) for c in comps])
        return _mean([float(x.correct) for x in scores])

    def verify(self, items: list[tuple[str, Problem, str]]) -> list[Score]:
        """Scores of ``(env id, problem, response)`` items, in order; environments that wait on other
        processes verify ``cfg.verify_workers`` at a time (:func:`envs.base.verify_all`); a response to a prompt that
        opens the thinking is verified with that opening in front (``think_open``)."""
        return verify_all([(self.env_of(e), p, self.think_open + r) for e, p, r in items],
                          verify_workers(self.cfg.verify_workers))

    def reference_policy(self) -> CausalLM:
        """The frozen KL reference (``cfg.kl_reference``), built on first use: the checkpoint at that
        path, else a copy of the policy as it is now (the first update: the RL start of the stage).
        Its log-probs use the same temperature, packing and router replay as the policy's."""
        if self.ref_policy is None:
            if self.cfg.kl_reference:
                from envs.hub import resolve_model
                from train.model.hf_io import load_pretrained

                ref = load_pretrained(resolve_model(self.cfg.kl_reference, "KL reference"),
                                      dtype=next(self.policy.parameters()).dtype, device=self.policy.device)
            else:
                import copy

                ref = copy.deepcopy(self.policy)
            self.ref_policy = ref.eval().requires_grad_(False)
        return self.ref_policy

    def state_dict(self) -> dict:
        st = {**training_state(self.step_idx, self.opt, self.sched, self.rng),
              "curriculum": self.curriculum.state_dict(), "torch_rng": torch.get_rng_state(),
              "length_reward": self.length_state.state_dict(), "prompts_too_long": self.prompts_too_long}
        if self.ref_policy is not None and not self.cfg.kl_reference:  # a frozen copy: only this state holds it
            st["kl_reference"] = {k: v.detach().to("cpu", copy=True) for k, v in self.ref_policy.state_dict().items()}
        return st

    def load_state_dict(self, st: dict) -> None:
        self.step_idx = load_training_state(st, self.opt, self.sched, self.rng)
        self.synced_version = self.step_idx  # the engine starts from the checkpoint's weights
        self.curriculum.load_state_dict(st["curriculum"])
        torch.set_rng_state(st["torch_rng"])
        if "length_reward" in st:  # absent in checkpoints written before the length reward had run state
            self.length_state.load_state_dict(st["length_reward"])
        self.prompts_too_long = int(st.get("prompts_too_long", 0))  # a running count: it goes on after a resume
        if st.get("kl_reference") is not None:  # the frozen copy the run started its KL penalty from
            import copy

            ref = copy.deepcopy(self.policy)
            ref.load_state_dict(st["kl_reference"])
            self.ref_policy = ref.eval().requires_grad_(False)


def _takes(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def engine_version(engine, default: int) -> int:
    """The weight version an engine serves (engines that do not track one: ``default``)."""
    v = getattr(engine, "version", None)
    return int(v) if isinstance(v, int) else default


def load_weights(engine, state_dict, version: int) -> None:
    """Give the engine new weights tagged ``version`` (engines that take no version just load)."""
    if _takes(engine.load_weights, "version"):
        engine.load_weights(state_dict, version=version)
    else:
        engine.load_weights(state_dict)


def group_version(g: Group) -> int | None:
    """The oldest policy version that sampled any token of the group; None when no token has one (all
    completions empty): no token of it is trained, so it is never too stale (tagged version 0, such a
    group was dropped as stale once the trainer passed ``max_staleness``)."""
    vs = [min(r.completion.versions) for r in g.rollouts if r.completion.versions]
    return min(vs) if vs else None


def trained(r: Rollout) -> bool:
    """Whether a rollout has a loss token: kept (not overlong-filtered) and not empty."""
    return bool(r.keep and r.completion.token_ids)


def advantage_abs_mean(rolls: list[Rollout], adv: torch.Tensor) -> float:
    """Mean |advantage| over the rollouts that are trained on (``adv`` is per rollout, in order)."""
    a = [abs(float(x)) for r, x in zip(rolls, adv.tolist()) if trained(r)]
    return sum(a) / len(a) if a else 0.0


def version_lag(groups: list[Group], version: int) -> dict[str, Any]:
    """How many versions behind ``version`` the trained tokens were sampled (rollouts with a loss
    token): mean and max over tokens, and the histogram (share of tokens at lag 0, 1, 2, ...)."""
    lags = [version - v for g in groups for r in g.rollouts if trained(r) for v in (r.completion.versions or [])]
    if not lags:
        return {"version_lag_mean": 0.0, "version_lag_max": 0, "version_lag_hist": [1.0]}
    hist = [0] * (max(max(lags), 0) + 1)  # tokens of a version above the trainer's (lag < 0) count at lag 0
    for x in lags:
        hist[max(x, 0)] += 1
    return {"version_lag_mean": sum(lags) / len(lags), "version_lag_max": max(lags),
            "version_lag_hist": [h / len(lags) for h in hist]}


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0
