"""Decoding with a KV cache: the token loop, and decode functions for flax's cache convention.

The decode part (parity/battery/checks/decode.py `check_decode`) asks each side for
`steps` tokens after a prompt, the logits each was drawn from and the final
cache (`Side.decode`; StockLinen/StockNnx `decode_fn(state or model, prompt,
steps, key, temperature) -> (tokens, logits, {cache path: array})`). What
draws the tokens is stateless and the same on both sides (`sample`,
`draw_tokens`), so sampled tokens can be equal; what feeds them is each
side's own model.

`linen_decoder` and `nnx_decoder` write such a `decode_fn`:

* flax's cache convention (the default): Linen's model cloned with
  `decode=True`, its `cache` collection made by an `init` at the full length
  and carried through `apply(..., mutable=['cache'])`; NNX's model copied,
  each stock `nnx.MultiHeadAttention` given `init_cache` and the copy
  `set_attributes(decode=True)`, its `nnx.Cache` variables written in place.
  The stock caches take one token a call, so the prompt is fed one position
  a call too (no causal mask: the stock attention masks the slots past its
  cache index itself).
* any other cache: one call `(tokens, cache) -> (logits, cache)` per side,
  which the same loop drives, the whole prompt in its first call (with
  `cache=None`), then one token a call; a call that takes a `max_len`
  keyword is given the length decoding needs (the prompt's and the steps'). The call runs as given: jit it (or
  its model steps) yourself, alike on both sides.

The NNX decoders decode on a copy of the model: the trained model never
holds `nnx.Cache` variables.

The loop (`decode_loop`, around one call `(tokens int32[B, L], cache) ->
(logits [B, L, V], cache)`): the prompt goes first, whole (the call gets
`cache=None` and makes its cache) or one position a call (`one_token`, as
flax's stock caches take it); token 0 is drawn from the last position of its
logits, token i from the logits of feeding token i - 1 (`draw_tokens`), so
the last token is drawn, not fed: a cache of `P + steps` slots ends with its
last slot empty. `temperature` is a float (one sampler program serves
every value): 0.0 takes the argmax, any other draws from
softmax(logits / temperature) with `jax.random.fold_in(key, step)`.

`linen_decoder(model=None, inputs=, kwargs=, call=, collections=)`: `model`
(None: the state's `apply_fn`'s module) is applied as `apply(variables,
*inputs(tokens), **kwargs, mutable=['cache'])`, `inputs(tokens)` its
positional arguments (default: the tokens alone; a tuple for several),
`kwargs` its eval mode (`{'train': False}`), `variables` the state's
`params` and its `collections` fields; `call(variables, tokens, cache)`
replaces flax's cache. `nnx_decoder(inputs=, kwargs=, call=)`: the model
called as `model(*inputs(tokens), **kwargs)`; `call(model, tokens, cache)`
on the copy. The cache comes back as `{'<module path>/<variable>': array}`
(the stock NNX side renames its module paths to Linen's).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import meta

from parity.core import paths
from parity.pairs import modes


def sampling_key(key: jax.Array, step) -> jax.Array:
  """The sampling key of decoding step `step` (from 0)."""
  return jax.random.fold_in(key, step)


@jax.jit
def _sample(logits_BLV, key, step, temperature):
  logits_BV = logits_BLV[:, -1].astype(jnp.float32)
  greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  drawn = jax.random.categorical(sampling_key(key, step), logits_BV / jnp.where(temperature == 0, 1, temperature),
                                 axis=-1).astype(jnp.int32)
  token_B = jnp.where(temperature == 0, greedy, drawn)
  return token_B, logits_BV, token_B[:, None]


def sample(logits_BLV, key, step, temperature: float):
  """(int32[B] token, float32[B, V] its logits) of the last position: argmax at temperature 0, else
  drawn from softmax(logits / temperature). One program serves every temperature and step."""
  return _sample(logits_BLV, key, step, temperature)[:2]


def _placed(host: np.ndarray, like: Any = None) -> jax.Array:
  """A host array on the device with no XLA program (`jnp.asarray`, slicing or stacking a device
  array each ask for one per shape): its first (batch) axis placed as `like`'s is on a mesh."""
  sharding = getattr(like, 'sharding', None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    rows = sharding.spec[0] if len(sharding.spec) else None
    return jax.device_put(host, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(rows)))
  return jax.device_put(host)


