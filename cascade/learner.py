"""The trainer role as separate processes: ``trainer.nproc`` ranks under ``torchrun`` running
:mod:`train.rl.worker` on the sharded core (DP x TSP), driven by the orchestrator through the run's
exchange directory (:mod:`train.rl.exchange`).

The orchestrator keeps everything group-level (verification, rewards, advantages, dynamic
sampling, the curriculum) and hands the trainer ranks a :class:`TrainBatch` per update; they
publish weight versions, which the orchestrator loads into its own copy of the policy (for
evaluation and its HF checkpoints) and into the rollout engine. Checkpoints stay in step: before
the orchestrator writes its checkpoint after ``u`` updates (once its previous one is written) it asks
the ranks for theirs at ``u`` (:func:`train.rl.worker.request_path`); the ranks keep one checkpoint
more than the orchestrator, which may fall back to the one before its newest; and on resume the
ranks' newer checkpoints and batches are removed, so both sides continue from the same update (a
resume the ranks have no checkpoint for is refused before anything is removed).

A stage's SFT warm-up runs on the same ranks (``sft_steps`` > 0): SFT step ``i`` is update
``i`` and RL update ``k`` is update ``sft_steps + k`` (weight versions stay RL's: version 0 is
the policy after SFT); checkpoints are asked for by update.

With ``trainer.nnodes > 1`` this process starts the ranks of its own node; every other node runs
the command logged in ``OUT/stages/N-NAME/logs/trainer-command.txt`` (see
scripts/slurm/cascade_rl.sbatch), removed when the ranks are stopped. Each launch meets under a
rendezvous id of its own (``trainer.rdzv_id``, the stage, the update it starts at and a random part):
a node running an older launch's command does not join it.
"""
from __future__ import annotations

import inspect
import json
import os
import secrets
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import torch

from envs.workers import kill_tree
from train.errors import RunFailure
from train.rl.exchange import TrainBatch, TrainSample, batch_path, load_version, stack_routing, version_dir


