"""SFT steps of the policy in the TSP layout, launched with torchrun.

    torchrun --nproc-per-node D -m train.parallel.train_tsp --model DIR --steps N --out DIR \
        [--data FILE.jsonl] [--seq 64] [--batch 4] [--lr 1e-4] [--dp 1]

gloo on CPU, NCCL on CUDA. World = dp x D (DP on the outer axis, ZeRO-1 AdamW over it); a step's loss is
the mean over the target tokens of the whole batch, every replica's (one process's step on that batch), and a
zaya policy's balancing biases move by the whole batch's routing. Data: a
jsonl file whose lines hold ``{"input_ids": [...]}`` (cut or right-padded to ``--seq``; padding
is not trained on), or, without ``--data``, a seeded synthetic pool of 16 sequences, each a repeated
5-token motif (quick to learn). Each rank writes its shards in a background thread
(``OUT/shards/rank{r}.safetensors``); rank 0 then gathers them into an HF checkpoint in ``OUT``
(``save_pretrained``, tokenizer files copied) and writes ``OUT/train_log.jsonl``. With
``--probe`` the sharded model's logits on a probe batch are saved to ``OUT/probe.pt`` so a
single-process load of the checkpoint can be compared with them.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist


class AsyncShardSaver:
    """Writes a rank's shard state dict to safetensors in a background thread."""

    def __init__(self, shards: dict[str, torch.Tensor], path: Path):
        from safetensors.torch import save_file

        self.path = path
        cpu = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in shards.items()}  # snapshot now
        path.parent.mkdir(parents=True, exist_ok=True)
        self.error: BaseException | None = None

        def run():
            try:
                save_file(cpu, str(path))
            except BaseException as e:  # surfaced by wait()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self) -> Path:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.path


BUFFERS = "buffers.safetensors"  # state that is no parameter (a zaya policy's balancing biases), rank 0's


def gather_checkpoint(model_dir: Path, shard_dir: Path, D: int, out: Path, kinds: dict[str, str]) -> Path:
    """Join ``rank{0..D-1}.safetensors`` (and the buffers, the same on every rank) into a full HF checkpoint
    at ``out``."""
    from safetensors.torch import load_file

    from train.model.hf_io import load_config, load_into, save_pretrained
    from train.model.modeling import CausalLM
    from train.parallel.shard import ShardedLM

    shards = [load_file(str(shard_dir / f"rank{r}.safetensors")) for r in range(D)]
    full = ShardedLM.assemble(shards, kinds)
    if (shard_dir / BUFFERS).exists():
        full.update(load_file(str(shard_dir / BUFFERS)))
    model = CausalLM(load_config(model_dir))
    load_into(model, full, hf_names=False)
    return save_pretrained(model, out, tokenizer_dir=model_dir)


def batches(path: str | None, vocab: int, seq: int, batch: int, seed: int):
    """Endless (input_ids, loss_mask) batches."""
    if path:
        rows = []
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            ids = json.loads(line).get("input_ids")
            if not isinstance(ids, list) or len(ids) < 2:
                raise ValueError(f"{path}:{i + 1}: each line needs an 'input_ids' list of at least 2 tokens")
            if max(ids) >= vocab or min(ids) < 0:
                raise ValueError(f"{path}:{i + 1}: token id out of range [0, {vocab})")
            rows.append(ids[:seq])
        if not rows:
            raise ValueError(f"{path}: no examples")
        g = torch.Generator().manual_seed(seed)
        while True:
            pick = torch.randint(0, len(rows), (batch,), generator=g).tolist()
            ids = torch.zeros(batch, seq, dtype=torch.long)
            mask = torch.zeros(batch, seq, dtype=torch.bool)
            for b, k in enumerate(pick):
                ids[b, :len(rows[k])] = torch.tensor(rows[k])
                mask[b, :len(rows[k])] = True
            yield ids, mask
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, vocab, (16, 5), generator=g)  # synthetic: 16 rows, each a repeated motif
    pool = pool.repeat(1, -(-seq // 5))[:, :seq]
    while True:
        ids = pool[torch.randint(0, len(pool), (batch,), generator=g)]
        yield ids, torch.ones_like(ids, dtype=torch.bool)


def main(argv: list[str] | None = None) -> int:
    from train.model.zaya import balance_router_biases
    from train.parallel.dp import ZeroAdamW
    from train.parallel.shard import make_mesh
    from train.parallel.tsp import tsp_from_pretrained

    ap = argparse.ArgumentParser(prog="train_tsp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe", action="store_true")
    a = ap.parse_args(argv)
    from envs.hub import resolve_model

    a.model = str(resolve_model(a.model))  # a local directory, or a Hub id's snapshot in the HF cache
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if a.steps < 0 or a.seq < 2 or a.dp < 1 or a.batch < 1 or world % a.dp:
        raise ValueError(f"bad arguments: steps={a.steps} (>= 0) seq={a.seq} (>= 2) batch={a.batch} (>= 1) dp={a.dp} "
                         f"(>= 1, dividing the world size {world})")
    D = world // a.dp
    tsp_group, dp_group = make_mesh(a.dp, D) if a.dp > 1 else (None, None)
    out = Path(a.out)
    model = tsp_from_pretrained(a.model, tsp_group, dp_group, device=device)  # this rank's slices only
    dp_rank = rank // D
    opt = ZeroAdamW(model.parameters(), dp_group, lr=a.lr, weight_decay=0.0, reduce_grads=False) if dp_group \
        else torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    data = batches(a.data, model.config.vocab_size, a.seq, a.batch * a.dp, a.seed)
    # the ranks that saw other tokens of a step's batch: a zaya policy's balancing biases move by all of them
    routed_over = (tsp_group or dist.group.WORLD, dp_group) if dp_group is not None else dist.group.WORLD
    log = []
    for step in range(a.steps):
        ids, mask = next(data)
        # the mean over the target tokens of the whole batch (all replicas), as one process would take it
        count = (mask[:, 1:].sum().clamp(min=1)).to(device, torch.float32)
        sl = slice(dp_rank * a.batch, (dp_rank + 1) * a.batch)
        ids, mask = ids[sl].to(device), mask[sl].to(device)
        loss = model.sft_loss(ids, mask, attention_mask=mask if not bool(mask.all()) else None, count=count)
        loss.backward()
        model.sync_grads(mean=False)
        opt.step()
        opt.zero_grad()
        balance_router_biases(model, routed_over)
        total = loss.detach().clone()
        dist.all_reduce(total, group=tsp_group)
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        log.append({"step": step + 1, "loss": total.item()})
        if rank == 0:
            print(json.dumps(log[-1]), flush=True)
    saver = AsyncShardSaver(model.shard_state_dict(), out / "shards" / f"rank{rank % D}.safetensors") \
        if dp_rank == 0 else None
    if rank == 0 and model.model_buffers():
        AsyncShardSaver(model.model_buffers(), out / "shards" / BUFFERS).wait()
    if a.probe:  # overlaps with the background save
        ids, _ = next(batches(None, model.config.vocab_size, a.seq, 2, a.seed + 1))
        ids = ids.to(device)
        with torch.no_grad():
            logits = model.gather_logits(model(ids), ids.shape[1])
        if rank == 0:
            torch.save({"input_ids": ids.cpu(), "logits": logits.cpu()}, out / "probe.pt")
    if saver is not None:
        saver.wait()
    dist.barrier()
    if rank == 0:
        gather_checkpoint(Path(a.model), out / "shards", D, out, model.kinds)
        (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
        print(json.dumps({"checkpoint": str(out), "steps": a.steps, "D": D, "dp": a.dp}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
