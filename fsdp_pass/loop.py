"""The whole training loop around the step, as a real run needs it: a model on real text, mixed precision,
gradient accumulation, clipping by the global norm, a learning-rate schedule, validation, sharded checkpoints,
and resuming, at any world size.

    torchrun --standalone --nproc_per_node=2 -m fsdp_pass.loop --steps 8 --save-every 4 --checkpoint-dir ckpt
    torchrun --standalone --nproc_per_node=1 -m fsdp_pass.loop --steps 12 --save-every 4 --checkpoint-dir ckpt

The second command finds ``ckpt/step-00000008`` (written by 2 ranks), loads it at world size 1 and goes on
from step 8. A run:

1. The model is ``--model`` (a built-in config or ``hf:<config>``) with a byte vocabulary
   (:mod:`fsdp_pass.train.byte_model`), jitted with ``FSDP(--strategy, mixed_precision=MixedPrecision(
   --param-dtype, reduce_dtype=float32), checkpoint_activations=...)``; AdamW, a warm-up then a constant rate.
2. The text is ``--data`` (a file or a folder; by default the standard library's ``*.py``), read as bytes, its
   last ``--val-fraction`` held out (:mod:`fsdp_pass.train.text_data`).
3. Each step, the step's global batch, drawn from ``(--seed, step)`` alone and so the same at any world size,
   is cut into one slice per rank, and each slice into ``--accumulate`` micro-batches. All but the last run
   under ``no_sync`` (gradients summed locally, no reduce-scatter); the last one reduce-scatters the sum.
   ``fsdp_pass.clip_grad_norm_`` clips by the whole model's gradient norm; the optimizer and schedule step.
   With ``--param-dtype float16``, ``fsdp_pass.GradScaler`` scales the loss, and a step whose gradients
   overflowed on any rank is skipped on every rank.
4. At the run's first step, every ``--eval-every`` steps and after the last, the held-out loss of the
   parameters (the same windows each time, through the training step's forward: no second compile).
5. A progress line every ``--log-every`` steps (:mod:`fsdp_pass.train.progress`: loss, val loss, tokens/s,
   ms/step, on CUDA the MFU), a checkpoint every ``--save-every`` steps (``fsdp_pass.save_checkpoint``: the
   shards, the optimizer state, the schedule's state; the last 2 saved are kept), a summary at the end.
   ``--resume-step N`` goes back to step N's checkpoint instead of the newest (a rollback): its first save
   moves the checkpoints of the abandoned run to ``--checkpoint-dir``'s ``abandoned-K`` folder, and says so.

The losses do not depend on the world size (the global batch and its order are the same), so a run
resumed at another world size goes on with the losses of the run that saved it (float32 sums in another
order aside). A checkpoint also records what decides the batches (seed, global batch, sequence, data);
resuming with other values is an FSDPError.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from fsdp_pass.api import no_sync
from fsdp_pass.errors import check
from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.train.byte_model import byte_model
from fsdp_pass.train.distributed_checkpoint import CheckpointWarning, load_checkpoint, save_checkpoint
from fsdp_pass.train.grad_norm import clip_grad_norm_
from fsdp_pass.train.grad_scaler import GradScaler
from fsdp_pass.train.progress import LoopRun, Window, progress_line, summary_lines
from fsdp_pass.train.text_data import load_corpus, rank_slice, train_windows, val_windows
from fsdp_pass.train.throughput import model_flops, peak_flops
from fsdp_pass.transform import FSDP

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GATHER_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}  # MixedPrecision(gather_dtype=...)


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="bench",
                       help="a built-in config (tiny, bench, ...) or hf:<config.json or folder>")
    model.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    model.add_argument("--strategy", default="zero3", choices=["zero2", "zero3", "auto"])
    model.add_argument("--param-dtype", default="float32", choices=sorted(DTYPES),
                       help="gather and compute in this dtype; gradients reduced in float32")
    model.add_argument("--gather-dtype", default=None, choices=sorted(GATHER_DTYPES),
                       help="gather the parameters quantized to 8 bits (a float32 scale per 128 elements), "
                       "dequantized to --param-dtype")
    model.add_argument("--checkpoint-activations", action="store_true", help="recompute each unit in the backward")
    data = parser.add_argument_group("data")
    data.add_argument("--data", default=None, help="a text file or a folder of them (default: the stdlib's *.py)")
    data.add_argument("--val-fraction", type=float, default=0.05, help="the last part of the bytes, held out")
    data.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    data.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, over all ranks")
    data.add_argument("--accumulate", type=int, default=2, help="micro-batches per rank per step")
    data.add_argument("--seed", type=int, default=0, help="seeds the model's initialization and the batches")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=8, help="train until this many optimizer steps are done")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--warmup", type=int, default=4, help="steps of linear warm-up")
    train.add_argument("--max-norm", type=float, default=1.0, help="clip gradients to this global norm")
    train.add_argument("--eval-every", type=int, default=50, help="held-out loss every this many steps")
    train.add_argument("--eval-batches", type=int, default=2, help="global batches of held-out windows per evaluation")
    train.add_argument("--log-every", type=int, default=1, help="a progress line every this many steps")
    train.add_argument("--peak-tflops", type=float, default=None,
                       help="the device's matmul peak for the MFU (default: a table of GPUs; none on the CPU)")
    train.add_argument("--checkpoint-dir", default=None, help="save here, and resume from the newest checkpoint")
    train.add_argument("--save-every", type=int, default=4)
    train.add_argument("--resume-step", type=int, default=None,
                       help="resume from this step's checkpoint, not the newest (a rollback: the next save moves "
                       "the later checkpoints aside)")
    args = parser.parse_args(argv)
    for name in ("steps", "seq", "global_batch", "accumulate", "warmup", "eval_every", "eval_batches", "log_every",
                 "save_every"):
        check(getattr(args, name) >= 1, f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1.",
              f"Pass --{name.replace('_', '-')} 1 or more.")
    check(args.resume_step is None or args.checkpoint_dir, f"--resume-step {args.resume_step} without a checkpoint "
          "folder.", "Pass --checkpoint-dir, the folder that holds the checkpoint of that step.")
    return args


def warmup_then_constant(warmup: int):
    return lambda step: min(1.0, (step + 1) / warmup)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _batch_contract(args) -> dict:
    """What decides each step's batch: a resumed run must agree on it to go on with the same losses."""
    return {"seed": args.seed, "global_batch": args.global_batch, "seq": args.seq, "data": str(args.data),
            "val_fraction": args.val_fraction}