def _tokens(prompt) -> jax.Array:
  """The prompt as int32 tokens on the device, where it is already (no program for a conversion)."""
  if isinstance(prompt, jax.Array) and prompt.dtype == jnp.int32:
    return prompt
  return _placed(np.asarray(jax.device_get(prompt)).astype(np.int32), prompt)


def draw_tokens(logits_BLV, feed: Callable[[jax.Array], jax.Array], steps: int, key, temperature: float):
  """(int32[B, steps] tokens, float32[B, steps, V] their logits): token i drawn after feeding token i - 1."""
  tokens, drawn_from, fed = [], [], None
  for step in range(steps):
    if step:
      logits_BLV = jax.block_until_ready(feed(fed))
    # One program at a time: on a mesh of CPU devices, two programs with collectives in flight
    # can each hold some devices' threads waiting for the others (XLA aborts after 40 s).
    token_B, logits_BV, fed = jax.block_until_ready(_sample(logits_BLV, key, step, temperature))
    tokens.append(token_B)
    drawn_from.append(logits_BV)
  if not steps:
    rows, vocab = logits_BLV.shape[0], logits_BLV.shape[-1]
    return _placed(np.zeros((rows, 0), np.int32)), _placed(np.zeros((rows, 0, vocab), np.float32))
  # Stacked on the host (the values are read there), placed by rows as the sampler placed them.
  return (_placed(np.stack([np.asarray(t) for t in tokens], axis=1), tokens[0]),
          _placed(np.stack([np.asarray(x) for x in drawn_from], axis=1), drawn_from[0]))



def decode_loop(call: Callable[[jax.Array, Any], tuple[jax.Array, Any]], prompt, steps: int, key,
                temperature: float, cache: Any = None, one_token: bool = False):
  """(tokens, their logits, the final cache) of `call(tokens, cache) -> (logits, cache)`, prompt first."""
  placed = prompt = _tokens(prompt)
  host = np.asarray(jax.device_get(prompt))
  state = {'cache': cache}

  def feed(tokens_BL):
    logits, state['cache'] = call(tokens_BL, state['cache'])
    return jax.block_until_ready(logits)

  if one_token:  # each position sliced on the host and placed as the prompt is: no program per slice
    for i in range(host.shape[1]):
      logits = feed(_placed(host[:, i:i + 1], placed))
  else:
    logits = feed(prompt)
  # Each drawn token fed placed as the prompt is (the sampler's placement is the compiler's).
  tokens, drawn_from = draw_tokens(logits, lambda t: feed(_placed(np.asarray(t), placed)), steps, key,
                                   temperature)
  return tokens, drawn_from, state['cache']


def _tokens_only(tokens):
  """The model's inputs when decoding: the tokens, its one positional argument."""
  return (tokens,)


def as_args(inputs: Any) -> tuple:
  """What an `inputs` function returns, as positional arguments: a tuple as it is, else one."""
  return inputs if isinstance(inputs, tuple) else (inputs,)


