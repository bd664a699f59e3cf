"""Benchmark FSDP/DDP systems training the same model on the same batches: 2 gloo ranks on CPU.

    .venv/bin/python -m bench.run [--steps K] [--warmup W] [--layers L] [--world N] [--rounds R] [--only a,b]

One invocation spawns N ranks (torch.multiprocessing, spawn; one CPU thread per rank). For each
system, every rank builds the model from seed 0, wraps it, then:

  1. first step, timed (includes Thunder's compile for Thunder-based systems);
  2. W warm-up steps;
  3. K timed steps, a barrier before each; a step's time is the slowest rank's, the table shows
     the median over the K steps;
  4. one more step under the profiler: the collectives it issued and the bytes each rank sent
     (:mod:`bench.collectives`).

With ``--rounds R`` the whole sequence runs R times (systems rebuilt each round) and each row shows
the medians over the rounds: the load of a shared 2-core host drifts over minutes, and a system
measured once can land in a slow minute. Rank 0 prints one table.

A system that fails (on build, compile or a step) prints its traceback on
the failing rank and gets an ``error: ...`` row; the run goes on with the next system.

Columns:
  step ms        median step time (slowest rank per step); with rounds, the median of the rounds'
  spread         lowest-highest step ms over the rounds
  x fsdp2        step time / the ``fsdp2`` row's
  colls          collectives per step per rank, and the breakdown (AG all-gather, RS reduce-scatter,
                 AR all-reduce)
  MB/rank        MB (1e6 bytes) each rank sends per step, ring model: AG/RS of a full buffer of S
                 bytes cost (N-1)/N*S, AR 2(N-1)/N*S
  /Z2 floor      MB/rank divided by the ZeRO-2 floor 2(N-1)/N*P*4 bytes (P parameters, fp32) for
                 every row; a ZeRO-3 system's own floor is 1.5 on this scale, DDP's is 1.0
  gloo ms        in the profiled step, the wall time during which at least one collective was
                 running in a gloo worker thread (includes waiting for the peer and the profiler's
                 overhead; overlaps compute where a system overlaps communication)
  wait ms        per timed step, the host time the slowest rank spent blocked in ``fsdp_wait`` (the
                 collectives compute did not hide); only for systems whose collectives run on
                 fsdp_pass_executors' ``fsdp_comm`` ("—" for the others)
  first s        time of the first step (compile included)
  loss           mean over ranks of the loss at the last timed step (the same data and init for
                 every system, so sharded systems should agree with each other and with ddp)
  units          our rows: the plan's units, and how many of them reshard after forward (an auto row whose plan
                 differed between rounds lists each round's)
  peak unsharded MB  gathered parameters alive at once at most, read off the final traces (Thunder rows)
  model ms, model step peak MB  our rows: the auto planner's step model on the row's plan (``FSDP.predict_step``;
                 an auto row's own cost inputs, the ``cpu-gloo`` defaults for the others): its step time, and
                 its peak less what lives before the step, as ``step peak MB`` measures it
  replicate MB/rank  HSDP rows: of MB/rank, what the all-reduces over the replicate group send (what would
                 cross nodes); the rest runs in the shard groups
  step peak MB   rank 0, measured (``fsdp_pass.report.measure``): bytes a whole training step (forward,
                 backward, optimizer) allocates above what lives before it; the process group's own
                 scratch copies are not counted
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import pickle
import platform
import shlex
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_pass_executors import WAIT_CLOCK

from bench.collectives import CommsProfiler
from bench.model import Config, build_model, make_batch, param_count
from bench.peers import EXTRA_COLUMNS, all_systems, select
from fsdp_pass.op_names import ALL_REDUCE
from fsdp_pass.report.measure import allocated_during
from fsdp_pass.ranks import free_port

BYTES_PER_PARAM = 4  # fp32


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per system (K)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps after the first step (W)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--world", type=int, default=2, help="number of gloo ranks")
    p.add_argument(
        "--rounds", type=int, default=1, help="measure every system this many times, one after the other (R)"
    )
    p.add_argument(
        "--only", default=None, help="comma list of systems (a prefix such as 'ours' picks a family; =name just that one)"
    )
    p.add_argument("--list", action="store_true", help="list the systems and exit")
    p.add_argument("--gloo-timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    p.add_argument("--deadline", type=float, default=1800.0, help="kill all ranks after this many seconds")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.world < 1 or args.layers < 1 or args.rounds < 1:
        p.error("need --steps >= 1, --warmup >= 0, --world >= 1, --layers >= 1, --rounds >= 1")
    return args


def _quiet():
    warnings.filterwarnings("ignore", message=".*transformer_engine.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")


def _short_error(phase: str, exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    first = next((line.strip() for line in msg if line.strip()), "")
    if len(first) > 90:
        first = first[:87] + "..."
    return f"{phase}: {type(exc).__name__}: {first}" if first else f"{phase}: {type(exc).__name__}"


def _log(rank: int, text: str):
    if rank == 0:
        print(f"[bench] {text}", file=sys.stderr, flush=True)


class _PeerFailed(Exception):
    """Another rank failed in this phase; this rank stops the system too."""


class Coordinator:
    """Status and results travel through a TCPStore, not through gloo collectives.

    A rank that failed while its peer waits inside a collective must not answer with a different
    collective (that would mismatch and hang); the store has no such ordering. After a failure every
    rank replaces the world process group with a fresh one, so the next system starts clean.
    """

    def __init__(self, rank: int, world: int, port: int, args):
        self.rank, self.world, self.args = rank, world, args
        self.timeout = datetime.timedelta(seconds=args.gloo_timeout + 120)
        self.store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=self.timeout)
        self.generation = 0
        self._init_pg()

    def _init_pg(self):
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"pg{self.generation}/", self.store),
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=self.args.gloo_timeout),
        )

    def drop_pg(self):
        """Destroy this rank's process groups (all of them: the world and those systems created)."""
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()

    def fresh_pg(self):
        self.drop_pg()
        self.generation += 1
        self._init_pg()

    def exchange(self, key: str, value) -> list:
        """Every rank's ``value`` for ``key`` (blocks until all ranks have posted)."""
        self.store.set(f"{key}/{self.rank}", pickle.dumps(value))
        return [pickle.loads(self.store.get(f"{key}/{r}")) for r in range(self.world)]

    def agree(self, key: str, local_error: str | None) -> None:
        bad = [(r, e) for r, e in enumerate(self.exchange(key, local_error)) if e]
        if bad:
            rank, err = bad[0]
            raise _PeerFailed(f"{err} (rank {rank})")


