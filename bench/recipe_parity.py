"""The users' recipe side by side with FSDP2 on many model families: per-step losses of ours against
``fully_shard`` with the same ``MixedPrecisionPolicy``, on 2 gloo ranks, one table.

    python -m bench.recipe_parity                                  # the Hugging Face families below
    python -m bench.recipe_parity llama qwen2 litgpt:llama2-like    # some of them; litgpt:<name> needs litgpt
    python -m bench.recipe_parity --litgpt-path /tmp/litgpt         # every config of Thunder's litgpt tests

For each model (tiny, built from seed 0 in float32) and a strategy (ZeRO-3 and ZeRO-2 in turn), 2 ranks train three
copies for ``--steps`` AdamW steps on the same batches: ours with ``MixedPrecision(bfloat16, reduce_dtype=float32)``,
FSDP2 with ``MixedPrecisionPolicy(bfloat16, float32)`` (each decoder layer a unit, then the root), and FSDP2 in
float32. The table gives the worst relative difference of a step's mean loss to FSDP2's bfloat16 one, and, for
scale, FSDP2's bfloat16 against its float32: Thunder rounds its decomposed ops otherwise than eager torch does, so the
two recipes agree within bfloat16 rounding, not exactly (``tests/test_recipe_parity.py`` holds the exact check, a
one-process reference making the same casts).

``litgpt:<name>`` are the configurations of Thunder's own litgpt tests (``thunder/tests/litgpt_model.py``: gpt-neox,
llama 1 and 2, long context, falcon 7B and 40B, codellama, mixtral, scaled down), which import litgpt: it is not a
dependency of this project; ``--litgpt-path`` appends a folder where it is installed to ``sys.path`` (after the
project's own packages, so their versions win).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.distributed as dist

BF16 = torch.bfloat16
VOCAB = 256
HF_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "neox")


def build_hf(kind: str, layers: int = 1) -> torch.nn.Module:
    """A tiny Hugging Face causal LM of the family ``kind``, float32, seeded."""
    import transformers as hf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=128, use_cache=False)
    configs = {
        "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(common, num_key_value_heads=2)),  # GQA, rotary, RMSNorm
        "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, dict(common, num_key_value_heads=2)),  # + q/k/v biases
        "mistral": (hf.MistralConfig, hf.MistralForCausalLM, dict(common, num_key_value_heads=2)),
        # learned positions, LayerNorm, tied head; no dropout (Thunder draws other masks than eager torch)
        "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel,
                 dict(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=128, use_cache=False,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "neox": (hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, common),  # partial rotary, parallel residual
    }
    config_class, model_class, kwargs = configs[kind]
    torch.manual_seed(0)
    return model_class(config_class(**kwargs))


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM or a litgpt GPT: FSDP2's units."""
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2, litgpt
        return list(model.transformer.h)
    base = getattr(model, "model", None) or model.gpt_neox
    return list(base.layers)