class WorkerLearner:
    def __init__(self, exchange: Path, model_dir: Path, tcfg, rl_cfg, steps: int, start_update: int, log_dir: Path,
                 dtype: str = "float32", pad_id: int = 0, device: str = "cpu", sft_steps: int = 0, sft_optim=None):
        """``steps``: RL updates; ``start_update``: updates already done (SFT and RL) at a resume."""
        from cascade.checkpoint import Checkpointer
        from train.parallel.rl_update import RLUpdateConfig
        from train.rl.worker import CKPT_DIR, config_dict, launch_command, process_start

        # the ranks run in the repository root: every path they are given absolute
        self.exchange, self.log_dir = Path(exchange).absolute(), Path(log_dir).absolute()
        model_dir = Path(model_dir).absolute()
        self.timeout = tcfg.timeout_s
        # until the ranks first answer, their start (import, rendezvous, loading the model) may take longer
        self.startup_timeout = max(self.timeout, tcfg.startup_timeout_s) if self.timeout else 0
        self._up = False
        self.sft_steps = sft_steps
        self.exchange.mkdir(parents=True, exist_ok=True)  # a stage may end before it sends the ranks anything
        ck = self.exchange / CKPT_DIR / f"step-{start_update:06d}" / "COMPLETE"
        if start_update > 0 and not ck.exists():  # (refused before anything of the ranks is removed)
            raise ValueError(f"cannot resume: the orchestrator's checkpoint is after update {start_update} but the "
                               f"trainer ranks have no complete checkpoint of it ({ck.parent}); remove "
                               f"{self.exchange} and the stage's checkpoints to start the stage again")
        self._clear_after(start_update, CKPT_DIR)
        ref = getattr(rl_cfg, "kl_reference", None)  # the ranks run in the repository root: an absolute path
        if ref:
            from envs.hub import resolve_model

            ref = str(resolve_model(ref, "KL reference").resolve())  # a directory, or a Hub id's cached snapshot
        cfg = RLUpdateConfig(loss=rl_cfg.loss, loss_cfg=rl_cfg.loss_cfg, optim=rl_cfg.optim,
                             tokens_per_micro=tcfg.tokens_per_micro, dtype=dtype, pad_id=pad_id, sft_optim=sft_optim,
                             kl_reference=ref, activation_checkpointing=rl_cfg.activation_checkpointing,
                             ratio_against=rl_cfg.ratio_against)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        conf = self.log_dir / "trainer-config.json"
        conf.write_text(json.dumps(config_dict(cfg), indent=1, default=list))
        from train.parallel.comm import free_port

        import socket

        # the ranks keep one checkpoint more than the orchestrator's Checkpointer (StageRunner's, of the default
        # keep): when its newest does not read back it resumes from the one before (Checkpointer.latest_loadable)
        keep = inspect.signature(Checkpointer).parameters["keep"].default + 1
        extra = ["--sync-every", str(rl_cfg.sync_every), "--sft-steps", str(sft_steps), "--device", "cuda" if device.startswith("cuda") else "cpu",
                 "--keep-checkpoints", str(keep),
                 "--orchestrator-pid", str(os.getpid()), "--orchestrator-host", socket.gethostname(),
                 "--timeout-s", str(self.startup_timeout + 60 if self.timeout else 7 * 86400)]
        # (the ranks' collectives, their first too, wait longer than this process waits for them, which says
        # why it stopped first; NCCL's own timeout, 10 min, is shorter than rank 0 may take to write a large version)
        if (start := process_start()) is not None:
            extra += ["--orchestrator-start", start]
        # this launch's own rendezvous: every node runs this command (the same id), and a node that runs an older
        # launch's command (a finished stage's, an interrupted run's) does not meet it
        rdzv_id = f"{tcfg.rdzv_id}-{self.log_dir.parent.name}-{start_update}-{secrets.token_hex(4)}"
        cmd = launch_command(self.exchange, model_dir, tcfg.nproc, sft_steps + steps, conf, tsp=tcfg.tsp,
                             port=None if tcfg.nnodes > 1 else free_port(), extra=extra, nnodes=tcfg.nnodes,
                             rdzv_endpoint=tcfg.rdzv_endpoint, rdzv_id=rdzv_id)
        self.command = self.log_dir / "trainer-command.txt"  # what the other nodes run; removed by close()
        self.command.write_text(shlex.join(cmd) + "\n")
        self.log = self.log_dir / "trainer.log"
        self._silent = False  # the ranks stopped answering: close() kills them without asking them to stop
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=str(Path(__file__).resolve().parents[1]))

    def _clear_after(self, update: int, ckpt_dir: str) -> None:
        """Remove what the ranks did past ``update`` (their checkpoints, batches, metrics, versions)
        and any leftover stop or checkpoint request: the orchestrator resumes at ``update``."""
        (self.exchange / "STOP").unlink(missing_ok=True)
        shutil.rmtree(self.exchange / "ckpt_requests", ignore_errors=True)
        shutil.rmtree(self.exchange / "final", ignore_errors=True)
        from train.rl.exchange import clear_after

        clear_after(self.exchange, update, self.sft_steps, (ckpt_dir, "batches", "metrics", "weights", "sft/weights"))

    # -- waiting on the ranks ----------------------------------------------------------------------
    def _wait(self, what: str, done) -> None:
        t0 = time.monotonic()
        limit, name = (self.timeout, "trainer.timeout_s") if self._up or self.startup_timeout <= self.timeout \
            else (self.startup_timeout, "trainer.startup_timeout_s: their start")
        while not done():
            if self.proc.poll() is not None:
                raise RunFailure(f"the trainer ranks exited (code {self.proc.returncode}) while the orchestrator "
                                 f"waited for {what}; see {self.log}; its last lines:\n{self.tail()}")
            if limit and time.monotonic() - t0 > limit:
                self._silent = True
                raise RunFailure(f"the trainer ranks sent nothing for {limit:.0f} s ({name}) while "
                                 f"the orchestrator waited for {what}; see {self.log}")
            time.sleep(0.02)
        self._up = True

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def _run(self, batch: TrainBatch) -> dict:
        from train.rl.exchange import write_batch

        step = batch.step
        write_batch(self.exchange, batch)
        path = self.exchange / "metrics" / f"step-{step:06d}.json"
        self._wait(f"the metrics of update {step}", path.exists)
        m = json.loads(path.read_text())
        batch_path(self.exchange, step).unlink(missing_ok=True)  # consumed
        return {k: v for k, v in m.items() if k not in ("step", "version") and not isinstance(v, (dict, list))}

    def update(self, groups, advantages: torch.Tensor, step: int, temperature: float) -> dict:
        """Send the batch of RL update ``step`` and return the ranks' metrics of it."""
        rolls = [r for g in groups for r in g.rollouts]
        samples = [TrainSample(list(r.prompt_ids), list(r.completion.token_ids), list(r.completion.logprobs),
                               float(a), bool(r.keep), r.completion.versions, stack_routing(r.completion.routed_experts))
                   for r, a in zip(rolls, advantages.tolist())]
        return self._run(TrainBatch(self.sft_steps + step, samples, temperature,
                                    {"kind": "rl", "schedule_step": step}))

    def sft(self, examples: list[tuple[list[int], list[int]]], step: int) -> dict:
        """SFT step ``step`` on encoded (prompt ids, response ids) examples (``SFTTrainer.step``'s loss)."""
        if step >= self.sft_steps:
            raise ValueError(f"SFT step {step} is past the {self.sft_steps} SFT steps the ranks were started with")
        samples = [TrainSample(list(p), list(r), [0.0] * len(r), 0.0, True) for p, r in examples]
        m = self._run(TrainBatch(step, samples, 1.0, {"kind": "sft", "schedule_step": step}))
        return {"step": step, **m}

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """The full weights of ``version`` once the ranks have published it (checksums verified)."""
        from train.rl.exchange import COMPLETE

        self._wait(f"weight version {version}", lambda: (version_dir(self.exchange, version) / COMPLETE).exists())
        return load_version(self.exchange, version)[1]

    def checkpoint(self, update: int) -> dict[str, torch.Tensor]:
        """Ask the ranks to checkpoint after ``update`` updates (SFT and RL); returns the weights of that update."""
        from train.rl.worker import request_path

        req = request_path(self.exchange, update)
        req.parent.mkdir(parents=True, exist_ok=True)
        req.write_text("")
        self._wait(f"the checkpoint of update {update}", lambda: not req.exists())
        if update >= self.sft_steps:
            return self.weights(update - self.sft_steps)
        return load_version(self.exchange / "sft", update)[1]

    def final(self) -> dict[str, torch.Tensor]:
        """Stop the ranks and return their final weights."""
        from train.model.hf_io import read_state_dict

        (self.exchange / "STOP").write_text("")
        self._wait("the final checkpoint", lambda: (self.exchange / "final" / "COMPLETE").exists())
        self.proc.wait(timeout=120)
        return read_state_dict(self.exchange / "final")

    def close(self) -> None:
        """Stop the ranks: asked to (STOP, up to 60 s), else, or at once when they went silent (a rank
        hung, the others blocked in a collective with it), killed: the torchrun agent and every rank.
        Their command is removed first: no other node starts it after this."""
        self.command.unlink(missing_ok=True)
        if self.proc.poll() is None:
            if not self._silent:
                (self.exchange / "STOP").write_text("")
                try:
                    self.proc.wait(timeout=60)
                    return
                except subprocess.TimeoutExpired:
                    pass
            kill_tree(self.proc.pid)
            self.proc.wait()
