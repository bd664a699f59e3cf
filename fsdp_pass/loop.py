"""The whole training loop around the step, as a real run needs it: gradient accumulation, clipping by the
global norm, a learning-rate schedule, sharded checkpoints, and resuming, at any world size.

    torchrun --standalone --nproc_per_node=2 -m fsdp_pass.loop --steps 8 --save-every 4 --checkpoint-dir ckpt
    torchrun --standalone --nproc_per_node=1 -m fsdp_pass.loop --steps 12 --save-every 4 --checkpoint-dir ckpt

The second command finds ``ckpt/step-00000008`` (written by 2 ranks), loads it at world size 1 and goes on
from step 8. Each step:

1. The global batch of the step (the same whatever the world size) is cut into one slice per rank, and
   each slice into ``--accumulate`` micro-batches. All but the last run under ``no_sync`` (gradients
   summed locally, no reduce-scatter); the last one reduce-scatters the sum.
2. ``fsdp_pass.clip_grad_norm_``: the whole model's gradient norm from the shards, the same on every rank.
3. The optimizer and the schedule step; every ``--save-every`` steps ``fsdp_pass.save_checkpoint`` writes
   the shards and the optimizer state (torch.distributed.checkpoint) with the schedule's state.

The losses do not depend on the world size (the global batch and its order are the same), so a run
resumed at another world size goes on with the losses of the run that saved it (float32 sums in another
order aside).
"""

from __future__ import annotations

import argparse
import contextlib
import os

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from fsdp_pass.api import no_sync
from fsdp_pass.errors import check
from fsdp_pass.models.tiny_lm import TinyLM, counting_batch
from fsdp_pass.models.zoo import WithLoss
from fsdp_pass.train.distributed_checkpoint import load_checkpoint, save_checkpoint
from fsdp_pass.train.grad_norm import clip_grad_norm_
from fsdp_pass.transform import FSDP

VOCAB, SEQ = 64, 32


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3", choices=["zero2", "zero3"])
    parser.add_argument("--steps", type=int, default=8, help="train until this many optimizer steps are done")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, over all ranks")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per rank per step")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip gradients to this global norm")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default=None, help="save here, and resume from the newest checkpoint")
    parser.add_argument("--save-every", type=int, default=4)
    return parser.parse_args(argv)


def warmup_then_constant(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def train(args, say=print) -> dict[int, float]:
    """Run the loop on an initialized process group; returns {step: mean loss over ranks}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = args.global_batch // world
    check(
        args.global_batch % (world * args.accumulate) == 0,
        f"A global batch of {args.global_batch} does not split into {world} ranks x {args.accumulate} micro-batches.",
        "Pick --global-batch a multiple of world size x --accumulate.",
    )
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    torch.manual_seed(0)
    model = WithLoss(TinyLM(vocab=VOCAB, n_layer=args.layers, block_size=SEQ)).to(device)
    jm = thunder.jit(model, transforms=[FSDP(args.strategy)], executors=executors_for(device))
    opt = torch.optim.AdamW(jm.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_constant)

    start = 0
    resumed = load_checkpoint(args.checkpoint_dir, jm, opt) if args.checkpoint_dir else None
    if resumed is not None:
        schedule.load_state_dict(resumed.extra["schedule"])
        start = resumed.step
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        say(f"resumed from {resumed.path} (saved by {resumed.extra['world_size']} ranks) at step {start}, on {ranks}")

    losses = {}
    for step in range(start, args.steps):
        x, y = counting_batch(args.global_batch, SEQ, VOCAB, step)
        x, y = (t[rank * per_rank : (rank + 1) * per_rank].to(device) for t in (x, y))
        total = torch.zeros((), device=device)
        for i, (xm, ym) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
            last = i == args.accumulate - 1
            with contextlib.nullcontext() if last else no_sync(jm):
                loss = jm(xm, ym) / args.accumulate
                loss.backward()
            total += loss.detach()
        norm = clip_grad_norm_(jm, args.max_norm)
        opt.step()
        schedule.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses[step] = float(total) / world
        say(f"step {step:3d}  loss {losses[step]:.6f}  grad norm {float(norm):.4f}  lr {schedule.get_last_lr()[0]:.2e}")
        if args.checkpoint_dir and (step + 1) % args.save_every == 0:
            extra = {"schedule": schedule.state_dict(), "world_size": world}
            path = save_checkpoint(args.checkpoint_dir, jm, opt, step=step + 1, extra=extra, keep=2)
            say(f"saved {path}")
    return losses


def main(argv=None):
    args = arguments(argv)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train(args, say=print if dist.get_rank() == 0 else (lambda *a, **k: None))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
