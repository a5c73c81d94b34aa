"""PipelineRL: rollouts generated continuously, ahead of the trainer by at most ``max_staleness``
policy versions, through a bounded buffer (ZAYA1 section IV-B1; PipelineRL, prime-rl).

A producer thread runs :meth:`RLTrainer.collect` (curriculum, engine, verification, gates, dynamic
sampling) batch after batch and puts the groups into a :class:`RolloutBuffer`, each tagged with the
oldest policy version that sampled any of its tokens. :meth:`Pipeline.step` (the trainer) waits
until ``min_ready_batches`` batches are buffered, takes the oldest batch's groups (each buffered group is
tagged with its batch: a batch that dynamic sampling left short, or that lost groups to eviction or to the
staleness check, takes none of the next one's), drops
those more than ``max_staleness`` versions behind (counted), updates the policy, and every
``sync_every`` steps sends the weights to the engine while generation goes on.

Bounded staleness by construction: the producer starts a batch only while it is at most
``max_staleness`` batches ahead of the trainer's finished steps and the engine serves weights at
most ``max_staleness`` versions older than those the trainer will have when it consumes that
batch. With ``max_staleness=0`` generation and training alternate exactly as in the synchronous
loop (same RNG draws in the same order: the same metrics); with ``k > 0`` the rollouts of the
next ``k`` batches overlap the update. The buffer's staleness check is the safety net for groups that wait
longer (a slow trainer, a version swap in flight, an engine that lags).

Engines that swap weights between decode steps (``supports_inflight_update``) take the new weights
while a ``generate`` call runs, so one completion may span versions; for other engines the swap
waits for the current ``generate`` call to return.

Threads: when the engine generates in this process's CPU threads and the update runs here too (no
trainer ranks, no rollout servers, no GPU), the rollout thread and the update would each start a
pool of torch's intra-op threads on the same cores, and both slow down. :func:`thread_split` gives the
rollout thread ``rl.rollout_threads`` of them (default: half) and the update the rest, restored by
:meth:`Pipeline.close`; while the producer waits (it is as far ahead as staleness allows) the update
borrows its threads, chunk by chunk (:meth:`Pipeline.lend_threads`; ``Pipeline.lent`` counts those chunks).

Checkpoints: inside :meth:`Pipeline.paused` (no batch in progress) the RNG and curriculum are a
consistent snapshot, and :meth:`Pipeline.state` holds what the producer made from them that the trainer
has not consumed yet (the buffered groups with their versions, each produced batch's rollout
metrics, the counters). ``Pipeline(rl, state)`` starts from it, so a resumed run trains the groups
that were waiting, in order, instead of skipping their prompts (PipelineRL drops them).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any

import torch

from train.rl.trainer import Group, RLTrainer, group_version


def thread_split(rl: RLTrainer) -> tuple[int, int] | None:
    """(rollout threads, update threads) for a pipeline around ``rl``, or None to leave both on all
    of torch's threads: the engine or the update runs elsewhere (servers, trainer ranks, a GPU)."""
    engine = getattr(rl.engine, "engine", rl.engine)  # through LockedEngine
    n, k = torch.get_num_threads(), rl.cfg.rollout_threads
    on_cpu = torch.device(rl.policy.device).type == "cpu"
    if not rl.cfg.max_staleness or not getattr(engine, "computes_here", False) or rl.learner is not None \
            or not on_cpu:  # max_staleness 0: nothing overlaps (and the synchronous loop's threads stay)
        return None
    k = k or n // 2
    return None if k < 1 or k >= n else (k, n - k)


_GROUPS = "_batch_groups"  # a pending batch's group count in checkpoints of before the buffer's batch tags


class RolloutBuffer:
    """Groups waiting for the trainer, oldest first, each tagged with the batch that produced it and
    the oldest policy version of its tokens (None for a group with no token: never stale), with a
    capacity (oldest evicted)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("buffer capacity must be >= 1 group")
        self.capacity = capacity
        self._q: deque[tuple[int, int | None, Group]] = deque()  # (batch, version, group)
        self.evicted = 0
        self.dropped_stale = 0
        self.cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._q)

    def put(self, groups: list[Group], batch: int = 0) -> None:
        with self.cond:
            for g in groups:
                self._q.append((batch, group_version(g), g))
                while len(self._q) > self.capacity:
                    self._q.popleft()
                    self.evicted += 1
            self.cond.notify_all()

    def take(self, batch: int, version: int, max_staleness: int) -> list[Group]:
        """The groups of ``batch`` still buffered, oldest first, skipping (and counting) those sampled
        more than ``max_staleness`` versions before ``version``; none of a later batch's."""
        out = []
        with self.cond:
            while self._q and self._q[0][0] < batch:  # an earlier batch's, never taken (none do): evicted
                self._q.popleft()
                self.evicted += 1
            while self._q and self._q[0][0] == batch:
                _, v, g = self._q.popleft()
                if v is not None and version - v > max_staleness:  # None: no token sampled, nothing stale
                    self.dropped_stale += 1
                else:
                    out.append(g)
        return out


