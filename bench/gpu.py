"""Benchmark on one GPU: ms/step and peak memory of each system training the same Llama-style model.

    python -m bench.gpu --device cuda --world 1 [--layers 8 --d 2048 --seq 2048 --batch 2] [--dtype bfloat16]
    python -m bench.gpu --device cuda --world 2 --layers 4 --d 1024 --seq 1024     # gloo, two ranks, one GPU
    python -m bench.gpu --device cpu --world 2 --layers 2 --d 64 --seq 32 --vocab 256 # the same code path on CPU
    python -m bench.gpu --device cuda --world 1 --only "ours zero3,ours zero2,ours auto,ours auto probed"
    python -m bench.gpu --device cpu --world 1 --layers 8 --d 512 --hidden 1376 --heads 8 --vocab 8000 --seq 256 \
        --batch 1 --fusion torchcompile      # memory on CPU, with the lowering fused as on a GPU

World 1 runs one process on NCCL. World 2 runs two processes on the same GPU joined by gloo with CUDA
tensors: gloo copies each collective through the host, so its times say little about speed; the
memory, the collectives and the losses hold. Systems (``--only`` picks some, comma-separated):

  eager           plain PyTorch (world 2: DDP)
  compile         torch.compile of the model (world 2: DDP)
  fsdp2           fully_shard on each decoder layer, then the root
  fsdp2+compile   the same, each decoder layer torch.compile'd
  thunder         thunder.jit, no FSDP (world 2: gradients all-reduced and averaged after the backward)
  ours zero3/zero2  thunder.jit with fsdp_pass.FSDP
  ours zero3/zero2 merged  the same with units=BySize(1 MiB): consecutive decoder layers merged into units of
                  up to 1 MiB, so a model of tiny layers issues a few larger collectives, not one per layer
  ours auto       FSDP("auto"): units, resharding and prefetch planned from the device's default cost inputs
                  (h100-nvlink on CUDA), within the device's memory
  ours auto probed  the same, planned from a probe of these ranks (fsdp_pass.plan.probe, the matmul in --dtype)

The Thunder rows run the executor list ``executor_choice(device)`` picks (``--fusion auto``), or
``--fusion torchcompile``: Thunder's torch.compile executor also on CPU, which fuses CPU tensors as it does
CUDA ones, so the fused lowering's memory can be measured without a GPU.

Per system: build from seed 0, ``--warmup`` steps (compiles), ``--steps`` timed steps (the device
synchronized around each; median), then one forward + backward under torch's profiler: the share of the
communication kernels' time that a compute kernel overlapped (NCCL only: gloo has no kernels), and for our
rows the step's peak next to ``explain()``'s prediction, and the auto planner's step model on the row's plan
(``fsdp_pass.predict_step``: ``model ms`` and ``model peak``), priced from a probe of these ranks (``--cost
probe``, the default) or a default set: the README's "predicted vs measured" table, on a GPU.

On CUDA ``peak GiB`` is ``max_memory_allocated`` over the timed steps (parameters, gradients, optimizer
state, activations). On CPU, where no allocator keeps a peak, it is one more whole step (forward, backward,
AdamW) replayed from torch's profiler (``fsdp_pass.report.measure.allocated_during``): the most bytes the
step allocates above what lives before it, leaving out the process group's own scratch.
Rank 0 prints one table, ratios against the ``fsdp2`` row, and writes it to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_pass_executors import comm_ex, describe, executor_choice
from thunder.extend import get_executor

from bench.kernel_overlap import cuda_kernels, kernel_overlap
from bench.model import loss_fn, make_batch
from bench.systems_gpu import SYSTEMS, build_system
from fsdp_pass.models.zoo import Config, LlamaLM, param_count
from fsdp_pass.plan.cost_model import DEFAULTS
from fsdp_pass.plan.probe import probe
from fsdp_pass.report.measure import allocated_during
from fsdp_pass.report.text import format_table, human_bytes
from fsdp_pass.shard.groups import free_port


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--world", type=int, default=1, choices=[1, 2])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hidden", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fusion", default="auto", choices=["auto", "torchcompile"],
                   help="the Thunder rows' fusion executor: what executor_choice picks, or torchcompile")
    p.add_argument("--cost", default="probe", choices=["probe", *sorted(DEFAULTS)],
                   help="what the step model prices our rows with: a probe of these ranks, or a default set")
    p.add_argument("--only", default=None, help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--out", default=None,
                   help="also write the table to this file, and the explain() and step model of each row of "
                        "ours to OUT.plans.txt")
    return p.parse_args(argv)


def model_config(args) -> Config:
    return Config(vocab=args.vocab, d=args.d, n_head=args.heads, hidden=args.hidden, n_layer=args.layers,
                  seq=args.seq, local_batch=args.batch)


def thunder_executors(args, device) -> tuple[list, str]:
    """The executor list of the Thunder rows, and why."""
    if args.fusion == "auto":
        return executor_choice(device)
    attention = [get_executor("sdpa")] if device.type == "cuda" else []
    return [comm_ex, *attention, get_executor("torchcompile"), get_executor("torch")], "--fusion torchcompile"


class Costs:
    """The cost inputs of our rows: a probe of these ranks (collective: every rank asks at the same row, the
    first that needs it) measured once, and what the step model prices the plans with (``--cost``)."""

    def __init__(self, args, device):
        self.args, self.device, self._probed = args, device, None

    def probed(self):
        if self._probed is None:
            self._probed = probe(device=self.device, dtype=getattr(torch, self.args.dtype)).cost
        return self._probed

    def for_prices(self):
        return self.probed() if self.args.cost == "probe" else DEFAULTS[self.args.cost]

    def __str__(self) -> str:
        """What ``for_prices()`` gave, without measuring (rank 0 prints the table alone)."""
        if self.args.cost != "probe":
            return str(DEFAULTS[self.args.cost])
        return str(self._probed) if self._probed is not None else "none probed (no row of ours ran)"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(trainer, x, y):
    loss = loss_fn(trainer.module(x), y)
    loss.backward()
    trainer.after_backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _profiled_forward_backward(trainer, x, y, device) -> dict:
    """One forward + backward under the profiler (CUDA) and with the peak reset: kernel overlap, peak."""
    out = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with torch.profiler.profile(activities=activities) as prof:
        loss = loss_fn(trainer.module(x), y)
        loss.backward()
        trainer.after_backward()
        _sync(device)
    if device.type == "cuda":
        out["fwd_bwd_peak"] = torch.cuda.max_memory_allocated(device)
        out["fwd_bwd_above"] = out["fwd_bwd_peak"] - before
        overlap = kernel_overlap(cuda_kernels(prof))
        out["overlap"] = overlap.share
        out["comm_kernels"] = overlap.communication_kernels
    trainer.optimizer.zero_grad(set_to_none=True)
    return out


def measure(name: str, args, device, costs: Costs) -> dict:
    cfg = model_config(args)
    dtype = getattr(torch, args.dtype)
    rank = dist.get_rank()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaLM(cfg).to(dtype)
    trainer = build_system(name, model, device, thunder_executors(args, device)[0], costs)
    batches = [make_batch(s, cfg.local_batch, cfg.seq, rank, cfg.vocab) for s in range(args.warmup + args.steps + 1)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    t0 = time.perf_counter()
    for x, y in batches[: args.warmup]:
        _step(trainer, x, y)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for x, y in batches[args.warmup : args.warmup + args.steps]:
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        loss = _step(trainer, x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
    res = {"name": name, "ms": statistics.median(times) * 1e3, "warmup_s": warmup_s, "loss": float(loss)}
    if device.type == "cuda":
        res["peak"] = torch.cuda.max_memory_allocated(device)
    else:
        x, y = batches[-1]
        res["peak"] = allocated_during(lambda: _step(trainer, x, y), device).peak_bytes
    res.update(_profiled_forward_backward(trainer, *batches[-1], device))
    res.update(trainer.predicted())
    return res


def table(results: list[dict], args, n_params: int, costs: str = "-") -> str:
    ref = next((r for r in results if r["name"] == "fsdp2" and "ms" in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["name"], f"error: {r['error']}", *[""] * 10))
            continue
        peak = r.get("peak")
        rows.append((
            r["name"],
            f"{r['ms']:.1f}",
            f"{r['ms'] / ref['ms']:.2f}" if ref else "-",
            human_bytes(peak) if peak else "-",
            f"{peak / ref['peak']:.2f}" if peak and ref and ref.get("peak") else "-",
            human_bytes(r["fwd_bwd_above"]) if "fwd_bwd_above" in r else "-",
            human_bytes(r["predicted_above"]) if "predicted_above" in r else "-",
            f"{r['model_ms']:.1f}" if "model_ms" in r else "-",
            human_bytes(r["model_peak" if args.device == "cuda" else "model_step_peak"]) if "model_ms" in r else "-",
            f"{100 * r['overlap']:.0f}% of {r['comm_kernels']}" if r.get("overlap") is not None else "-",
            f"{r['loss']:.4f}",
            f"{r['warmup_s']:.0f}",
        ))
    peak_col = "peak" if args.device == "cuda" else "step peak"
    cols = ("system", "ms/step", "x fsdp2", peak_col, "x fsdp2", "fwd+bwd", "predicted", "model ms",
            f"model {peak_col}", "comm overlapped", "loss", "warm-up s")
    head = (f"bench.gpu: {args.device} world {args.world} ({dist.get_backend()}), {args.dtype}, Llama-style "
            f"{args.layers} layers d {args.d} hidden {args.hidden} vocab {args.vocab}, {n_params / 1e6:.0f} M "
            f"parameters, {args.batch} x {args.seq} tokens per rank; median of {args.steps} steps after "
            f"{args.warmup} warm-up; torch {torch.__version__}")
    if args.device == "cuda":
        head += f", {torch.cuda.get_device_name()}"
    executors, why = thunder_executors(args, torch.device(args.device))
    notes = [f"Thunder rows: executors {describe(executors)} ({why})"]
    if args.device == "cpu":
        notes.append("step peak: one whole step's allocations above what lived before it (profiler replay)")
    notes += ["fwd+bwd: forward + backward peak above what lived before it; predicted: explain()'s step peak",
              f"model ms, model {peak_col}: the auto planner's step model on the row's plan (fsdp_pass.predict_step), "
              f"cost inputs: {costs}",
             "comm overlapped: communication kernel time (NCCL) during which a compute kernel also ran"]
    return "\n".join([head, *format_table(cols, rows), *notes])


def rank_main(rank: int, world: int, port: int, args) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" and world == 1 else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(SYSTEMS)
    results, costs = [], Costs(args, device)
    for name in names:
        try:
            results.append(measure(name, args, device, costs))
        except Exception as e:  # noqa: BLE001 - the row says so and the run goes on
            traceback.print_exc()
            results.append({"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"})
        report = results[-1].pop("report", None)
        if rank == 0:
            print(f"[bench.gpu] {results[-1]}", file=sys.stderr, flush=True)
            if report and args.out:  # the row's plan: explain() and the step model's prediction
                with open(f"{args.out}.plans.txt", "a") as f:
                    f.write(f"=== {name}\n{report}\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        with torch.device("meta"):
            n_params = param_count(LlamaLM(model_config(args)))
        text = table(results, args, n_params, str(costs))
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    port = free_port()
    if args.world == 1:
        rank_main(0, 1, port, args)
    else:
        mp.start_processes(rank_main, args=(args.world, port, args), nprocs=args.world, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
