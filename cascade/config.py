"""The run configuration: ``configs/cascade.yaml``, a profile (``configs/profiles/NAME.yaml``) and
``key.sub=value`` overrides from the command line, merged in that order and checked against typed
dataclasses before any work starts."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from train.dataclass_config import ConfigError, build
from train.optim import OptimConfig
from train.presets import configs_dir
from train.rl.trainer import RLConfig
from train.rl.weight_group import TRANSPORTS

STAGE_NAMES = ("warmup", "rlve", "math", "behavior")


@dataclass
class SFTStage:
    """Supervised warm-up at the start of a stage (reference traces of its environments or a file)."""

    steps: int = 0
    examples: int = 1024
    batch_size: int = 32
    micro_batch_size: int = 32       # examples packed back to back into micro-batches of at most this many
    tokens_per_micro: int = 16384    # ... and at most this many tokens
    max_len: int = 8192
    envs: list[str] | dict[str, float] = field(default_factory=list)  # default: the stage's environments;
    #                          a mapping {env: weight} draws the examples in those proportions
    difficulties: list[int] = field(default_factory=lambda: [0, 1, 2])
    data: str | None = None  # instead of reference traces: a jsonl/parquet/csv file or HF dataset org/name with
    #                          prompt/response or chat-format messages columns (train/sft.py load_pairs)
    columns: dict[str, str] = field(default_factory=dict)  # data's column names: {prompt: q, response: a} / {messages: m}
    split: str = "train"     # split of a dataset directory or HF dataset
    subset: str | None = None  # configuration (subset) of an HF dataset
    aggregation: AggregationSFT = field(default_factory=lambda: AggregationSFT())
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_steps=10))


@dataclass
class PoolFilter:
    """Keep only prompts whose pass rate under the incoming policy is at most ``max_pass_rate``."""

    size: int = 0          # 0: off
    samples: int = 4       # rollouts per prompt to estimate its pass rate
    max_pass_rate: float = 0.75
    min_pass_rate: float = 0.0

    def __post_init__(self):
        if self.size < 0 or self.samples < 1 or not 0 <= self.min_pass_rate <= self.max_pass_rate <= 1:
            raise ValueError(f"pool needs size >= 0, samples >= 1 and 0 <= min_pass_rate <= max_pass_rate <= 1, got "
                             f"{self.size}, {self.samples}, {self.min_pass_rate} and {self.max_pass_rate}")


@dataclass
class Aggregation:
    """TTC aggregation prompts mixed into the stream, built from tails of the policy's own earlier
    rollouts of the same problem (Markovian RSA round-1 prompts)."""

    fraction: float = 0.0  # share of prompts turned into aggregation prompts once tails exist
    tails: int = 4         # C
    tail_tokens: int = 4096  # tau
    # auto: each environment's own (a program in a code block for code/solve and code/arc, \boxed{} for the
    # others); or a ttc template (math, code, generic, a YAML/JSON file) for every environment
    template: str = "auto"
    buffer: int = 256      # problems whose rollouts are remembered
    # ZAYA1: aggregation prompts up to 20,480 tokens; a longer one has its tails cut from the front (each
    # keeps its end, where the answer is); one that cannot fit even so is not made (the plain problem stays)
    max_prompt_tokens: int = 20480
    # expert aggregation: this share of aggregation prompts take their tails from rollouts of the checkpoint
    # at expert (an HF directory, Hub id, or the name of an earlier stage of this run: its final/), sampled
    # at the stage's start on expert_problems problems x expert_samples; the rest are self-aggregation.
    # The report gives no split: 0.5 is ours (used only when expert is set)
    expert: str | None = None
    expert_fraction: float = 0.5
    expert_problems: int = 64
    expert_samples: int = 8
    # PaCoRe continuation prompts: this share of aggregation prompts carry compacted messages of earlier
    # rollouts (a finished rollout's post-</think> answer, else its last tail_tokens) to continue from.
    # The report gives no share: 0.25 is ours
    pacore_fraction: float = 0.25

    def __post_init__(self):
        shares = {"fraction": self.fraction, "expert_fraction": self.expert_fraction,
                  "pacore_fraction": self.pacore_fraction}
        bad = {k: v for k, v in shares.items() if not 0 <= v <= 1}
        if bad or self.tails < 1 or self.tail_tokens < 1 or self.buffer < 1:
            raise ValueError(f"aggregation shares must be in [0, 1] (got {bad or shares}) and tails, tail_tokens and "
                             f"buffer >= 1 (got {self.tails}, {self.tail_tokens} and {self.buffer})")
        _check_template(self.template)


@dataclass
class AggregationSFT:
    """SFT examples for aggregation (ZAYA1 §VI): rollouts of a teacher (an HF directory, Hub id, or an
    earlier stage's name) reshuffled into aggregation prompts of ``tails`` tails each, answered by the
    teacher itself; an answer its verifier accepts becomes an SFT example (C tails -> the teacher's
    aggregated answer). ``fraction`` of the stage's SFT examples (the report gives no share: ours)."""

    teacher: str | None = None  # None: off
    fraction: float = 0.1
    problems: int = 256    # problems the teacher solves first
    samples: int = 8       # teacher rollouts per problem (tails to reshuffle)
    shuffles: int = 2      # aggregation prompts built per problem from different draws of its tails
    tails: int = 4         # C
    tail_tokens: int = 4096  # tau
    max_new_tokens: int = 0  # teacher's budget per response; 0: the stage's rl.sampling.max_new_tokens
    template: str = "auto"  # as aggregation.template

    def __post_init__(self):
        if not (1 <= self.tails <= self.samples and min(self.problems, self.shuffles, self.tail_tokens) >= 1
                and 0 <= self.fraction <= 1 and self.max_new_tokens >= 0):
            raise ValueError(f"sft.aggregation needs 1 <= tails <= samples (a prompt's tails come from one problem's "
                             f"samples), problems, shuffles and tail_tokens >= 1, fraction in [0, 1] and "
                             f"max_new_tokens >= 0; got tails={self.tails}, samples={self.samples}, "
                             f"problems={self.problems}, shuffles={self.shuffles}, tail_tokens={self.tail_tokens}, "
                             f"fraction={self.fraction}, max_new_tokens={self.max_new_tokens}")
        _check_template(self.template)


def _check_template(template: str) -> None:
    """An aggregation template other than ``auto`` loads now, not when its stage starts (after the stages
    before it have run)."""
    if template != "auto":
        from ttc.templates import load_template

        try:
            load_template(template)
        except ValueError as e:
            raise ValueError(f"template: {e}") from None


@dataclass
class Source:
    """A named data source of a stage's mix: its share and the environments (ids or globs) it draws
    from, weighted equally within the source."""

    weight: float = 0.0
    envs: list[str] = field(default_factory=list)


@dataclass
class Phase:
    """One phase of a stage: ``steps`` RL steps on this environment mix (and ``aggregation``, the share
    of aggregation prompts; None keeps the stage's). Phases run in order; their steps sum to the stage's."""

    steps: int = 0
    envs: dict[str, float] = field(default_factory=dict)
    sources: dict[str, Source] = field(default_factory=dict)
    aggregation: float | None = None


@dataclass
class RewardModel:
    """Behavioral RL: a Hugging Face sequence-classification model scores responses; the score is
    zeroed when the instruction checker fails."""

    path: str | None = None  # a local directory or an HF Hub id org/name[@revision] (HF cache, offline rules)
    scale: float = 1.0
    max_len: int = 2048


@dataclass
class StageConfig:
    steps: int = 10
    envs: dict[str, float] = field(default_factory=dict)
    env_kwargs: dict[str, dict] = field(default_factory=dict)
    controller: str = "rlve"          # rlve | zaya | fixed
    controller_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling_mode: str = "uniform"    # uniform | least_sampled | weighted_least_sampled
    rl: RLConfig = field(default_factory=RLConfig)
    sft: SFTStage = field(default_factory=SFTStage)
    pool: PoolFilter = field(default_factory=PoolFilter)
    aggregation: Aggregation = field(default_factory=Aggregation)
    reward_model: RewardModel = field(default_factory=RewardModel)
    checkpoint_every: int = 10
    eval_problems: int = 32           # held-out problems scored before and after the stage
    eval_k: int = 0                   # avg@k: k sampled answers per held-out problem (0: one greedy answer)
    eval_difficulty: int | None = None  # the held-out problems' level; None: each environment's start level
    # the mix as named sources (ZAYA1 warm-up: puzzles / competition math / logic puzzles); instead of envs
    sources: dict[str, Source] = field(default_factory=dict)
    # stage 3's phases: [{steps, envs or sources, aggregation}], switching mixes at each phase's first step
    phases: list[Phase] = field(default_factory=list)
    # the response cap by RL step fraction: [[from_fraction, max_new_tokens], ...] (ZAYA1 warm-up: 65K for
    # the first half); before the first entry, and with none, rl.sampling.max_new_tokens
    max_new_tokens_schedule: list[list[float]] = field(default_factory=list)

    def __post_init__(self):
        for where, envs, sources in [("", self.envs, self.sources)] + [
                (f"phases[{i}].", p.envs, p.sources) for i, p in enumerate(self.phases)]:
            if envs and sources:
                raise ValueError(f"{where}envs and {where}sources are both set; give the mix one way")
        for name, src in [(k, v) for k, v in self.sources.items()] + [
                (k, v) for p in self.phases for k, v in p.sources.items()]:
            if src.weight < 0 or not src.envs:
                raise ValueError(f"source {name!r} needs a weight >= 0 and at least one environment in envs")
        for i, p in enumerate(self.phases):
            if p.steps < 1 or not (p.envs or p.sources):
                raise ValueError(f"phases[{i}] needs steps >= 1 and an envs (or sources) mix")
            if p.aggregation is not None and not 0 <= p.aggregation <= 1:
                raise ValueError(f"phases[{i}].aggregation must be in [0, 1], got {p.aggregation}")
        last = -1.0
        for e in self.max_new_tokens_schedule:
            if len(e) != 2 or not 0 <= e[0] <= 1 or e[0] <= last or int(e[1]) < 1:
                raise ValueError(f"max_new_tokens_schedule: expected [[from_fraction, tokens], ...] with fractions "
                                 f"rising in [0, 1] and tokens >= 1, got {self.max_new_tokens_schedule}")
            last = e[0]
        for name, v, low in (("steps", self.steps, 0), ("sft.steps", self.sft.steps, 0),
                             ("checkpoint_every", self.checkpoint_every, 1), ("eval_problems", self.eval_problems, 0)):
            if v < low:
                raise ValueError(f"{name} must be >= {low}, got {v}")
        from envs.curriculum import CONTROLLERS, SAMPLING_MODES

        if self.controller not in CONTROLLERS:
            raise ValueError(f"unknown difficulty controller {self.controller!r}; choose from {', '.join(CONTROLLERS)}")
        if self.sampling_mode not in SAMPLING_MODES:
            raise ValueError(f"unknown sampling_mode {self.sampling_mode!r}; choose from {', '.join(SAMPLING_MODES)}")
        if self.eval_k < 0:
            raise ValueError(f"eval_k must be >= 0, got {self.eval_k}")
        if self.sft.steps > 0 and min(self.sft.batch_size, self.sft.micro_batch_size, self.sft.tokens_per_micro,
                                      self.sft.examples) < 1:
            raise ValueError("sft.batch_size, sft.micro_batch_size, sft.tokens_per_micro and sft.examples must be "
                             ">= 1")
        if self.sft.steps > 0 and self.sft.max_len < 2:  # (a prompt token and a response token at the least)
            raise ValueError(f"sft.max_len must be >= 2, got {self.sft.max_len}")
        if self.sft.steps > 0 and not self.sft.data and not self.sft.difficulties:  # (reference traces draw a level)
            raise ValueError("sft.difficulties is empty: SFT on reference traces draws each example's level from it "
                             "(give at least one, or sft.data)")
        if self.sft.steps > 0 and any(d < 0 for d in self.sft.difficulties):
            raise ValueError(f"sft.difficulties must be >= 0, got {list(self.sft.difficulties)}")
        a = self.aggregation
        if a.fraction > 0 or any(p.aggregation for p in self.phases):  # a prompt's tails are one group's rollouts
            if a.tails > self.rl.group_size and not a.expert:
                raise ValueError(f"aggregation.tails={a.tails} is more than rl.group_size={self.rl.group_size}: a "
                                 f"problem's own rollouts never give that many tails, so no aggregation prompt would "
                                 f"be made; lower aggregation.tails or raise rl.group_size")
            if a.expert and a.expert_fraction > 0 and a.tails > a.expert_samples:
                raise ValueError(f"aggregation.tails={a.tails} is more than aggregation.expert_samples="
                                 f"{a.expert_samples}: the expert's rollouts never give that many tails")
        if self.eval_difficulty is not None and self.eval_difficulty < 0:
            raise ValueError(f"eval_difficulty must be >= 0 (or null: each environment's start level), "
                             f"got {self.eval_difficulty}")


@dataclass
class Logging:
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "cascade"
    progress: bool = True


@dataclass
class Rollout:
    """Where rollouts are generated: in-process (default), on ``servers`` that ``cascade run``
    starts (``backend``: ``cascade``, Cascade's OpenAI-compatible server with the torch engine, or
    ``vllm``, vLLM's server through ``train.engine.vllm_server``), or on running servers at ``urls``
    (either kind, started with ``--weights-dir OUT/exchange --api-key KEY``). See cascade/rollout.py."""

    servers: int = 0
    urls: list[str] = field(default_factory=list)
    api_key: str | None = None        # required with urls (or $CASCADE_API_KEY); default for started servers: a random key
    threads: int = 1                  # torch threads per started server
    per_server: int = 8               # requests in flight per server
    startup_timeout_s: float = 180.0
    backend: str = "cascade"          # started servers: cascade | vllm
    python: str | None = None         # their interpreter; default: this one (cascade), .venv-vllm/bin/python if present (vllm)
    server_args: str = ""             # extra flags for started servers, shell-split (e.g. "--gpu-memory-utilization 0.5")
    # GPU ids for the started servers, split evenly in order (server k sees its slice as CUDA_VISIBLE_DEVICES:
    # [2, 3, 4, 5] with servers=2 gives "2,3" and "4,5", for vLLM's --tensor-parallel-size 2); default: every
    # server inherits this process's GPUs (several vLLM servers would then all take the first one)
    gpus: list[int] = field(default_factory=list)
    # how weight versions reach the servers: files (each server reads and hashes the version published
    # in OUT/exchange) or broadcast (over a process group with the cascade process, which holds each
    # version: NCCL on GPU, gloo on CPU; the files are still written, for resume and restarted
    # servers, and are the fallback)
    weight_transport: str = "files"
    group_host: str = "127.0.0.1"     # broadcast: the address the servers reach this process at
    # broadcast: longest wait for the weight group (forming it, one version's collective). A member that
    # died fails the version at once (found before it, or its collective fails and the group is closed):
    # that version goes by files and the group is formed again; a host that stops answering mid-transfer
    # can cost this much once, and so does each try to form a group that a member cannot join (the tries
    # come 1, 2, 4, ... at most 32 versions apart while the servers stay the same)
    group_timeout_s: float = 120.0
    # a server out of the pool (down, not restarted by this run: rollout.urls) is probed this often;
    # one that answers again loads the newest weights and rejoins
    readmit_s: float = 10.0
    # rollout.urls: when every server is down at once (restarted by whoever runs them), the run waits
    # this long for one to come back before it fails (its last checkpoint resumes it); 0: fail at once
    down_wait_s: float = 300.0

    def __post_init__(self):
        if self.backend not in ("cascade", "vllm"):
            raise ValueError(f"unknown rollout.backend {self.backend!r}; choose cascade or vllm")
        if self.group_timeout_s <= 0 or self.readmit_s <= 0 or self.down_wait_s < 0:
            raise ValueError(f"rollout.group_timeout_s and rollout.readmit_s must be > 0 and rollout.down_wait_s "
                             f">= 0, got {self.group_timeout_s}, {self.readmit_s} and {self.down_wait_s}")
        if self.gpus and (not self.servers or len(self.gpus) % self.servers or len(set(self.gpus)) < len(self.gpus)
                          or min(self.gpus) < 0):
            raise ValueError(f"rollout.gpus={list(self.gpus)} must be distinct GPU ids, as many for each of the "
                             f"rollout.servers={self.servers} servers cascade run starts")
        if self.weight_transport not in TRANSPORTS:
            raise ValueError(f"unknown rollout.weight_transport {self.weight_transport!r}; choose from "
                             f"{', '.join(TRANSPORTS)}")
        import shlex

        try:
            shlex.split(self.server_args)
        except ValueError as e:
            raise ValueError(f"rollout.server_args {self.server_args!r}: {e}") from None


@dataclass
class Trainer:
    """Where the RL update runs: in this process (``nproc=1, nnodes=1``), or on ``nproc`` ranks per
    node under torchrun on the sharded core, a DP x TSP mesh with TSP degree ``tsp`` (1: plain data
    parallel) and the data-parallel axis holding 1/DP of the optimizer state. See cascade/learner.py."""

    nproc: int = 1
    nnodes: int = 1
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous, with nnodes > 1
    rdzv_id: str = "cascade"          # prefix: each launch of a stage's ranks adds the stage, its update, a random part
    tsp: int = 1
    tokens_per_micro: int = 16384     # tokens per packed micro-batch on a rank (a longer rollout gets its own)
    timeout_s: float = 3600.0         # longest wait for the ranks (an update, a version, a checkpoint); 0: none
    # longest wait for the ranks' first answer (torch's import, the rendezvous, loading the model on every
    # rank: minutes for a large one), when longer than timeout_s, which then bounds every later wait
    startup_timeout_s: float = 900.0

    def __post_init__(self):
        if self.timeout_s < 0 or self.startup_timeout_s < 0:
            raise ValueError(f"trainer.timeout_s and trainer.startup_timeout_s must be >= 0 (timeout_s 0: no limit), got "
                             f"{self.timeout_s} and {self.startup_timeout_s}")

    @property
    def distributed(self) -> bool:
        return self.nproc * self.nnodes > 1


@dataclass
class Vllm:
    """``engine=vllm``: options passed to :class:`train.engine.vllm_engine.VLLMEngine` (and on to
    ``vllm.LLM``). Started vLLM rollout servers take theirs in ``rollout.server_args``."""

    gpu_memory_utilization: float | None = None  # share of GPU memory for vLLM (weights + KV cache); None: vLLM's 0.9
    tensor_parallel_size: int = 1
    max_model_len: int | None = None             # context length; None: the model's
    extra: dict[str, Any] = field(default_factory=dict)  # any other vllm.LLM keyword, e.g. {enforce_eager: true}

    def __post_init__(self):
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization must be in (0, 1], got {u}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"vllm.max_model_len must be >= 1, got {self.max_model_len}")
        named = {"gpu_memory_utilization", "tensor_parallel_size", "max_model_len", "dtype", "model"}
        clash = sorted(named & set(self.extra))
        if clash:
            raise ValueError(f"vllm.extra sets {', '.join(clash)}: use vllm.<key> (dtype: the top-level dtype)")

    def engine_kwargs(self, dtype: str) -> dict[str, Any]:
        """The keyword arguments ``VLLMEngine(model_dir, **kwargs)`` gets."""
        kw: dict[str, Any] = {"dtype": dtype, "tensor_parallel_size": self.tensor_parallel_size}
        if self.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.max_model_len is not None:
            kw["max_model_len"] = self.max_model_len
        kw.update(self.extra)
        return kw