class Pipeline:
    """Asynchronous RL steps around an :class:`RLTrainer` (see the module docstring).

    ``step()`` returns the same metrics as :meth:`RLTrainer.step` plus the pipeline's: buffer fill,
    groups dropped as stale or evicted, the version lag of the trained tokens (mean, max,
    histogram) and the rollout / trainer busy fractions since the previous step."""

    def __init__(self, rl: RLTrainer, state: dict | None = None, before_batch=None, batches: int | None = None):
        self.rl, cfg = rl, rl.cfg
        if cfg.max_staleness < cfg.sync_every - 1:
            # weights reach the engine every sync_every steps: rollouts in between are that many versions old
            raise ValueError(f"a pipeline needs max_staleness >= sync_every - 1 (got {cfg.max_staleness} and "
                             f"{cfg.sync_every}); max_staleness=0 is RLTrainer.step's synchronous loop")
        # before_batch(k): called by the producer before it samples the k-th batch from here (0: the batch the next
        # step() trains on; a resumed state's batches count), e.g. to set that step's mix and response cap; what it
        # returns joins that batch's metrics. batches: how many the trainer will take (no batch is made past them,
        # so closing waits for none and the curriculum is not moved by rollouts never trained on)
        self.before_batch, self.batches = before_batch, batches
        self.max_staleness, self.batch = cfg.max_staleness, cfg.prompts_per_step
        self.buffer = RolloutBuffer(cfg.buffer_groups or (cfg.max_staleness + 2) * self.batch)
        # the trainer can wait for at most the batches the producer may run ahead, and for at most the batches the
        # buffer holds (waiting for more, it would find the oldest batch's groups evicted: every step short)
        lead, fits = cfg.max_staleness - cfg.sync_every + 2, self.buffer.capacity // self.batch
        self.min_ready = max(1, min(cfg.min_ready_batches, lead, fits))
        if self.min_ready < cfg.min_ready_batches:
            why = [f"with rl.max_staleness={cfg.max_staleness} and rl.sync_every={cfg.sync_every} the producer runs "
                   f"at most {lead} batch(es) ahead"] if lead < cfg.min_ready_batches else []
            why += [f"rl.buffer_groups={self.buffer.capacity} holds {fits} batch(es) of rl.prompts_per_step="
                    f"{self.batch} (waiting for more would evict the oldest unused)"] if fits < cfg.min_ready_batches \
                else []
            logging.getLogger(__name__).warning("rl.min_ready_batches=%d lowered to %d: %s", cfg.min_ready_batches,
                                                self.min_ready, "; ".join(why))
        if self.buffer.capacity < (cfg.max_staleness + 1) * self.batch:
            logging.getLogger(__name__).warning(
                "rl.buffer_groups=%d holds fewer groups than the %d batch(es) the producer may run ahead: whenever "
                "it gets further ahead of the trainer than the buffer holds (a slow update, time spent between "
                "steps on evaluation or checkpoints) the oldest are evicted unused and their steps train on what is "
                "left of them", self.buffer.capacity, cfg.max_staleness + 1)
        self._produced = 0  # batches the producer has made
        self._done = 0      # trainer steps finished (update and sync), each consuming one batch
        self._pending: deque[dict] = deque()  # rollout metrics of produced batches, in order
        self._stop = threading.Event()
        self._pause = False
        self._idle = threading.Event()
        self._error: BaseException | None = None
        self._busy_roll = self._busy_train = 0.0  # since the last step's metrics
        self._since = time.perf_counter()
        self._roll_start: float | None = None  # when the batch in progress started (None: none is)
        self._reported = (0, 0)  # (dropped_stale, evicted) counts up to the last step's metrics
        if state is not None:
            self._load_state(state)
        if not getattr(rl.engine, "supports_inflight_update", False):
            rl.engine = LockedEngine(rl.engine, rl.synced_version)
        self._threads_before = torch.get_num_threads()
        self.threads = thread_split(rl)
        self.lent = 0  # update chunks that ran on the producer's threads too (it was waiting)
        if self.threads is not None:
            torch.set_num_threads(self.threads[1])  # this (the update's) thread; the producer sets its own
            self._update_threads = self.threads[1]
            rl.between_kernels = self.lend_threads
        self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        self._thread.start()

    # -- producer --------------------------------------------------------------------------------
    def _may_start(self) -> bool:
        """Start the next batch when it is at most ``max_staleness`` batches ahead of the trainer's
        finished steps and the engine's weights are recent enough for it: the trainer consumes it
        at version ``step_idx + ahead`` (if every step between trains), which may exceed the
        engine's version by at most ``max_staleness``."""
        ahead = self._produced - self._done
        if self.batches is not None and self._produced >= self.batches:
            return False
        return (not self._pause and ahead <= self.max_staleness
                and self.rl.synced_version >= self.rl.step_idx + ahead - self.max_staleness)

    def _produce(self) -> None:
        cond = self.buffer.cond
        if self.threads is not None:
            torch.set_num_threads(self.threads[0])  # per thread (OpenMP's and MKL's settings are thread-local)
        try:
            while not self._stop.is_set():
                with cond:
                    while not self._stop.is_set() and not self._may_start():
                        self._idle.set()
                        cond.wait(0.1)
                    if self._stop.is_set():
                        return
                    self._idle.clear()
                    self._roll_start = time.perf_counter()
                extra = self.before_batch(self._produced) if self.before_batch is not None else None
                groups, metrics = self.rl.collect()
                metrics.update(extra or {})
                metrics["difficulty"] = self.rl.curriculum.difficulties()  # as the sync loop reads it
                with cond:  # one critical section: a step never sees a batch's metrics without its groups
                    # the part of the batch since the last step's metrics (that step counted the part before)
                    self._busy_roll += time.perf_counter() - max(self._roll_start, self._since)
                    self._roll_start = None
                    self.buffer.put(groups, self._produced)
                    self._pending.append(metrics)
                    self._produced += 1
        except BaseException as e:  # surfaced by step()
            self._error = e
            with cond:
                cond.notify_all()
        finally:
            self._idle.set()

    # -- trainer ---------------------------------------------------------------------------------
    def lend_threads(self) -> None:
        """Before each chunk of the update (a forward, a backward, an optimizer step): all of torch's
        threads while the producer waits (the buffer is as far ahead as staleness allows), else the
        update's share. A batch the producer starts meanwhile shares the cores until the next chunk."""
        n = sum(self.threads) if self._idle.is_set() else self.threads[1]
        if n != self._update_threads:
            torch.set_num_threads(n)
            self._update_threads = n
        self.lent += n > self.threads[1]

    def _ready(self) -> bool:
        # min_ready batches, or the last ones (no more are coming)
        return len(self._pending) >= self.min_ready or \
            (self.batches is not None and self._produced >= self.batches and len(self._pending) > 0)

    def step(self) -> dict[str, Any]:
        rl, cond = self.rl, self.buffer.cond
        t0 = time.perf_counter()
        with cond:
            while not self._ready() and self._error is None:
                cond.wait(0.1)
            if self._error is not None:
                raise RuntimeError(f"rollout producer failed: {self._error}") from self._error
            fill = len(self.buffer) / self.buffer.capacity
            rollout_metrics = self._pending.popleft()
            # the batch's own groups (one left short by dynamic sampling, eviction or staleness takes none of the
            # next batch's, sampled under the next step's mix and response cap)
            groups = self.buffer.take(self._done, rl.step_idx, self.max_staleness)
        m: dict[str, Any] = {"step": rl.step_idx, **rollout_metrics}
        m["groups_trained"] = len(groups)
        difficulty = m.pop("difficulty")
        t1 = time.perf_counter()
        m.update(rl.train_on(groups))
        with cond:
            now = time.perf_counter()
            self._busy_train += now - t1
            wall = max(now - self._since, 1e-9)
            if self._roll_start is not None:  # the batch in progress: its part so far counts in this step
                self._busy_roll += now - max(self._roll_start, self._since)
            # since the last step's metrics: evictions while the trainer waited for the buffer count too
            stale0, evicted0 = self._reported
            self._reported = (self.buffer.dropped_stale, self.buffer.evicted)
            m.update(buffer_fill=fill, groups_dropped_stale=self.buffer.dropped_stale - stale0,
                     groups_evicted=self.buffer.evicted - evicted0, policy_version=rl.step_idx,
                     rollout_busy_frac=min(1.0, self._busy_roll / wall),
                     trainer_busy_frac=min(1.0, self._busy_train / wall))
            self._busy_roll = self._busy_train = 0.0
            self._since = now
            self._done += 1
            cond.notify_all()  # a new version may let the producer start its next batch
        m["difficulty"] = difficulty
        m["time_step_s"] = time.perf_counter() - t0
        return m

    def state(self) -> dict[str, Any]:
        """What was produced and not yet trained on (call inside :meth:`paused`): the buffered
        ``(version, group)`` pairs oldest first and the batch of each (0: the next step's), the rollout
        metrics of each batch not yet consumed, how many batches ahead of the trainer that is, the
        buffer's drop counters and how much of them the steps' metrics reported (a resumed run reports the
        rest: groups evicted after the last step, before the checkpoint)."""
        if not self._idle.is_set():
            raise RuntimeError("Pipeline.state() needs the producer paused (inside Pipeline.paused())")
        with self.buffer.cond:
            q = self.buffer._q
            return {"queue": [(v, g) for _, v, g in q], "queue_batches": [b - self._done for b, _, _ in q],
                    "pending": [dict(m) for m in self._pending],
                    "ahead": self._produced - self._done, "evicted": self.buffer.evicted,
                    "dropped_stale": self.buffer.dropped_stale,
                    "reported": {"dropped_stale": self._reported[0], "evicted": self._reported[1]}}

    def _load_state(self, st: dict[str, Any]) -> None:
        if len(st["pending"]) != st["ahead"]:
            raise ValueError(f"pipeline state: {len(st['pending'])} batches of metrics for {st['ahead']} batches ahead")
        self._pending = deque(dict(m) for m in st["pending"])
        batches = st.get("queue_batches")
        if batches is None:  # a checkpoint of before the batch tags: each pending batch counted its groups
            counts = [m.pop(_GROUPS, self.batch) for m in self._pending]
            batches = [next((b for b in range(len(counts)) if sum(counts[:b + 1]) > i), len(counts) - 1)
                       for i in range(len(st["queue"]))]
        self.buffer._q = deque((int(b), v, g) for b, (v, g) in zip(batches, st["queue"]))
        self._produced, self._done = int(st["ahead"]), 0
        self.buffer.evicted, self.buffer.dropped_stale = int(st["evicted"]), int(st["dropped_stale"])
        rep = st.get("reported")  # (checkpoints of before it: everything counted as reported)
        self._reported = (int(rep["dropped_stale"]), int(rep["evicted"])) if rep is not None else \
            (self.buffer.dropped_stale, self.buffer.evicted)

    @contextmanager
    def paused(self):
        """No rollout batch in progress inside the block (a consistent RNG/curriculum snapshot)."""
        with self.buffer.cond:
            self._pause = True
        self._idle.wait()
        try:
            yield
        finally:
            with self.buffer.cond:
                self._pause = False
                self.buffer.cond.notify_all()

    def close(self) -> None:
        """Stops the producer: a batch it is generating stops at the engine's next decoding step (the engine's
        ``interrupt``, where it has one: Ctrl-C or SIGTERM of a run waited for the whole batch in flight, minutes
        at a recipe's 2,048 rollouts); the engine generates again once the producer has ended."""
        self._stop.set()
        with self.buffer.cond:
            self.buffer.cond.notify_all()
        interrupt = getattr(self.rl.engine, "interrupt", None)
        if interrupt is not None:
            interrupt()
        try:
            self._thread.join()
        finally:
            if interrupt is not None:
                interrupt(False)
        if self.threads is not None:
            torch.set_num_threads(self._threads_before)
            self.rl.between_kernels = lambda: None
        if isinstance(self.rl.engine, LockedEngine):
            self.rl.engine = self.rl.engine.engine


class LockedEngine:
    """An engine that cannot swap weights during ``generate``: a weight load waits for the running
    ``generate`` call (one rollout round) to return. Completions the engine leaves untagged are tagged
    with the version of the weights that sampled them, read under the lock (``version``: the engine's
    at the start; a ``generate`` that waited for a load samples with the loaded weights)."""

    def __init__(self, engine, version: int = 0):
        self.engine, self._lock = engine, threading.Lock()
        self._version = version

    def generate(self, *a, **kw):
        from train.rl.trainer import engine_version

        with self._lock:
            out = self.engine.generate(*a, **kw)
            v = engine_version(self.engine, self._version)
        for c in out:
            if getattr(c, "versions", None) is None:
                c.versions = [v] * len(c.token_ids)
        return out

    def load_weights(self, state_dict, version: int | None = None) -> None:
        from train.rl.trainer import load_weights

        with self._lock:
            load_weights(self.engine, state_dict, version if version is not None else 0)
            self._version = version if version is not None else 0

    def __getattr__(self, name):
        return getattr(self.engine, name)