def run_system(index: int, system, args, coord: Coordinator) -> dict:
    """Measure one system on this rank; every rank returns the merged result of all ranks.

    The ranks exchange their status (through the store) after the build and after the first step,
    and their results at the end; after any failure every rank starts the next system on a fresh
    process group. A failure that leaves a peer waiting inside a collective (a rank failing in the
    middle of a step) costs up to ``--gloo-timeout`` seconds: the peer's collective fails then (gloo
    neither aborts nor closes its connections on ``destroy_process_group``, only at process exit).
    """
    rank, world = coord.rank, coord.world
    cfg = Config(n_layer=args.layers)
    res: dict = {"name": system.name, "error": None}
    state = {"trainer": None, "step": 0}

    def batch():
        b = make_batch(state["step"], cfg.local_batch, cfg.seq, rank, cfg.vocab)
        state["step"] += 1
        return b

    def build():
        state["trainer"] = system.build(build_model(seed=0, n_layer=args.layers))

    def first_step():
        idx, tgt = batch()
        dist.barrier()
        t0 = time.perf_counter()
        state["trainer"].step(idx, tgt)
        res["first_s"] = time.perf_counter() - t0

    def measure():
        trainer = state["trainer"]
        for _ in range(args.warmup):
            idx, tgt = batch()
            dist.barrier()
            trainer.step(idx, tgt)
        times = []
        WAIT_CLOCK.reset()
        for _ in range(args.steps):
            idx, tgt = batch()
            dist.barrier()
            t0 = time.perf_counter()
            loss = trainer.step(idx, tgt)
            times.append(time.perf_counter() - t0)
        res["times"], res["loss"] = times, loss
        res["wait_ms"] = WAIT_CLOCK.seconds / args.steps * 1000 if WAIT_CLOCK.waits else None
        idx, tgt = batch()
        dist.barrier()
        with CommsProfiler(world, group_sizes=system.group_sizes(world)) as cp:
            trainer.step(idx, tgt)
        res["comms"] = cp.result.as_dict()
        res["extra"] = dict(system.extra_stats(trainer)) if system.extra_stats else {}
        if system.replicas > 1:  # HSDP: what crosses the replicate group (across nodes)
            res["extra"]["replicate MB/rank"] = f"{cp.result.kind_bytes(ALL_REDUCE) / 1e6:.3f}"
        idx, tgt = batch()
        dist.barrier()
        allocated = allocated_during(lambda: trainer.step(idx, tgt))
        res["extra"]["step peak MB"] = f"{allocated.peak_bytes / 1e6:.2f}"

    phases = (("build", build), ("first step", first_step), ("steps", measure))
    try:
        for phase, fn in phases:
            error = None
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - becomes the row's message, the run goes on
                tb = traceback.format_exc()
                print(f"----- rank {rank}: {system.name} failed in {phase} -----\n{tb}", file=sys.stderr, flush=True)
                error = res["error"] = _short_error(phase, e)
            if fn is not measure:
                coord.agree(f"sys{index}/{phase}", error)
            elif error:
                break
    except _PeerFailed as e:
        res["error"] = res["error"] or f"failed on another rank: {e}"
    finally:
        state.clear()
        gc.collect()

    merged = merge(coord.exchange(f"sys{index}/result", res))
    if merged["error"]:
        coord.fresh_pg()
    return merged