@dataclass
class RunConfig:
    out: str = "runs/cascade"
    model: str | None = None          # a checkpoint directory or HF Hub id org/name[@rev]; None: a fresh model_preset
    model_preset: str = "tiny-moe"
    model_backend: str = ""           # cascade | auto | transformers; "": $CASCADE_MODEL_BACKEND, else cascade
    engine: str = "torch"             # torch | vllm
    vllm: Vllm = field(default_factory=Vllm)
    device: str = "cpu"
    dtype: str = "float32"            # float32 | bfloat16
    seed: int = 0
    threads: int = 0                  # torch CPU threads; 0: torch's default
    order: list[str] = field(default_factory=lambda: list(STAGE_NAMES))
    stages: dict[str, StageConfig] = field(default_factory=dict)
    logging: Logging = field(default_factory=Logging)
    rollout: Rollout = field(default_factory=Rollout)
    trainer: Trainer = field(default_factory=Trainer)

    def __post_init__(self):
        if self.model_backend not in ("", "cascade", "auto", "transformers"):
            raise ValueError(f"model_backend must be cascade, auto or transformers, got {self.model_backend!r}")
        if self.engine not in ("torch", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; choose torch or vllm")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unknown dtype {self.dtype!r}; choose float32 or bfloat16")

        for key, low in (("rollout.servers", 0), ("rollout.threads", 1), ("rollout.per_server", 1),
                         ("trainer.nproc", 1), ("trainer.nnodes", 1), ("trainer.tsp", 1), ("trainer.tokens_per_micro", 1)):
            section, name = key.split(".")
            v = getattr(getattr(self, section), name)
            if v < low:
                raise ValueError(f"{key} must be >= {low}, got {v}")
        if self.rollout.servers and self.rollout.urls:
            raise ValueError("set rollout.servers (servers cascade starts) or rollout.urls (running servers), not both")
        t = self.trainer
        world = t.nproc * t.nnodes
        if world % t.tsp:
            raise ValueError(f"trainer.tsp={t.tsp} does not divide the trainer's world size {world} "
                             f"(nproc={t.nproc} x nnodes={t.nnodes})")
        if t.nnodes > 1 and not t.rdzv_endpoint:
            raise ValueError("trainer.nnodes > 1 needs trainer.rdzv_endpoint (HOST:PORT of the rendezvous)")
        multi = [s for s in self.order if s in self.stages and self.stages[s].rl.updates_per_batch > 1]
        if t.distributed and multi:
            k = self.stages[multi[0]].rl.updates_per_batch
            raise ValueError(f"stages.{multi[0]}.rl.updates_per_batch={k}: the trainer ranks take one optimizer step "
                             "per rollout batch; use 1 with trainer.nproc/nnodes > 1, or train in this process "
                             "(trainer.nproc=1)")
        if not str(self.out).strip():
            raise ValueError("out= is empty; name a run directory (e.g. out=runs/mine)")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: torch's default), got {self.threads}")
        if not self.model:
            from train.presets import load_preset

            load_preset(self.model_preset)  # an unknown preset names the available ones, before any work
        missing = [s for s in self.order if s not in self.stages]
        if missing:
            raise ValueError(f"order names stages without a config: {missing}; configured: {sorted(self.stages)}")
        repeated = sorted({s for s in self.order if self.order.count(s) > 1})
        if repeated:  # (a stage runs once per run directory: a second entry only reported it again)
            raise ValueError(f"order names {', '.join(repeated)} more than once ({', '.join(self.order)}); a stage runs "
                             f"once in a run directory")


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, with YAML 1.2's floats: ``2e-1`` and ``1e-5`` are numbers (YAML 1.1 reads
    them as strings; OmegaConf adds the same rule), also in settings the schema takes as any value
    (``controller_kwargs``, ``env_kwargs``, ``vllm.extra``); and without YAML 1.1's timestamps:
    ``out: 2024-12-06`` is text (a date is no setting's type, and failed the JSON copy of the config)."""


_Loader.yaml_implicit_resolvers = {c: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:timestamp"]
                                   for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$"),
    list("-+0123456789."))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _read_yaml(path: Path) -> dict:
    try:
        data = _yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} must hold a mapping")
    return _unshare(data)


