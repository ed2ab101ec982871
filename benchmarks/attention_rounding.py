"""Benchmark (not a test): where flax's two stock attentions round otherwise, by head_dim.

  .venv/bin/python benchmarks/attention_rounding.py [--head-dims 1,2,4,8,16,32,64] [--cases plain,mask,...]
      [--heads 2] [--features 32] [--batch 2] [--length 8]

Linen's `nn.MultiHeadDotProductAttention` against `nnx.MultiHeadAttention`
with the same parameters and inputs (the suite's portable CPU flags, one
device), each under `jax.jit`: the largest distance in ULP of the outputs, of
the gradients of `sum(outputs * cotangent)` with respect to the input and to
each parameter (the largest named; the key projection's bias apart: its gradient is
0 in exact arithmetic, so rounding noise on each side), per head_dim, in four cases:

* `plain`: no mask, no dropout (`dropout_rate=0`);
* `mask`: a padding mask (the last two keys of one row masked out);
* `rate-eval`: `dropout_rate=0.1` on both modules, called deterministic;
* `rate-train`: the same, dropout drawn, both modules given one key;
* (`causal`, on request: a causal mask, no dropout.)

Each case also runs NNX given Linen's formula (`attention_fn=parity.linen_attention`,
the kit's substitute), which must be 0 everywhere.

Why (flax 0.12.8, jax 0.10): Linen (`flax.linen.dot_product_attention_weights`)
divides the query by `sqrt(head_dim)` (a float32) before q.k. NNX's default
`nnx.dot_product_attention` takes another route only when the module's
`dropout_rate` is 0 (whatever `deterministic` is) and it sows nothing: it calls
`jax.nn.dot_product_attention`, which multiplies the logits by
`1/sqrt(head_dim)` after q.k, in a float32 constant rounded from a double, and
lays its contractions out otherwise (vmapped over the heads: `BTNH,BSNH->BNTS`).
With a dropout rate above 0, NNX computes Linen's formula itself.

Measured (2 heads of 32 features, batch 2, 8 positions; an x86-64 CPU): differences at
head_dim 1, 2, 8 and 32 with dropout_rate 0, none at 4, 16 and 64, none with a dropout rate
above 0, none with the substitute (the table is in docs/howto-differences.md, "Stock attention").
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from parity.env import xla_env  # noqa: E402  (imports no jax)

CASES = ('plain', 'mask', 'rate-eval', 'rate-train')


def measure(head_dim: int, case: str, heads: int = 2, features: int = 32, batch: int = 2, length: int = 8):
  """{'stock': (forward, input grad, (param grad, its path), key bias grad), 'substituted': (...)} in ULP."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import parity
  from parity.core import bitwise

  rate = 0.0 if case in ('plain', 'mask', 'causal') else 0.1
  train = case == 'rate-train'
  rng = np.random.default_rng(head_dim)
  x = jnp.asarray(rng.normal(size=(batch, length, features)), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=(batch, length, features)), jnp.float32)
  mask = None
  if case == 'causal':
    mask = nn.make_causal_mask(jnp.ones((batch, length)))  # [batch, 1, q, kv]
  elif case != 'plain':
    valid = np.ones((batch, length), bool)
    valid[0, -2:] = False
    mask = jnp.asarray(valid[:, None, None, :])  # [batch, heads (broadcast), q, kv]
  base = jax.random.PRNGKey(7)
  # The key NNX draws from an nnx.Rngs(dropout=base) given at the call: Linen gets it as dropout_rng.
  drawn = nnx.Rngs(dropout=base).dropout()

  linen = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=heads * head_dim, out_features=features,
                                          dropout_rate=rate)
  params = linen.init(jax.random.PRNGKey(0), x, x, mask=mask, deterministic=True)['params']

  @jax.jit
  def linen_loss(params, x):
    kwargs = {'deterministic': not train, 'dropout_rng': drawn if train else None}
    out = linen.apply({'params': params}, x, x, mask=mask, **kwargs)
    return jnp.sum(out * cotangent), out

  reference = jax.value_and_grad(linen_loss, argnums=(0, 1), has_aux=True)(params, x)
  results = {}
  for name, fn in (('stock', nnx.dot_product_attention), ('substituted', parity.linen_attention)):
    model = nnx.MultiHeadAttention(heads, features, qkv_features=heads * head_dim, out_features=features,
                                   dropout_rate=rate, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
    graphdef, template, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def nnx_loss(pure, x, graphdef=graphdef, template=template, rest=rest):
      state = jax.tree.map(lambda v: v, template)
      nnx.replace_by_pure_dict(state, pure)
      model = nnx.merge(graphdef, state, rest)
      rngs = nnx.Rngs(dropout=base) if train else None
      out = model(x, x, mask=mask, deterministic=not train, rngs=rngs)
      return jnp.sum(out * cotangent), out

    (_, out), (grads, x_grad) = jax.value_and_grad(nnx_loss, argnums=(0, 1), has_aux=True)(
        jax.tree.map(jnp.asarray, dict(params)), x)
    (_, ref_out), (ref_grads, ref_x_grad) = reference
    flat = {'/'.join(str(getattr(k, 'key', k)) for k in p): g
            for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    ref_flat = {'/'.join(str(getattr(k, 'key', k)) for k in p): g
                for p, g in jax.tree_util.tree_flatten_with_path(ref_grads)[0]}
    assert set(flat) == set(ref_flat), (sorted(flat), sorted(ref_flat))
    # The key projection's bias gets a gradient that is 0 in exact arithmetic (softmax ignores a shift
    # of each row's logits): rounding noise on both sides, so its ULP distance is apart.
    param_ulp = max(((bitwise.max_ulp(ref_flat[p], flat[p]), p) for p in sorted(flat) if p != 'key/bias'),
                    key=lambda t: t[0])
    results[name] = (bitwise.max_ulp(ref_out, out), bitwise.max_ulp(ref_x_grad, x_grad), param_ulp,
                     bitwise.max_ulp(ref_flat['key/bias'], flat['key/bias']))
  return results


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--head-dims', default='1,2,4,8,16,32,64')
  parser.add_argument('--cases', default=','.join(CASES), help='of: ' + ', '.join(CASES) + ', causal')
  parser.add_argument('--heads', type=int, default=2)
  parser.add_argument('--features', type=int, default=32, help='the input and output features')
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument('--length', type=int, default=8)
  args = parser.parse_args()
  xla_env.add_flags(xla_env.portable_cpu_flags())
  os.environ.setdefault(xla_env.CPU_THREADS_ENV, str(xla_env.SUITE_CPU_DEVICES))
  import flax
  import jax

  shape = dict(heads=args.heads, features=args.features, batch=args.batch, length=args.length)
  print(f'jax {jax.__version__}, flax {flax.__version__}, {jax.default_backend()}; {shape}; max ULP, Linen vs'
        ' NNX (stock NNX | NNX given parity.linen_attention)')
  print(f'{"head_dim":>8}  {"case":<12} {"forward":>8} {"d input":>8} {"d params":>9} {"(largest at)":<16}'
        f' {"d key/bias":>13} | substituted: fwd, d input, d params, d key/bias')
  for head_dim in (int(h) for h in args.head_dims.split(',')):
    for case in args.cases.split(','):
      r = measure(head_dim, case, **shape)
      (fwd, dx, (dp, where), kb), substituted = r['stock'], r['substituted']
      s_fwd, s_dx, (s_dp, _), s_kb = substituted
      print(f'{head_dim:>8}  {case:<12} {fwd:>8,} {dx:>8,} {dp:>9,} {("(" + where + ")") if dp else "":<16}'
            f' {kb:>13,} | {s_fwd}, {s_dx}, {s_dp}, {s_kb}', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