_CONSEQUENCES = ("failed on another rank", "Connection closed by peer", "Connection reset", "Timed out", "timed out")


def merge(per_rank: list[dict]) -> dict:
    errors = [(r, d["error"]) for r, d in enumerate(per_rank) if d["error"]]
    out = {"name": per_rank[0]["name"]}
    if errors:
        # the root cause first: not a rank that only saw its peer go away
        rank, err = min(errors, key=lambda re: (any(s in re[1] for s in _CONSEQUENCES), re[0]))
        same_everywhere = len({e for _, e in errors}) == 1 and len(errors) == len(per_rank)
        out["error"] = err if same_everywhere or "(rank " in err else f"{err} (rank {rank})"
        return out
    out["error"] = None
    steps = zip(*(d["times"] for d in per_rank))
    out["step_ms"] = statistics.median(max(s) for s in steps) * 1000
    out["first_s"] = max(d["first_s"] for d in per_rank)
    out["loss"] = sum(d["loss"] for d in per_rank) / len(per_rank)
    waits = [d["wait_ms"] for d in per_rank if d["wait_ms"] is not None]
    out["wait_ms"] = max(waits) if waits else None
    out["comms"] = per_rank[0]["comms"]
    same = all(d["comms"]["count"] == out["comms"]["count"] for d in per_rank)
    out["comms_note"] = "" if same else " (ranks differ!)"
    out["extra"] = per_rank[0]["extra"]
    return out


def over_rounds(per_round: list[dict]) -> dict:
    """One row from the rounds of a system: medians of the timings; the spread of the step time."""
    failed = next((r for r in per_round if r["error"]), None)
    if failed is not None:
        return failed
    out = dict(per_round[-1])
    steps = [r["step_ms"] for r in per_round]
    out["step_ms"] = statistics.median(steps)
    out["spread"] = f"{min(steps):.0f}-{max(steps):.0f}" if len(steps) > 1 else "—"
    out["first_s"] = statistics.median(r["first_s"] for r in per_round)
    waits = [r["wait_ms"] for r in per_round if r["wait_ms"] is not None]
    out["wait_ms"] = statistics.median(waits) if waits else None
    plans = list(dict.fromkeys((r.get("extra") or {}).get("units") for r in per_round))
    if len(plans) > 1:  # a plan made from a probe can differ between rounds: the row says so
        out["extra"] = dict(out["extra"], units=" | ".join(map(str, plans)))
    return out


# ------------------------------------------------------------------------------------------- output
def header(args, world: int) -> str:
    import thunder

    from bench.peers import thunder_executors

    cfg = Config(n_layer=args.layers)
    P = param_count(build_model(seed=0, n_layer=args.layers))
    floor = 2 * (world - 1) / world * P * BYTES_PER_PARAM
    try:
        execs = ", ".join(e.name for e in thunder_executors())
    except Exception as e:  # noqa: BLE001
        execs = f"? ({type(e).__name__})"
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable), "-m", "bench.run", *sys.argv[1:]])
    versions = f"torch {torch.__version__}, lightning-thunder {thunder.__version__}, python {platform.python_version()}"
    threads = f"{torch.get_num_threads()} thread(s) per rank"
    host = f"{os.cpu_count()} CPU core(s) on the host (load average {os.getloadavg()[0]:.2f} at start)"
    sizes = f"vocab {cfg.vocab}, d {cfg.d}, heads {cfg.n_head}, hidden {cfg.hidden}"
    params = f"P = {P:,} parameters (fp32, {P * BYTES_PER_PARAM / 1e6:.2f} MB)"
    steps = f"first step + {args.warmup} warm-up + {args.steps} timed (median) + 1 profiled (collectives)"
    if args.rounds > 1:
        steps += f", {args.rounds} rounds (medians over rounds)"
    lines = [
        f"command:  {cmd}",
        f"versions: {versions}",
        f"ranks:    {world} x gloo on CPU, {threads}, {host}",
        f"model:    Llama-style LM, {args.layers} layers, {sizes}; {params}",
        f"batch:    {cfg.local_batch} x {cfg.seq} tokens per rank; AdamW lr 1e-3",
        f"steps:    {steps}; Thunder executors: {execs}",
        f"floor:    ZeRO-2 floor 2(N-1)/N*P*4 B = {floor / 1e6:.3f} MB per rank per step (ZeRO-3 floor = 1.5x that)",
    ]
    return "\n".join(lines)