def _unshare(tree: dict) -> dict:
    """A copy in which no two keys share an object (YAML anchors and deepcopy both alias), so that an
    override of one stage never leaks into another."""
    return json.loads(json.dumps(tree))


# Mappings that a profile replaces whole rather than merges into: an environment mix is one value.
REPLACED_WHOLE = ("envs", "env_kwargs", "sources")


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        merge = isinstance(v, dict) and isinstance(out.get(k), dict) and k not in REPLACED_WHOLE
        out[k] = deep_merge(out[k], v) if merge else v
    return out


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": 1, "c": "x"}`` (values parsed as YAML scalars/lists), except that a
    setting of type str takes the text as written (``out=2024.10``, ``rollout.api_key=0755``,
    ``rl.system_prompt=Note: answer after ####``; a quoted YAML string is its content, and ``null`` or ``~``
    unsets an optional one)."""
    out = {}
    for a in args:
        if "=" not in a:
            raise ConfigError(f"expected key=value, got {a!r}")
        k, _, v = a.partition("=")
        k = k.strip()
        if not k:
            raise ConfigError(f"empty key in {a!r}")
        text = _text_type(k)
        if text and text is not str and v.strip() in ("null", "Null", "NULL", "~"):
            out[k] = None
            continue
        try:
            parsed = _yaml(v) if v != "" else ""
        except yaml.YAMLError:
            parsed = v
        quoted = v.strip()[:1] in ("'", '"') and isinstance(parsed, str)
        out[k] = v if text and not quoted else parsed
    return out


def _text_type(key: str):
    """``str`` or ``str | None`` where the schema types the dotted ``key`` so (stage-relative keys resolve
    against :class:`StageConfig`), else None."""
    import types
    import typing

    tp = _schema_type(key)
    if tp is str:
        return str
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and set(typing.get_args(tp)) == {str, type(None)}:
        return tp
    return None


def set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def load_run_config(overrides: dict[str, Any], base: Path | None = None) -> tuple[RunConfig, dict]:
    """Merge cascade.yaml, the profile named by ``profile=`` and the overrides; return the typed
    config and the merged plain dict (written to the run directory)."""
    cdir = configs_dir()
    tree = _read_yaml(base or cdir / "cascade.yaml")
    overrides = dict(overrides)
    cfile = overrides.pop("config", None)
    from_file = read_override_file(cfile) if cfile is not None else {}
    profile = overrides.pop("profile", from_file.pop("profile", None))
    file_stage = from_file.pop("stage", None)
    stage = overrides.pop("stage", file_stage)
    if not isinstance(stage, (str, type(None))):
        raise ConfigError(f"stage= takes one stage name, got {stage!r}; for several use order=[...]")
    if file_stage is not None and stage != file_stage:  # the file's stage-relative keys are its stage's
        raise ConfigError(f"{cfile}: its settings are for stage {file_stage!r}, but stage={stage} was given")
    if stage is not None and "order" in overrides:
        raise ConfigError(f"stage={stage} runs that one stage; give stage= or order=, not both")
    if profile:
        f = cdir / "profiles" / f"{profile}.yaml"
        if not f.exists():
            names = sorted(p.stem for p in (cdir / "profiles").glob("*.yaml"))
            raise ConfigError(f"unknown profile {profile!r}; available: {', '.join(names)}")
        tree = _unshare(deep_merge(tree, _read_yaml(f)))
    if stage is not None:
        if stage not in tree.get("stages", {}):
            raise ConfigError(f"unknown stage {stage!r}; stages: {', '.join(tree.get('stages', {}))}")
        tree["order"] = [stage]
    top = {f for f in RunConfig.__dataclass_fields__}
    for source, over in ((cfile, from_file), (None, flatten_overrides(overrides))):  # the file, then the command line
        set_keys: list[str] = []
        for k, v in over.items():
            head = k.split(".")[0]
            if head not in top and stage is not None:
                k = f"stages.{stage}.{k}"  # with stage=NAME, other keys are relative to that stage
            try:
                _check_key_path(tree, k)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}" if source else str(e)) from None
            set_dotted(tree, k, v)
            set_keys.append(k)
        _clear_replaced(tree, set_keys)  # each layer over what came before it (a file's phases, then the command line)
    if stage is not None:
        tree["order"] = [stage]  # over an order a config file holds (print_config's dump has one)
    cfg = build(RunConfig, tree)
    if not cfg.order:
        raise ConfigError(f"order is empty: name the stages to run (configured: {', '.join(cfg.stages)})")
    return cfg, tree


def _clear_replaced(tree: dict, set_keys: list[str]) -> None:
    """What one layer of overrides (a config file's, or the command line's) replaces in what the layers
    before it configured: a stage's mix set (``envs`` or ``sources``) drops its phases and its mix given
    the other way; its ``aggregation.fraction`` set drops the phases' own shares. A stage whose phases the
    same layer sets keeps them as given."""
    for k in set_keys:
        parts = k.split(".")
        if len(parts) < 3 or parts[0] != "stages" or f"stages.{parts[1]}.phases" in set_keys:
            continue
        st = tree["stages"][parts[1]]
        if len(parts) == 3 and parts[2] in ("envs", "sources"):
            # a mix given as an override replaces the stage's configured phases, and its mix given the other way
            st["phases"] = []
            other = "sources" if parts[2] == "envs" else "envs"
            if f"stages.{parts[1]}.{other}" not in set_keys:
                st[other] = {}
        elif parts[2:] == ["aggregation", "fraction"]:  # (a mapping given for aggregation arrives as its keys)
            # the stage's aggregation share, set: every phase takes it (a phase's own share would hide it)
            for ph in st.get("phases") or []:
                if isinstance(ph, dict):
                    ph.pop("aggregation", None)


def read_override_file(path: str) -> dict[str, Any]:
    """A user's YAML file of overrides (``config=FILE.yaml``) as dotted keys. It may nest
    (``rl: {group_size: 8}``) or use dotted keys (``rl.group_size: 8``), like the command line;
    ``profile`` and ``stage`` are taken as on the command line. A mapping the schema holds as one
    value (``envs``, ``env_kwargs``, ``vllm.extra``, ...) replaces the configured one whole."""
    p = Path(str(path))
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    return flatten_overrides(_read_yaml(p))


def flatten_overrides(node: dict, prefix: str = "") -> dict[str, Any]:
    """Overrides as dotted keys: a mapping given for a part of the schema that has named fields (``rl.optim:
    {lr: 1e-6}``) is that many overrides, merged into what is configured (not a new section that drops the
    rest; an empty one changes nothing); one the schema holds as one value (:data:`REPLACED_WHOLE`: ``envs``,
    ``sources``, ...) stays whole."""
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key.split(".")[-1] not in REPLACED_WHOLE and _holds_fields(key):
            out.update(flatten_overrides(v, key + "."))
        else:
            out[key] = v
    return out


def _holds_fields(key: str) -> bool:
    """Whether the schema has named fields below ``key`` (a dataclass, or the ``stages`` mapping of
    them), so a nested mapping there is a set of separate overrides; stage-relative keys
    (``rl.group_size`` with ``stage=NAME``) resolve against :class:`StageConfig`."""
    import dataclasses
    import typing

    cls = _schema_type(key)
    return dataclasses.is_dataclass(cls) or (typing.get_origin(cls) is dict and
                                             dataclasses.is_dataclass((typing.get_args(cls) or (0, 0))[1]))


def _schema_type(key: str) -> Any:
    """The type the schema gives the dotted ``key`` (through dataclass fields and mappings' values), or
    None where it has none; stage-relative keys resolve against :class:`StageConfig`."""
    import dataclasses
    import typing

    parts = key.split(".")
    cls: Any = RunConfig if parts[0] in RunConfig.__dataclass_fields__ else StageConfig
    for p in parts:
        if dataclasses.is_dataclass(cls):
            cls = typing.get_type_hints(cls).get(p)
        elif typing.get_origin(cls) is dict and typing.get_args(cls)[1:]:
            cls = typing.get_args(cls)[1]
        else:
            return None
        if cls is None:
            return None
    return cls


def _check_key_path(tree: dict, key: str) -> None:
    """Fail on a key the schema does not have, naming the valid keys at that level."""
    import dataclasses
    import typing

    cls: Any = RunConfig
    parts = key.split(".")
    where = []
    for p in parts:
        if cls is None:
            return
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls)
            if p not in hints:
                at = ".".join(where) or "top level"
                raise ConfigError(f"unknown key {key!r}: {p!r} is not valid at {at}; valid keys: "
                                  f"{', '.join(sorted(hints))}")
            cls = hints[p]
        elif typing.get_origin(cls) is dict:
            args = typing.get_args(cls)
            if len(where) >= 1 and where[-1] == "stages" and p not in tree.get("stages", {}):
                raise ConfigError(f"unknown stage {p!r} in {key!r}; stages: {', '.join(tree.get('stages', {}))}")
            cls = args[1] if len(args) == 2 else None
        else:
            return
        where.append(p)