def _check_same_batches(saved: dict | None, args, path) -> None:
    now = _batch_contract(args)
    differ = {k: (saved[k], now[k]) for k in now if saved is not None and k in saved and saved[k] != now[k]}
    check(
        not differ,
        lambda: f"The checkpoint {path} was trained with other batches: "
        + ", ".join(f"{k} {was!r} then, {is_!r} now" for k, (was, is_) in differ.items()) + ".",
        "Resume with the values it was saved with, or pass another --checkpoint-dir to start afresh.",
    )


@contextlib.contextmanager
def checkpoint_notes(say):
    """What a save or a load did to the checkpoint folder besides the checkpoint (a ``CheckpointWarning`` on rank
    0: checkpoints set aside after a rollback, leftovers of interrupted saves), said as lines of the loop's
    output; other warnings go on as they would."""
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            yield
    finally:  # said also when the save or the load raised: a leftover named before a damaged checkpoint
        for w in caught:
            if issubclass(w.category, CheckpointWarning):
                say(f"checkpoint: {w.message}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _resume(args, jm, opt, schedule, scaler, say) -> int:
    """The step to start from: the newest checkpoint's in ``--checkpoint-dir`` (``--resume-step``'s), with the
    schedule's and the scaler's state; 0 without one."""
    with checkpoint_notes(say):
        resumed = load_checkpoint(args.checkpoint_dir, jm, opt, step=args.resume_step)
    if resumed is None:
        return 0
    _check_same_batches(resumed.extra.get("batches"), args, resumed.path)
    schedule.load_state_dict(resumed.extra["schedule"])
    if scaler.is_enabled() and resumed.extra.get("scaler"):
        scaler.load_state_dict(resumed.extra["scaler"])
    world = dist.get_world_size()
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    saved_by = resumed.extra["world_size"]
    say(f"resumed from {resumed.path} (saved by {saved_by} rank{'s' if saved_by > 1 else ''}) at step "
        f"{resumed.step}, on {ranks}")
    return resumed.step


def _micro_batches(windows: torch.Tensor, rank: int, world: int, accumulate: int, device) -> tuple:
    return rank_slice(windows, rank, world).to(device).chunk(accumulate)


def _mean_over_ranks(total: torch.Tensor, world: int) -> float:
    dist.all_reduce(total)
    return float(total) / world


def evaluate(model, jm, val: torch.Tensor, args, device) -> float:
    """The held-out loss: the mean over every window of ``val``, each rank its slice, in micro-batches of the
    training step's shape. It runs the training step's compiled forward, its result detached and no backward
    run: under ``torch.no_grad`` Thunder would compile (and hold) a second forward for the same numbers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = _micro_batches(val, rank, world, args.accumulate * args.eval_batches, device)
    total = torch.zeros((), device=device)
    for windows in micro:
        total += model.loss(jm, windows).detach().float() / len(micro)
    return _mean_over_ranks(total, world)


def train_step(model, jm, opt, schedule, scaler, windows: torch.Tensor, args, device) -> tuple[float, float, bool]:
    """One optimizer step on this rank's slice of ``windows`` (item 3 of the module's docstring): the loss
    averaged over ranks, the global gradient norm before clipping, and whether the step was skipped.
    ``scaler`` (``fsdp_pass.GradScaler``, enabled for float16 only) scales each micro-batch's loss and unscales
    the gradients before clipping; a step whose gradients overflowed on any rank's shard is skipped on every
    rank (the scaler backs off), and the schedule waits for the next step that is taken."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = _micro_batches(windows, rank, world, args.accumulate, device)
    total = torch.zeros((), device=device)
    for i, xm in enumerate(micro):
        with contextlib.nullcontext() if i == len(micro) - 1 else no_sync(jm):
            loss = model.loss(jm, xm) / len(micro)
            scaler.scale(loss).backward()
        total += loss.detach().float()
    scaler.unscale_(opt)
    norm = clip_grad_norm_(jm, args.max_norm)
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale
    if not skipped:
        schedule.step()
    opt.zero_grad()
    return _mean_over_ranks(total, world), float(norm), skipped