@dataclasses.dataclass(frozen=True, eq=False)
class LinenDecoder:
  """A StockLinen `decode_fn(state, prompt, steps, key, temperature)` (`linen_decoder`)."""

  model: nn.Module | None = None
  inputs: Callable[[jax.Array], Any] = _tokens_only
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  call: Callable[..., Any] | None = None
  collections: tuple[str, ...] = ()

  def variables(self, state) -> dict[str, Any]:
    """The state's variables as `apply` takes them: the parameters unboxed, the extra collections."""
    return {'params': meta.unbox(state.params), **{c: getattr(state, c) for c in self.collections}}

  def decoding_model(self, state) -> nn.Module:
    """The model (given, or the state's `apply_fn`'s: flax's TrainState idiom) with `decode=True`."""
    model = self.model if self.model is not None else getattr(state.apply_fn, '__self__', None)
    if not isinstance(model, nn.Module):
      raise TypeError(f'linen_decoder: no model given, and the state\'s apply_fn is not a Linen module\'s'
                      f' apply: {state.apply_fn!r}')
    return modes.linen_with(model, decode=True)  # a field of the module, or of its config

  @functools.cached_property
  def _init_cache(self):
    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def init_cache(model, batch: int, max_len: int):
      """The empty 'cache' collection, flax's way: `init` at the full length (jit prunes the parameters)."""
      tokens = jnp.zeros((batch, max_len), jnp.int32)
      return model.init(jax.random.PRNGKey(0), *as_args(self.inputs(tokens)), **self.kwargs)['cache']

    return init_cache

  @functools.cached_property
  def _step(self):
    @functools.partial(jax.jit, static_argnums=0)
    def step(model, variables, cache, tokens):
      """(logits, the cache after) of one token a row, written at the cache index."""
      logits, mutated = model.apply({**variables, 'cache': cache}, *as_args(self.inputs(tokens)),
                                    **self.kwargs, mutable=['cache'])
      return logits, mutated['cache']

    return step

  def lower_step(self, state, batch: int, max_len: int) -> jax.stages.Lowered:
    """One decoding step's program (a token a row, on a cache of `max_len`), as `__call__`
    runs it: for `parity compare --decode`'s memory and program comparison."""
    variables = self.variables(state)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    if self.call is not None:  # the cache the call makes of one token, then a step on it
      call = _with_length(self.call, max_len)
      _, cache = call(variables, tokens, None)
      return jax.jit(call).lower(variables, tokens, cache)
    model = self.decoding_model(state)
    return self._step.lower(model, variables, self._init_cache(model, batch, max_len), tokens)

  def __call__(self, state, prompt, steps: int, key, temperature: float):
    variables = self.variables(state)
    prompt = _tokens(prompt)
    if self.call is not None:
      call = _with_length(self.call, prompt.shape[1] + steps)
      tokens, logits, cache = decode_loop(lambda t, c: call(variables, t, c), prompt, steps, key, temperature)
      return tokens, logits, paths.flatten(cache)
    model = self.decoding_model(state)
    batch, prompt_len = prompt.shape
    cache = self._init_cache(model, batch, prompt_len + steps)
    tokens, logits, cache = decode_loop(lambda t, c: self._step(model, variables, c, t), prompt, steps, key,
                                        temperature, cache=cache, one_token=True)
    return tokens, logits, paths.flatten(cache)


def _with_length(call: Callable[..., Any], max_len: int) -> Callable[..., Any]:
  """`call`, given `max_len=` (the prompt's length and the steps: the cache length decoding needs)
  where its signature takes that keyword; as it is otherwise."""
  try:
    parameters = inspect.signature(call).parameters
  except (TypeError, ValueError):
    return call
  if 'max_len' not in parameters:
    return call
  return functools.partial(call, max_len=max_len)


def init_stock_caches(model: nnx.Module, batch: int, max_len: int) -> None:
  """An empty cache in each module of `model` that makes its own as flax's layers do,
  `init_cache(input_shape, dtype)`: a stock `nnx.MultiHeadAttention` (of its `dtype`, else its
  `param_dtype`), and any module of a model's own with that method, such as a position
  embedding keeping its cache index, given `(batch, max_len[, its in_features])`."""
  for _, node in nnx.iter_graph(model):
    if node is model or not isinstance(node, nnx.Module) or not _makes_its_cache(node):
      continue
    features = getattr(node, 'in_features', None)
    shape = (batch, max_len) if features is None else (batch, max_len, features)
    dtype = getattr(node, 'dtype', None) or getattr(node, 'param_dtype', None) or jnp.float32
    node.init_cache(shape, dtype)


def _makes_its_cache(module: nnx.Module) -> bool:
  """Whether `module` has flax's `init_cache(input_shape, dtype)` (the names its layers give them)."""
  method = getattr(type(module), 'init_cache', None)
  if method is None:
    return False
  try:
    names = list(inspect.signature(method).parameters)[1:3]
  except (TypeError, ValueError):
    return False
  return names[:1] == ['input_shape']


