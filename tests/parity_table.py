"""Print the parity figures (max relative loss / gradient error vs one process) for the model matrix.

    .venv/bin/python -m tests.parity_table [world_size ...]     # default: 2 4
"""

import sys

from tests import rank_cases
from tests.models import MODELS
from tests.rank_pool import RankPool


def main(world_sizes):
    for ws in world_sizes:
        pool = RankPool(ws)
        try:
            for m in sorted(MODELS):
                for s in ("zero2", "zero3"):
                    r = pool.run(rank_cases.parity, m, s)[0]
                    print(
                        f"{m:11s} {s} world={ws}  max loss rel err {r['loss_rel_err']:.1e}  "
                        f"max grad rel err {r['grad_rel_err']:.1e}  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                        flush=True,
                    )
        finally:
            pool.shutdown()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2, 4])