def _precision(args):
    dtype, gather = DTYPES[args.param_dtype], GATHER_DTYPES.get(args.gather_dtype)
    if dtype == torch.float32 and gather is None:
        return None
    return MixedPrecision(None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32, gather_dtype=gather)


def train(args, say=print) -> dict[int, float]:
    """Run the loop on an initialized process group; returns {step: mean loss over ranks}."""
    return run_training(args, say).losses


def run_training(args, say=print) -> LoopRun:
    """Run the loop on an initialized process group (items 1-5 of the module's docstring); returns what it
    measured: each step's loss and time, the validation losses, the tokens and FLOPs of a step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    check(
        args.global_batch % (world * args.accumulate) == 0,
        f"A global batch of {args.global_batch} does not split into {world} ranks x {args.accumulate} micro-batches.",
        "Pick --global-batch a multiple of world size x --accumulate.",
    )
    device = _device()
    corpus = load_corpus(args.data, args.val_fraction)
    val = val_windows(corpus, args.eval_batches * args.global_batch, args.seq)
    torch.manual_seed(args.seed)
    model = byte_model(args.model, device, layers=args.layers, seq=args.seq)
    fsdp = FSDP(args.strategy, mixed_precision=_precision(args), checkpoint_activations=args.checkpoint_activations)
    jm = thunder.jit(model.module, transforms=[fsdp], executors=executors_for(device))
    opt = torch.optim.AdamW(jm.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_constant(args.warmup))
    scaler = GradScaler(jm, enabled=DTYPES[args.param_dtype] == torch.float16)
    say(f"model {args.model}: {model.parameters():,} parameters, byte vocabulary; {args.strategy}, "
        f"{args.param_dtype}{f', gathered as {args.gather_dtype}' if args.gather_dtype else ''}"
        f"{', activation checkpointing' if args.checkpoint_activations else ''}; "
        f"world size {world} ({dist.get_backend()}, {device.type})")
    say(f"data: {corpus.describe()}; {args.global_batch} x {args.seq} bytes per step")

    start = _resume(args, jm, opt, schedule, scaler, say) if args.checkpoint_dir else 0
    peak = peak_flops(device, DTYPES[args.param_dtype], args.peak_tflops)
    run = LoopRun(tokens_per_step=args.global_batch * args.seq)
    window, began = Window(), time.perf_counter()
    for step in range(start, args.steps):
        val_loss = None
        if step == start or step % args.eval_every == 0:
            val_loss = run.val_losses[step] = evaluate(model, jm, val, args, device)
        t0 = time.perf_counter()
        windows = train_windows(corpus, args.global_batch, args.seq, args.seed, step)
        run.losses[step], norm, skipped = train_step(model, jm, opt, schedule, scaler, windows, args, device)
        run.seconds[step] = time.perf_counter() - t0
        if scaler.is_enabled():
            run.loss_scale = scaler.get_scale()
            run.skipped_steps += [step] if skipped else []
        if step == start:  # its evaluation and training step compiled the model
            run.first_step_seconds = time.perf_counter() - began
            run.flops_per_rank_step = args.accumulate * model_flops(thunder.last_traces(jm)[-1])
        window.add(run.seconds[step], run.tokens_per_step, run.flops_per_rank_step)
        if val_loss is not None or step % args.log_every == 0 or step == args.steps - 1:
            say(progress_line(step, run.losses[step], val_loss, norm, schedule.get_last_lr()[0], window, peak))
            window = Window()
        if args.checkpoint_dir and (step + 1) % args.save_every == 0:
            extra = {"schedule": schedule.state_dict(), "scaler": scaler.state_dict(), "world_size": world,
                     "batches": _batch_contract(args)}
            with checkpoint_notes(say):
                path = save_checkpoint(args.checkpoint_dir, jm, opt, step=step + 1, extra=extra, keep=2)
            say(f"saved {path}")
    if run.losses:
        run.val_losses[args.steps] = evaluate(model, jm, val, args, device)
        say(f"step {args.steps:4d}  val {run.val_losses[args.steps]:.4f}  (after the last step)")
    say("\n".join(summary_lines(run, peak)))
    return run


def main(argv=None):
    args = arguments(argv)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train(args, say=print if dist.get_rank() == 0 else (lambda *a, **k: None))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
