"""Benchmark on one GPU: ms/step and peak memory of each system training the same Llama-style model.

    python -m bench.gpu --device cuda --world 1 [--layers 8 --d 2048 --seq 2048 --batch 2] [--dtype bfloat16]
    python -m bench.gpu --device cuda --world 1 --model hf:bench/configs/llama-1b --recipe \
        --only "fsdp2,fsdp2+compile,ours zero3,ours zero2"   # the users' recipe: HF Llama 1.1 B, bf16, fp32 reduce
    python -m bench.gpu --device cuda --world 2 --layers 4 --d 1024 --seq 1024     # gloo, two ranks, one GPU
    python -m bench.gpu --device cpu --world 2 --layers 2 --d 64 --seq 32 --vocab 256 # the same code path on CPU
    python -m bench.gpu --device cuda --world 1 --only "ours zero3,ours zero2,ours auto,ours auto probed"
    python -m bench.gpu --device cpu --world 1 --layers 8 --d 512 --hidden 1376 --heads 8 --vocab 8000 --seq 256 \
        --batch 1 --fusion torchcompile      # memory on CPU, with the lowering fused as on a GPU

World 1 runs one process on NCCL. World 2 runs two processes on the same GPU joined by gloo with CUDA
tensors: gloo copies each collective through the host, so its times say little about speed; the
memory, the collectives and the losses hold.

The model (:mod:`bench.workload`): ``--model zoo`` (the default), the zoo's Llama-style LM shaped by ``--layers
--d --heads --hidden --vocab``; or ``--model hf:<config.json or folder>``, a Hugging Face causal LM built from its
config (``use_cache=False``, fed ``input_ids`` and ``labels``, returning its loss; ``--layers`` and ``--vocab``
override the config's), its decoder layers (``model.model.layers``) FSDP2's units. Either is built on the device
from seed 0 in float32. The dtype policy (:mod:`bench.precision`): float32; ``--dtype bfloat16``, the whole model
cast to bfloat16 (no float32 master weights); or ``--recipe``, the users' recipe: float32 master weights,
bfloat16 compute and a float32 reduce (ours ``MixedPrecision(bfloat16, reduce_dtype=float32)``, FSDP2
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; the rows without FSDP under
``torch.autocast(bfloat16)``). ``--checkpoint-activations`` recomputes each decoder layer in the backward (ours
``FSDP(checkpoint_activations=True)``, the others ``checkpoint_wrapper`` on each decoder layer).

Systems (``--only`` picks some, comma-separated):

  eager           plain PyTorch (world 2: DDP)
  compile         torch.compile of the model (world 2: DDP)
  fsdp2           fully_shard on each decoder layer, then the root
  fsdp2+compile   the same, each decoder layer torch.compile'd
  thunder         thunder.jit, no FSDP (world 2: gradients all-reduced and averaged after the backward)
  ours zero3/zero2  thunder.jit with fsdp_pass.FSDP
  ours zero3/zero2 merged  the same with units=BySize(1 MiB): consecutive decoder layers merged into units of
                  up to 1 MiB, so a model of tiny layers issues a few larger collectives, not one per layer
                  (``ours zero3 merged 512KiB``, ``... 4MiB``: other sizes)
  ours zero3 resharded  units="blocks" and reshard_after_forward=True: the last unit too is gathered again in
                  the backward (by default it stays gathered from the forward)
  ours zero3/zero2 default  ``units=`` left out: the step model chooses the units for the device's default cost
                  inputs (:mod:`fsdp_pass.search.default_units`)
  ours auto       FSDP("auto"): units, resharding and prefetch planned from the device's default cost inputs
                  (h100-nvlink on CUDA), within the device's memory
  ours auto probed  the same, planned from a probe of these ranks (fsdp_pass.cost.probe, the matmul in --dtype)
  ours zero3 int8/float8  with --recipe: the default units, parameters gathered as 8-bit codes with block scales
                  (MixedPrecision(bfloat16, float32, gather_dtype=torch.int8 | torch.float8_e4m3fn))

The Thunder rows run the executor list ``executor_choice(device)`` picks (``--fusion auto``), or
``--fusion torchcompile``: Thunder's torch.compile executor also on CPU, which fuses CPU tensors as it does
CUDA ones, so the fused lowering's memory can be measured without a GPU (attention on the device's attention
executor, as in ``executor_choice``'s list: Thunder's sdpa on CUDA, cpu_attention on CPU).

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
Rank 0 prints one table, ratios against the ``fsdp2`` row (and each loss's relative difference to its), headed
by the model, the dtype policy and the command, and writes it to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_pass_executors import comm_ex, describe, executor_choice
from fsdp_pass_executors.cpu_attention import cpu_attention_ex
from thunder.extend import get_executor

from bench.kernel_overlap import cuda_kernels, kernel_overlap
from bench.precision import AUTOCAST_ROWS, RECIPE_NOTE, Precision
from bench.systems_gpu import SYSTEMS, Setup, build_system
from bench.workload import ZOO, Workload
from fsdp_pass.cost.cost_model import DEFAULTS
from fsdp_pass.cost.probe import probe
from fsdp_pass.report.measure import allocated_during
from fsdp_pass.text import format_table, human_bytes
from fsdp_pass.ranks import free_port


def parse_args(argv=None):
    """The options, with ``args.workload`` (the model, built on meta to count it), ``args.precision`` (the dtype
    policy) and ``args.argv`` (the command line, for the table's header) added."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--world", type=int, default=1, choices=[1, 2])
    p.add_argument("--model", default=ZOO, help="zoo (the Llama-style LM below) or hf:<config.json or folder>")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (zoo: 8; hf: the config's)")
    p.add_argument("--d", type=int, default=None, help="zoo model width (2048)")
    p.add_argument("--heads", type=int, default=None, help="zoo model heads (16)")
    p.add_argument("--hidden", type=int, default=None, help="zoo model MLP width (5632)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (zoo: 32000; hf: the config's)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's dtype: bfloat16 casts the whole model (no float32 master weights)")
    p.add_argument("--recipe", action="store_true",
                   help="the users' recipe: float32 master weights, bfloat16 compute, float32 reduce (ours "
                        "MixedPrecision, FSDP2 MixedPrecisionPolicy; eager/compile/thunder under autocast)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each decoder layer in the backward (ours checkpoint_activations=True, the "
                        "others checkpoint_wrapper)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fusion", default="auto", choices=["auto", "torchcompile"],
                   help="the Thunder rows' fusion executor: what executor_choice picks, or torchcompile")
    p.add_argument("--cost", default="probe", choices=["probe", *sorted(DEFAULTS)],
                   help="what the step model prices our rows with: a probe of these ranks, or a default set")
    p.add_argument("--only", default=None, help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--kernels", type=int, default=0,
                   help="also write the profiled forward + backward's N costliest kernels (device time) and its "
                        "forward and backward times to OUT.kernels.txt, per row (with --out)")
    p.add_argument("--out", default=None,
                   help="also write the table to this file, and the explain() and step model of each row of "
                        "ours to OUT.plans.txt")
    args = p.parse_args(argv)
    if args.recipe and args.dtype != "float32":
        p.error("--recipe keeps float32 master weights and computes in bfloat16; leave out --dtype")
    try:
        args.workload = Workload.of(args.model, seq=args.seq, batch=args.batch, float_loss=args.recipe,
                                    layers=args.layers, d=args.d, heads=args.heads, hidden=args.hidden,
                                    vocab=args.vocab)
    except ValueError as e:
        p.error(str(e))
    args.precision = Precision.of(args.dtype, args.recipe)
    args.argv = argv
    return args


def thunder_executors(args, device) -> tuple[list, str]:
    """The executor list of the Thunder rows, and why."""
    if args.fusion == "auto":
        return executor_choice(device)
    attention = [get_executor("sdpa") if device.type == "cuda" else cpu_attention_ex]  # as executor_choice's
    return [comm_ex, *attention, get_executor("torchcompile"), get_executor("torch")], "--fusion torchcompile"


class Costs:
    """The cost inputs of our rows: a probe of these ranks (collective: every rank asks at the same row, the
    first that needs it) measured once, and what the step model prices the plans with (``--cost``)."""

    def __init__(self, args, device):
        self.args, self.device, self._probed = args, device, None

    def probed(self):
        if self._probed is None:
            self._probed = probe(device=self.device, dtype=self.args.precision.compute_dtype).cost
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


def _step(trainer, workload, batch):
    loss = trainer.loss(workload, batch)
    loss.backward()
    trainer.after_backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _profiled_forward_backward(trainer, workload, batch, device, kernels: int = 0) -> dict:
    """One forward + backward under the profiler (CUDA) and with the peak reset: kernel overlap, peak; with
    ``kernels``, the forward's and backward's times (synchronized) and the costliest kernels (``kernels_text``)."""
    out = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        loss = trainer.loss(workload, batch)
        if kernels:
            _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        trainer.after_backward()
        _sync(device)
        t2 = time.perf_counter()
    if kernels:
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        out["kernels_text"] = (f"forward {1e3 * (t1 - t0):.1f} ms, backward {1e3 * (t2 - t1):.1f} ms (under the "
                               f"profiler, synchronized)\n"
                               + prof.key_averages().table(sort_by=sort, row_limit=kernels, max_name_column_width=90))
    if device.type == "cuda":
        out["fwd_bwd_peak"] = torch.cuda.max_memory_allocated(device)
        out["fwd_bwd_above"] = out["fwd_bwd_peak"] - before
        overlap = kernel_overlap(cuda_kernels(prof))
        out["overlap"] = overlap.share
        out["comm_kernels"] = overlap.communication_kernels
    trainer.optimizer.zero_grad(set_to_none=True)
    return out


def measure(name: str, args, device, costs: Costs) -> dict:
    workload, precision = args.workload, args.precision
    model = workload.build(device).to(precision.model_dtype)
    setup = Setup(precision, args.checkpoint_activations, workload.decoder_layers)
    trainer = build_system(name, model, device, thunder_executors(args, device)[0], costs, setup)
    batches = workload.batches(args.warmup + args.steps + 1, dist.get_rank(), device)
    t0 = time.perf_counter()
    for batch in batches[: args.warmup]:
        _step(trainer, workload, batch)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for batch in batches[args.warmup : args.warmup + args.steps]:
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        loss = _step(trainer, workload, batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    res = {"name": name, "ms": statistics.median(times) * 1e3, "warmup_s": warmup_s, "loss": float(loss)}
    if device.type == "cuda":
        res["peak"] = torch.cuda.max_memory_allocated(device)
    else:
        res["peak"] = allocated_during(lambda: _step(trainer, workload, batches[-1]), device).peak_bytes
    res.update(_profiled_forward_backward(trainer, workload, batches[-1], device, args.kernels))
    res.update(trainer.predicted())
    return res


def _loss_vs(loss: float, ref: dict | None) -> str:
    """The loss's relative difference to the fsdp2 row's: what says ours and FSDP2 trained the same."""
    return f"{(loss - ref['loss']) / abs(ref['loss']):+.1e}" if ref and ref["loss"] else "-"


def table(results: list[dict], args, costs: str = "-", backend: str = "-") -> str:
    ref = next((r for r in results if r["name"] == "fsdp2" and "ms" in r), None)
    rows = []
    for r in results:
        if "error" in r:  # the row says so; the message is a note under the table
            rows.append((r["name"], "error", *[""] * 11))
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
            f"{r['loss']:.5f}",
            _loss_vs(r["loss"], ref),
            f"{r['warmup_s']:.0f}",
        ))
    peak_col = "peak" if args.device == "cuda" else "step peak"
    cols = ("system", "ms/step", "x fsdp2", peak_col, "x fsdp2", "fwd+bwd", "predicted", "model ms",
            f"model {peak_col}", "comm overlapped", "loss", "vs fsdp2", "warm-up s")
    head = (f"bench.gpu: {args.device} world {args.world} ({backend}); {args.workload.describe()}; "
            f"{args.batch} x {args.seq} tokens per rank; median of {args.steps} steps after {args.warmup} warm-up; "
            f"torch {torch.__version__}")
    if args.device == "cuda":
        head += f", {torch.cuda.get_device_name()}"
    policy = f"dtype policy: {args.precision.describe()}"
    if args.checkpoint_activations:
        policy += "; activation checkpointing on each decoder layer"
    command = f"command: python -m bench.gpu {shlex.join(args.argv)}"
    executors, why = thunder_executors(args, torch.device(args.device))
    notes = [f"Thunder rows: executors {describe(executors)} ({why})"]
    if args.precision.is_recipe and any(r["name"] in AUTOCAST_ROWS for r in results):
        notes.append(RECIPE_NOTE)
    if args.checkpoint_activations:
        notes.append("checkpointing: ours FSDP(checkpoint_activations=True); the other rows checkpoint_wrapper "
                     "(torch.utils.checkpoint, non-reentrant) on each decoder layer")
    if args.device == "cpu":
        notes.append("step peak: one whole step's allocations above what lived before it (profiler replay)")
    notes += ["fwd+bwd: forward + backward peak above what lived before it; predicted: explain()'s step peak",
              f"model ms, model {peak_col}: the auto planner's step model on the row's plan (fsdp_pass.predict_step), "
              f"cost inputs: {costs}",
              "comm overlapped: communication kernel time (NCCL) during which a compute kernel also ran",
              "loss: rank 0's loss at the last timed step; vs fsdp2: its relative difference to the fsdp2 row's"]
    errors = [f"{r['name']}: {r['error']}" for r in results if "error" in r]
    return "\n".join([head, policy, command, *format_table(cols, rows), *errors, *notes])


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
            results.append({"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        report = results[-1].pop("report", None)
        kernels = results[-1].pop("kernels_text", None)
        if rank == 0 and kernels and args.out:
            with open(f"{args.out}.kernels.txt", "a") as f:
                f.write(f"=== {name}\n{kernels}\n")
        if rank == 0:
            print(f"[bench.gpu] {results[-1]}", file=sys.stderr, flush=True)
            if report and args.out:  # the row's plan: explain() and the step model's prediction
                with open(f"{args.out}.plans.txt", "a") as f:
                    f.write(f"=== {name}\n{report}\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        text = table(results, args, str(costs), dist.get_backend())
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
