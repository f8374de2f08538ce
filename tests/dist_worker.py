"""Scenarios run by every rank of a real torch.distributed (gloo) job; results go to JSON files.

Used by tests/test_distributed.py through torch.multiprocessing; also runnable with torchrun:
``torchrun --nproc_per_node=2 tests/dist_worker.py ddp OUTDIR``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stabilityguard import GuardedOptimizer  # noqa: E402
from stabilityguard.testing import MarkovData, TinyGPT, poison_grad, scale_grad  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)


def _digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def ddp(out: Path, rank: int, world: int, sync_ranks: bool = True, log_ranks: str = "zero") -> dict:
    """DDP; a NaN on rank 1 only at step 12, a x1000 spike on rank 0 only at step 15 (after all-reduce)."""
    model = _model()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = GuardedOptimizer(torch.optim.AdamW(ddp_model.parameters(), lr=3e-3), ddp_model, verbose=False,
                           log_dir=out / "logs", log_every=5, sync_ranks=sync_ranks, log_ranks=log_ranks)
    data = MarkovData(vocab_size=32, seed=rank)  # each rank its own data, as with a DistributedSampler
    for step in range(24):
        x, y = data.batch(8, 16)
        loss = torch.nn.functional.cross_entropy(ddp_model(x).reshape(-1, 32), y.reshape(-1))
        loss.backward()
        if step == 12 and rank == 1:
            poison_grad(model.blocks[0].mlp.fc.weight)  # rank-local fault, after DDP's all-reduce
        if step == 15 and rank == 0:
            scale_grad(model.head, 1000.0)
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    c = opt.counters
    return {"rank": rank, "run_id": opt.run_id, "digest": _digest(model), "spikes": c.spikes,
            "nonfinite": c.nonfinite, "skipped": c.skipped, "steps": c.steps,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def ddp_origin(out: Path, rank: int, world: int) -> dict:
    """DDP; the rank's own forward goes wrong before the all-reduce: a NaN loss on rank 1 at step 12, a
    x1000 loss on rank 0 at step 15. Every rank skips both; the events say where each started."""
    model = _model()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = GuardedOptimizer(torch.optim.AdamW(ddp_model.parameters(), lr=3e-3), ddp_model, verbose=False,
                           log_dir=out / "logs", log_every=5, ddp_origin_hook=True)
    data = MarkovData(vocab_size=32, seed=rank)
    for step in range(20):
        x, y = data.batch(8, 16)
        loss = torch.nn.functional.cross_entropy(ddp_model(x).reshape(-1, 32), y.reshape(-1))
        if step == 12 and rank == 1:
            loss = loss * float("nan")
        if step == 15 and rank == 0:
            loss = loss * 1000.0
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    c = opt.counters
    return {"rank": rank, "digest": _digest(model), "skipped": c.skipped, "spikes": c.spikes,
            "nonfinite": c.nonfinite, "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def fsdp(out: Path, rank: int, world: int) -> dict:
    """FSDP2 (fully_shard) on CPU; x1000 in one layer at step 10; compared with an unsharded replica."""
    from torch.distributed.fsdp import fully_shard

    sharded = _model()
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    reference = _model()  # same init, unsharded, local to this rank
    opt = GuardedOptimizer(torch.optim.AdamW(sharded.parameters(), lr=3e-3), sharded, verbose=False,
                           log_dir=out / "logs", log_every=5)
    ref_opt = GuardedOptimizer(torch.optim.AdamW(reference.parameters(), lr=3e-3), reference, verbose=False,
                               log_dir=None, sync_ranks=False)
    data = MarkovData(vocab_size=32, seed=0)  # the same batch on every rank: the mean gradient is the local one
    found = {}
    for step in range(14):
        x, y = data.batch(8, 16)
        for name, m, o in (("fsdp", sharded, opt), ("ref", reference, ref_opt)):
            loss = m.loss(x, y)
            loss.backward()
            if step == 10:
                scale_grad(m.blocks[1].attn.qkv, 1000.0)
            before = o.counters.spikes
            o.step(loss=loss)
            if o.counters.spikes > before:
                st = o.last_stats
                names = list(o.param_index.layer_names)
                i = max(range(len(names)), key=lambda j: st.values[j] / max(o._detector.ema[j], 1e-30))
                found[name] = {"step": step, "layer": names[i], "norm": st.values[i],
                               "global": st.global_norm, "loss": st.loss}
            o.zero_grad()
    opt.close()
    ref_opt.close()
    layer_norms = {n: v for n, v in zip(opt.param_index.layer_names, opt.last_stats.values)}
    ref_norms = {n: v for n, v in zip(ref_opt.param_index.layer_names, ref_opt.last_stats.values)}
    return {"rank": rank, "found": found, "spikes": opt.counters.spikes, "ref_spikes": ref_opt.counters.spikes,
            "layer_norms": layer_norms, "ref_layer_norms": ref_norms, "run_id": opt.run_id}


def ddp_accumulation(out: Path, rank: int, world: int) -> dict:
    """DDP with gradient accumulation x2 under no_sync; a bad micro-batch on rank 1 at step 12."""
    model = _model()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = GuardedOptimizer(torch.optim.AdamW(ddp_model.parameters(), lr=3e-3), ddp_model, verbose=False,
                           log_dir=None)
    data = MarkovData(vocab_size=32, seed=rank)
    for step in range(16):
        for micro in range(2):
            x, y = data.batch(8, 16)
            ctx = ddp_model.no_sync() if micro == 0 else torch.enable_grad()
            with ctx:
                loss = torch.nn.functional.cross_entropy(ddp_model(x).reshape(-1, 32), y.reshape(-1)) / 2
                if step == 12 and rank == 1 and micro == 0:
                    loss = loss * 1e4  # a bad batch on one rank, accumulated locally before the all-reduce
                loss.backward()
        opt.step()
        opt.zero_grad()
    c = opt.counters
    return {"rank": rank, "digest": _digest(model), "spikes": c.spikes, "skipped": c.skipped, "steps": c.steps}


def zero_resume(out: Path, rank: int, world: int) -> dict:
    """A guarded ZeroRedundancyOptimizer checkpoint loads into a new guard: its load took a backup with
    state_dict(), which ZeRO refuses before consolidate_state_dict() (an outside hunt)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build():
        model = _model()
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
        return model, GuardedOptimizer(zero, model, verbose=False, log_dir=None, nan_action="rollback")

    data = MarkovData(vocab_size=32, seed=0)
    batches = [data.batch(8, 16) for _ in range(12)]

    def train(model, opt, part):
        for x, y in part:
            torch.nn.functional.cross_entropy(model(x).reshape(-1, 32), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, batches[:6])
    opt.consolidate_state_dict(0)
    ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": copy.deepcopy(opt.state_dict())}
    train(model, opt, batches[6:])
    model2, opt2 = build()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    train(model2, opt2, batches[6:])
    return {"rank": rank, "same": _digest(model) == _digest(model2), "steps": opt2.counters.steps}


SCENARIOS = {
    "zero_resume": zero_resume,
    "ddp_accum": ddp_accumulation,
    "ddp": ddp,
    "ddp_nosync": lambda out, rank, world: ddp(out, rank, world, sync_ranks=False),
    "ddp_allranks": lambda out, rank, world: ddp(out, rank, world, log_ranks="all"),
    "fsdp": fsdp,
    "ddp_origin": ddp_origin,
}


def run(rank: int, world: int, scenario: str, out: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    result = SCENARIOS[scenario](Path(out), rank, world)
    Path(out, f"{scenario}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # nobody tears the group down while another rank still uses it
    dist.destroy_process_group()
    # Skip interpreter teardown (results written, group destroyed), under mp.spawn and torchrun alike:
    # gloo's exit-time destructors sometimes aborted a worker ("terminate called without an active
    # exception"), as in hf_dist_worker.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # torchrun entry point
    scenario, out = sys.argv[1], sys.argv[2]
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), scenario, out, "env://")