@dataclasses.dataclass(frozen=True, eq=False)
class NnxDecoder:
  """A StockNnx `decode_fn(model, prompt, steps, key, temperature)` (`nnx_decoder`)."""

  inputs: Callable[[jax.Array], Any] = _tokens_only
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  call: Callable[..., Any] | None = None
  attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the eval mode's, if kept

  @functools.cached_property
  def _step(self):
    @functools.partial(jax.jit, static_argnums=0)
    def step(graphdef, cache, state, tokens):
      """(logits, the cache after) of one token a row, written at the cache index: the model's
      state in, its cache out, as Linen's step (`LinenDecoder`) takes variables and gives its cache."""
      model = nnx.merge(graphdef, cache, state)
      logits = model(*as_args(self.inputs(tokens)), **self.kwargs)
      return logits, nnx.state(model, nnx.Cache)

    return step

  def decoding_model(self, model: nnx.Module, batch: int, max_len: int) -> nnx.Module:
    """A copy of `model` (left as it is) decoding with empty stock caches."""
    return nnx.merge(*self.decoding_split(model, batch, max_len))

  @functools.cached_property
  def _init_cache(self):
    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def nnx_init_cache(graphdef, batch: int, max_len: int, state):
      """The empty stock caches as one program (made eagerly, each array asks for its own)."""
      model = nnx.merge(graphdef, state)
      init_stock_caches(model, batch, max_len)
      return nnx.state(model, nnx.Cache)

    return nnx_init_cache

  def decoding_split(self, model: nnx.Module, batch: int, max_len: int):
    """(graphdef, empty caches, state) of `model` decoding, `model` left as it is: the decoding
    graph from an abstract copy, the caches from one program, the state the model's own."""

    def decoding(m):
      init_stock_caches(m, batch, max_len)
      m.set_attributes(decode=True)
      if self.attributes:  # the eval mode, where the model keeps it
        m.set_attributes(**self.attributes, raise_if_not_found=False)
      return m

    graphdef, _, _ = nnx.split(nnx.eval_shape(decoding, nnx.clone(model)), nnx.Cache, ...)
    own_graphdef, state = nnx.split(model)
    return graphdef, self._init_cache(own_graphdef, batch, max_len, state), state

  def lower_step(self, model, batch: int, max_len: int) -> jax.stages.Lowered:
    """One decoding step's program (a token a row, on a cache of `max_len`), as `__call__`
    runs it: for `parity compare --decode`'s memory and program comparison."""
    tokens = jnp.zeros((batch, 1), jnp.int32)
    if self.call is not None:  # the cache the call makes of one token, then a step on it
      model, call = nnx.clone(model), _with_length(self.call, max_len)
      _, cache = call(model, tokens, None)
      graphdef, state = nnx.split(model)

      def step(state, tokens, cache):
        """The call on the model's state: logits and cache out, as Linen's `jax.jit(call)` gives
        (`nnx.jit` would return the model's state too, which Linen's step does not)."""
        return call(nnx.merge(graphdef, state), tokens, cache)

      return jax.jit(step).lower(state, tokens, cache)
    return self._step.lower(*self.decoding_split(model, batch, max_len), tokens)

  def __call__(self, model, prompt, steps: int, key, temperature: float):
    prompt = _tokens(prompt)
    if self.call is not None:
      model = nnx.clone(model)  # whatever the call keeps in it stays in the copy
      call = _with_length(self.call, prompt.shape[1] + steps)
      tokens, logits, cache = decode_loop(lambda t, c: call(model, t, c), prompt, steps, key, temperature)
      return tokens, logits, paths.flatten(cache)
    batch, prompt_len = prompt.shape
    graphdef, cache, state = self.decoding_split(model, batch, prompt_len + steps)
    tokens, logits, cache = decode_loop(lambda t, c: self._step(graphdef, c, state, t), prompt, steps, key,
                                        temperature, cache=cache, one_token=True)
    return tokens, logits, paths.flatten(cache)


def linen_decoder(model: nn.Module | None = None, *, inputs: Callable[[jax.Array], Any] | None = None,
                  kwargs: Mapping[str, Any] | None = None, call: Callable[..., Any] | None = None,
                  collections: tuple[str, ...] = ()) -> LinenDecoder:
  """A StockLinen `decode_fn(state, prompt, steps, key, temperature) -> (tokens, logits, cache)`."""
  return LinenDecoder(model, inputs or _tokens_only, dict(kwargs or {}), call, tuple(collections))


def nnx_decoder(*, inputs: Callable[[jax.Array], Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                call: Callable[..., Any] | None = None, attributes: Mapping[str, Any] | None = None) -> NnxDecoder:
  """A StockNnx `decode_fn(model, prompt, steps, key, temperature) -> (tokens, logits, cache)`;
  `attributes` the eval mode's, where the model keeps its mode (set on the decoding copy)."""
  return NnxDecoder(inputs or _tokens_only, dict(kwargs or {}), call, dict(attributes or {}))