class Model:
    """One model to compare: how to build it and compute a rank's loss on token ids."""

    def __init__(self, name: str, layers: int = 1):
        self.name, self.layers = name, layers
        self.litgpt = name.startswith("litgpt:")

    def build(self) -> torch.nn.Module:
        if not self.litgpt:
            return build_hf(self.name, self.layers)
        import thunder.tests.litgpt_model as litgpt_model

        torch.manual_seed(0)
        return litgpt_model.GPT(litgpt_model.Config.from_name(self.name.removeprefix("litgpt:")))

    def vocab(self, model) -> int:
        return model.config.padded_vocab_size if self.litgpt else VOCAB

    def loss(self, module, ids: torch.Tensor):
        """(loss, logits dtype) of ``module`` on ``ids`` (next-token prediction)."""
        if not self.litgpt:
            out = module(input_ids=ids, labels=ids)
            return out.loss, out.logits.dtype
        logits = module(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        return loss, logits.dtype


def fully_sharded(model, strategy: str, precision: bool):
    """``model`` under FSDP2 over every rank: each decoder layer a unit (resharded after forward under ZeRO-3),
    then the root; bfloat16 with a float32 reduce when ``precision``, else float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) if precision else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=strategy == "zero3")
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def compare(name: str, strategy: str, steps: int, litgpt_path: str | None) -> dict:
    """On every rank: per-step mean losses of ours, FSDP2 bf16 and FSDP2 float32; ours' compile seconds."""
    if litgpt_path:
        sys.path.append(litgpt_path)
    import thunder
    from fsdp_pass_executors import executors_for

    from fsdp_pass import FSDP, MixedPrecision

    spec = Model(name)
    model = spec.build()
    vocab = spec.vocab(model)
    peer, full = fully_sharded(copy.deepcopy(model), strategy, True), fully_sharded(copy.deepcopy(model), strategy, False)
    t0 = time.perf_counter()
    jm = thunder.jit(model, transforms=[FSDP(strategy, mixed_precision=MixedPrecision(BF16, reduce_dtype=torch.float32))],
                     executors=executors_for("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {"ours": jm, "fsdp2": peer, "fsdp2_fp32": full}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in runs.items()}
    losses, dtypes, compile_s = {k: [] for k in runs}, {}, None
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, vocab, (2 * world, 33), generator=g)[2 * rank:2 * rank + 2]
        for key, module in runs.items():
            loss, dtypes[key] = spec.loss(module, ids)
            loss.backward()
            optimizers[key].step()
            optimizers[key].zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[key].append(float(mean) / world)
            if key == "ours" and compile_s is None:
                compile_s = time.perf_counter() - t0
    return {"losses": losses, "dtypes": {k: str(v).removeprefix("torch.") for k, v in dtypes.items()},
            "compile_s": compile_s}


def _worst(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main(argv=None) -> int:
    from fsdp_pass.text import format_table
    from fsdp_pass.ranks import run_on_local_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help=f"{', '.join(HF_FAMILIES)}, or litgpt:<config name>")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--litgpt-path", default=None, help="a folder where litgpt is installed (appended to sys.path)")
    args = p.parse_args(argv)
    names = list(args.models)
    if not names:
        names = list(HF_FAMILIES)
        if args.litgpt_path:
            sys.path.append(args.litgpt_path)
            import thunder.tests.litgpt_model as litgpt_model

            names += [f"litgpt:{c['name']}" for c in litgpt_model.configs]
    rows, errors = [], []
    for i, name in enumerate(names):
        strategy = ("zero3", "zero2")[i % 2]
        try:
            r = run_on_local_ranks(compare, 2, name, strategy, args.steps, args.litgpt_path, timeout_s=900)[0]
        except Exception as e:  # noqa: BLE001 - the row says so and the table goes on
            errors.append(f"{name}: {str(e).strip().splitlines()[-1][:200]}")
            rows.append((name, strategy, "error (below)", "", "", "", ""))
            continue
        losses = r["losses"]
        rows.append((
            name, strategy, f"{_worst(losses['ours'], losses['fsdp2']):.1e}",
            f"{_worst(losses['fsdp2'], losses['fsdp2_fp32']):.1e}",
            f"{losses['ours'][0]:.4f} -> {losses['ours'][-1]:.4f}", f"{r['dtypes']['ours']}/{r['dtypes']['fsdp2']}",
            f"{r['compile_s']:.0f}",
        ))
    cols = ("model", "strategy", "ours vs fsdp2 bf16", "fsdp2 bf16 vs fp32", "ours loss", "logits", "compile s")
    print(f"bench.recipe_parity: 2 gloo ranks, bfloat16 parameters with a float32 reduce, {args.steps} AdamW steps; "
          f"worst relative difference of a step's mean loss; torch {torch.__version__}")
    print("\n".join([*format_table(cols, rows), *errors]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
