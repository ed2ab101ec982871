"""The fifth family, as a production team would declare it: a llama-ish decoder whose layers are
scanned and rematerialised (Linen `nn.scan(nn.remat(Block))`; NNX `nnx.vmap`-made layers run by
`jax.lax.scan` over their split state under `jax.checkpoint`), with logical axis names on every
parameter and activation, 75 rules, and a 5-axis mesh of its own. The NNX dropouts keep their
streams as state (stacked per layer), which StockNnx's default `nnx_only` accounts for.

The glue a user writes for the whole battery is the block between the markers.
"""
# --- glue ---
import functools

import parity
from models.families import PROD_RULES, ProdConfig, prod_batch, prod_mesh
from models.linen import prod as linen_prod
from models.nnx import prod as nnx_prod

CFG = ProdConfig()


def make_sides(mesh, cfg=CFG):
  linen = parity.StockLinen(functools.partial(linen_prod.create_train_state, cfg), linen_prod.train_step,
                            linen_prod.eval_step, linen_prod.loss_fn, mesh=mesh, rules=PROD_RULES,
                            forward=linen_prod.forward)
  nnx_side = parity.StockNnx(functools.partial(nnx_prod.create_train_state, cfg), nnx_prod.train_step,
                             nnx_prod.eval_step, nnx_prod.loss_fn, mesh=mesh, rules=PROD_RULES,
                             forward=nnx_prod.forward)
  return linen, nnx_side


production = parity.Pair('production', make_sides, functools.partial(prod_batch, CFG), rules=PROD_RULES,
                         mesh_factory=prod_mesh, meshes=('data=2,stage=1,fsdp=2,sequence=1,tensor=2',))
# --- end of glue ---
