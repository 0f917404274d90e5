"""The reference workload with ZeRO-1: AdamW's state sharded over the ranks.

Each rank keeps 1/N of the optimizer state (and a live mirror of its left
neighbour's 1/N, so a killed rank's shard is recovered exactly). The loop is
examples/mlp.py's; the only difference is one argument:

    ctx.register(model=model, optimizer=opt, sharding="zero1")

livemig run --nproc 2 --spares 1 --fault kill:rank=1:step=20 --verify examples/mlp_zero1.py --steps 40
python examples/mlp_zero1.py --steps 5        # plain single process, no livemig
"""

from mlp import main  # this script's folder

if __name__ == "__main__":
    main(sharding="zero1")