def table(results: list[dict], world: int, P: int, notes: list[str] = ()) -> str:
    floor = 2 * (world - 1) / world * P * BYTES_PER_PARAM
    ref = next((r for r in results if r["name"] == "fsdp2" and not r["error"]), None)
    extra_cols = list(EXTRA_COLUMNS)
    for r in results:
        for k in r.get("extra", {}) or {}:
            if k not in extra_cols:
                extra_cols.append(k)
    cols = ["system", "step ms", "spread", "x fsdp2", "colls", "breakdown", "MB/rank", "/Z2 floor", "gloo ms"]
    cols += ["wait ms", "first s", "loss"]
    cols += extra_cols
    rows = []
    for r in results:
        if r["error"]:
            rows.append([r["name"], f"error: {r['error']}"])
            continue
        c = r["comms"]
        mb = c["ring_bytes"] / 1e6
        unknown = f" ({c['unknown_size']} unsized)" if c["unknown_size"] else ""
        row = [
            r["name"],
            f"{r['step_ms']:.1f}",
            r.get("spread", "—"),
            f"{r['step_ms'] / ref['step_ms']:.2f}" if ref else "—",
            f"{c['total']}{r['comms_note']}",
            c["breakdown"] + unknown,
            f"{mb:.3f}",
            f"{c['ring_bytes'] / floor:.2f}" if floor else "—",
            f"{c['gloo_ms']:.1f}",
            f"{r['wait_ms']:.1f}" if r["wait_ms"] is not None else "—",
            f"{r['first_s']:.2f}",
            f"{r['loss']:.4f}",
        ]
        for k in extra_cols:
            v = (r.get("extra") or {}).get(k, "—")
            row.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        rows.append(row)
    widths = [len(c) for c in cols]
    widths[0] = max([widths[0]] + [len(r[0]) for r in rows])
    for row in rows:
        if len(row) == len(cols):
            widths = [max(w, len(v)) for w, v in zip(widths, row)]
    right = {i for i, c in enumerate(cols) if c not in ("system", "breakdown")}

    def fmt(row):
        if len(row) != len(cols):  # an error row: the name, then the message across the other columns
            return f"{row[0]:<{widths[0]}}  {row[1]}"
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))

    line = "-" * (sum(widths) + 2 * (len(widths) - 1))
    return "\n".join([fmt(cols), line, *(fmt(r) for r in rows), line, *(f"  {n}" for n in notes)])


# ---------------------------------------------------------------------------------------------- ranks
def rank_main(rank: int, world: int, port: int, args):
    _quiet()
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    coord = Coordinator(rank, world, port, args)
    try:
        systems = select(all_systems(), args.only)
        if rank == 0:
            print(header(args, world), flush=True)
        rounds: list[list[dict]] = [[] for _ in systems]
        for round_ in range(args.rounds):
            for i, s in enumerate(systems):
                t0 = time.perf_counter()
                r = run_system(round_ * len(systems) + i, s, args, coord)
                rounds[i].append(r)
                status = f"error: {r['error']}" if r["error"] else f"{r['step_ms']:.1f} ms/step"
                _log(rank, f"round {round_ + 1}/{args.rounds} {s.name}: {status} ({time.perf_counter() - t0:.1f} s)")
        results = [over_rounds(rs) for rs in rounds]
        if rank == 0:
            P = param_count(build_model(seed=0, n_layer=args.layers))
            print()
            notes = [s.note for s in systems if s.note]
            print(table(results, world, P, notes), flush=True)
        coord.exchange("done", True)  # rank 0 hosts the store: nobody leaves before everyone is done
    finally:
        coord.drop_pg()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in all_systems():
            print(s.name)
        return 0
    select(all_systems(), args.only)  # fail early on a bad --only
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the CPU-only host: no "gpuGetDeviceCount failed" lines
    port = free_port()
    t0 = time.perf_counter()
    ctx = mp.start_processes(
        rank_main, args=(args.world, port, args), nprocs=args.world, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=5):
            if time.perf_counter() - t0 > args.deadline:
                print(f"[bench] deadline of {args.deadline:.0f} s passed: killing the ranks", file=sys.stderr)
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return 1
    except mp.ProcessRaisedException as e:
        print(f"[bench] a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"[bench] a rank exited: {e}", file=sys.stderr)
        return 1
    print(f"[bench] total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
