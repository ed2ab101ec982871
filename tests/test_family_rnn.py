"""The sixth family: a recurrent language model from flax's stock layers (`nn.RNN` against
`nnx.RNN`, each over a cell of the model's own around flax's `LSTMCell`: recurrent dropout of
the hidden state at every step, a mask per step, which flax has none of), with stock dropout
on too, declared as a user would: no renames (inferred,
though Linen keeps the cell beside `RNN_0` where NNX nests it in `rnn`), and one declared
difference, the loop flax's two RNNs scan with.
"""
# --- glue ---
import functools

import parity
from models.families import RnnConfig, rnn_batch
from models.linen import rnn as linen_rnn
from models.nnx import rnn as nnx_rnn

CFG = RnnConfig(recurrent_dropout_rate=0.1)


def make_sides(mesh):
  linen = parity.StockLinen(functools.partial(linen_rnn.create_train_state, CFG), linen_rnn.train_step,
                            linen_rnn.eval_step, linen_rnn.loss_fn, mesh=mesh, forward=linen_rnn.forward)
  nnx_side = parity.StockNnx(functools.partial(nnx_rnn.create_train_state, CFG), nnx_rnn.train_step,
                             nnx_rnn.eval_step, nnx_rnn.loss_fn, mesh=mesh, forward=nnx_rnn.forward,
                             dropout_keys='linen')
  return linen, nnx_side


RNN_LOOP = parity.KnownDifference(
    ('RNN_0',), ('memory',), max_temp_bytes={'cpu': 8128, 'gpu': 9984},
    reason="nn.RNN's and nnx.RNN's scans carry the cell's parameters (and their gradients) in another"
           " order: the same program, whose loop buffers XLA lays out by that order")
rnn = parity.Pair('rnn', make_sides, functools.partial(rnn_batch, CFG), known_differences=(RNN_LOOP,))
# --- end of glue ---

import dataclasses  # noqa: E402
import json  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from parity.pairs import correspond  # noqa: E402


def _calls(cfg=CFG):
  linen, nnx_side = make_sides(None)
  batch, key = rnn_batch(cfg, 0), jax.random.PRNGKey(0)
  return (correspond.linen_calls(linen, linen.init(0), batch, key),
          correspond.nnx_calls(nnx_side, nnx_side.init(0), batch, key))


def test_the_linen_cell_is_one_call_and_pairs_with_the_nnx_rnns_cell():
  """flax's nn.scan traces its body once more to check its broadcast values: not a module call.
  `RNN_0` owns no parameters (its cell is the model's `RecurrentDropoutLSTMCell_0`); it still pairs
  with `rnn`."""
  linen_calls, nnx_calls = _calls()
  cell = 'RecurrentDropoutLSTMCell_0'
  assert [c.key for c in linen_calls if c.path == cell] == [cell]
  rules = dict(correspond.infer(linen_calls, nnx_calls).renames.rules)
  assert rules['RNN_0'] == 'rnn' and rules[cell] == 'rnn/cell', rules
  assert rules[f'{cell}/LSTMCell_0'] == 'rnn/cell/lstm' and rules[f'{cell}/Dropout_0'] == 'rnn/cell/dropout', rules


def test_a_layer_whose_two_flax_versions_hold_other_parameters_is_named_as_such(monkeypatch):
  """flax's Linen OptimizedLSTMCell keeps a kernel per gate, NNX's fused ones: no rename pairs
  them, and the error says so rather than asking for renames."""
  monkeypatch.setattr(nn, 'LSTMCell', nn.OptimizedLSTMCell)
  monkeypatch.setattr(nnx, 'LSTMCell', nnx.OptimizedLSTMCell)
  with pytest.raises(correspond.CorrespondenceError) as failure:
    correspond.infer(*_calls())
  message = str(failure.value)
  assert ('Linen RecurrentDropoutLSTMCell_0/OptimizedLSTMCell_0 (OptimizedLSTMCell) and NNX rnn/cell/lstm'
          ' (OptimizedLSTMCell) are the same layer'
          ' at the same place, but hold other parameters') in message, message
  assert 'no rename pairs them' in message, message


def _pair(name, sides=make_sides, **kwargs):
  return parity.Pair(name, sides, functools.partial(rnn_batch, CFG), **kwargs)


@pytest.mark.xdist_group('parity-rnn')
def test_the_recurrent_dropout_draws_each_steps_key_as_linens_split(monkeypatch):
  """The kit gives the cell's stream one key per step, as nn.RNN's `split_rngs` does: without it
  (nnx.RNN carries the stream, one key for every step) the grads part fails at the cell's dropout,
  from step 1 (step 0 drops out the initial carry, zeros under any mask)."""
  from parity.battery import checks
  from parity.pairs import dropout

  monkeypatch.setattr(dropout, '_rnn_with_steps_keys', lambda original: original)
  pair = _pair('rnn_carried_stream', parts=('grads',))
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  message = str(failure.value)
  assert ('forward pass: first differs at module RecurrentDropoutLSTMCell_0/1/Dropout_0 (NNX: rnn/cell/1/dropout)'
          in message), message
  # The index is the loop's time step, not a layer: the cell's loop slices no parameters.
  first = checks._runs(pair).localization().first(0)
  assert (first['path'], first['layer'], first['iteration']) == ('RecurrentDropoutLSTMCell_0/Dropout_0', None, 1), first


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-rnn')
def test_without_its_declaration_the_program_is_the_same_and_the_memory_part_fails():
  """The two RNNs' scans carry the same values in another order: the same program, while XLA's
  memory analysis of the steps still differs (XLA schedules from the carried order)."""
  from parity.battery import checks

  pair = _pair('rnn_undeclared', parts=('program', 'memory'))
  assert checks.check_program(pair) == []
  with pytest.raises(AssertionError) as failure:
    checks.check_memory(pair)
  assert 'temp_bytes -8,128 B' in str(failure.value), failure.value


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-rnn')
def test_a_bug_planted_in_the_nnx_cell_fails_and_the_localizer_names_the_cell(monkeypatch):
  from parity.battery import checks

  def sides(mesh):
    linen, nnx_side = make_sides(mesh)

    def create(seed):
      model, optimizer = nnx_rnn.create_train_state(CFG, seed)
      model.rnn.cell.lstm.gate_fn = nnx.hard_sigmoid  # stock: sigmoid, as Linen's
      return model, optimizer

    return linen, dataclasses.replace(nnx_side, create=create)

  with pytest.raises(AssertionError) as failure:
    checks.check_grads(_pair('rnn_gate', sides, parts=('grads',)))
  message = str(failure.value)
  # The cell's step 0 (the loop's first iteration), named on both sides.
  assert ('forward pass: first differs at module RecurrentDropoutLSTMCell_0/0/LSTMCell_0 (NNX: rnn/cell/0/lstm)'
          in message), message


def result_line(text: str, label: str) -> str:
  """The report's row `label`, stripped."""
  return next(line.strip() for line in text.splitlines() if line.strip().startswith(label))


@pytest.mark.xdist_group('parity-rnn')
@pytest.mark.parametrize('declared,passes', [
    ({'gpu': 8128}, False),  # a bound for another platform excuses nothing here
    ({'cpu': 8128, 'gpu': 64}, True),
], ids=['another_platform', 'this_platform'])
def test_a_memory_bound_by_platform_holds_on_the_platforms_it_names_only(declared, passes):
  """`max_temp_bytes` by platform: the bound named for this platform (the CPU here) holds and is
  checked; a mapping without it declares no memory here, and the failure gives the entry to add."""
  from parity.battery import checks

  pair = _pair('rnn_memory', parts=('memory',),
               known_differences=(dataclasses.replace(RNN_LOOP, max_temp_bytes=declared),))
  if passes:
    assert checks.check_memory(pair)[-1].endswith(f'on cpu, RNN_0: {RNN_LOOP.reason})'), checks.check_memory(pair)
    return
  with pytest.raises(AssertionError) as failure:
    checks.check_memory(pair)
  message = str(failure.value)
  assert 'temp_bytes -8,128 B' in message and 'beyond the declared' not in message, message
  # The programs are the same, the loop's order flax's own: the declaration to write, its bytes measured.
  assert ("declare it with the bytes measured: KnownDifference((<the loop's module>,), ('memory',), reason=...,"
          " max_temp_bytes={'cpu': 8128})" in message), message
  assert message.endswith("names no bound on cpu (max_temp_bytes={'gpu': 8128}); if this is the same cause here,"
                          " add the bytes measured: max_temp_bytes={'gpu': 8128, 'cpu': 8128}"), message


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-rnn')
def test_compare_accepts_the_declared_loop_and_exits_0(tmp_path, capsys):
  from parity.run import cli

  out = tmp_path / 'rnn.json'
  assert cli.main(['compare', '--pair', 'tests/test_family_rnn.py:rnn', '--steps', '2', '--json', str(out)]) == 0
  text = capsys.readouterr().out
  assert result_line(text, 'Train-step program').endswith('identical except: step counter dtype'), text
  result = json.loads(out.read_text())
  assert result['bitwise_equal'] and result['same_program'], result
  assert result['memory_verdict'].startswith('differs within the declared bound'), result['memory_verdict']


@pytest.mark.exhaustive  # a pair's own compiles (time); every pair's grads part runs the loss path around it
@pytest.mark.xdist_group('parity-rnn')
def test_an_nnx_loss_with_aux_outputs_is_taken_with_has_aux():
  """An NNX loss returning (loss, aux), as a Linen one may (`has_aux=True` on both sides): the kit
  differentiates the loss alone, and the gradients and the localizer compare as before."""
  from parity.battery import checks

  def with_logits(model, batch, key):
    return nnx_rnn.loss_fn(model, batch, key), model(batch['tokens'][:, :-1])

  def sides(mesh):
    linen, nnx_side = make_sides(mesh)
    return linen, dataclasses.replace(nnx_side, loss=with_logits, has_aux=True)

  checks.check_grads(_pair('rnn_aux', sides, parts=('grads',)))


@pytest.mark.parametrize('per_sequence,draws', [(False, 5), (True, 1)], ids=['mask_per_step', 'mask_per_sequence'])
def test_after_the_loop_the_cells_stream_holds_its_key_and_the_count_the_loop_leaves(per_sequence, draws):
  """The kit scans the cell's stream over the steps while it traces; afterwards the stream holds
  its key again and the count nnx.RNN's own loop would leave: one draw a step where it carries
  the stream, one in all where it broadcasts it (`broadcast_rngs`, which draws the key it splits)."""
  import contextlib

  import jax.numpy as jnp

  from parity.pairs import dropout

  cfg = dataclasses.replace(CFG, recurrent_dropout_per_sequence=per_sequence)

  def run(kit):
    model = nnx_rnn.RecurrentLM(cfg, rngs=nnx.Rngs(params=0, dropout=0))
    with dropout.linen_dropout_keys() if kit else contextlib.nullcontext():
      model(jnp.zeros((2, 5), jnp.int32), train=True, rngs=nnx.Rngs(dropout=1))
    stream = model.rnn.cell.dropout.rngs
    return jax.random.key_data(stream.key[...]), stream.count[...]

  (key, count), (kit_key, kit_count) = run(False), run(True)
  assert int(count) == draws and int(kit_count) == int(count), (count, kit_count)
  assert kit_count.dtype == count.dtype and bool(jnp.all(kit_key == key)), (kit_key, key)


@pytest.mark.exhaustive  # a pair of its own (compiles): the per-step pair is the family's
@pytest.mark.xdist_group('parity-rnn')
def test_one_recurrent_mask_for_every_step_is_drawn_as_linens_broadcast_key(monkeypatch):
  """Variational dropout (one mask for every step of a sequence: Linen's `split_rngs={'dropout':
  False}`, NNX's `broadcast_rngs='dropout'`): the kit hands each step the stream's key unsplit, as
  Linen broadcasts it, and the gradients are bit for bit; left as nnx.RNN draws it (its own keys),
  the grads part fails at the cell's dropout."""
  from parity.battery import checks
  from parity.pairs import dropout

  cfg = dataclasses.replace(CFG, recurrent_dropout_per_sequence=True)

  def sides(mesh):
    linen, nnx_side = make_sides(mesh)
    return (dataclasses.replace(linen, create=functools.partial(linen_rnn.create_train_state, cfg)),
            dataclasses.replace(nnx_side, create=functools.partial(nnx_rnn.create_train_state, cfg)))

  pair = parity.Pair('rnn_mask_per_sequence', sides, functools.partial(rnn_batch, cfg), parts=('grads',))
  checks.check_grads(pair)
  monkeypatch.setattr(dropout, '_loop_scheme', lambda rnn, held: None if rnn.broadcast_rngs else (False, 0))
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(dataclasses.replace(pair, name='rnn_mask_per_sequence_as_drawn'))
  # From step 1: step 0 drops out the initial carry, zeros under any mask.
  assert 'RecurrentDropoutLSTMCell_0/1/Dropout_0 (NNX: rnn/cell/1/dropout)' in str(failure.value), failure.value


@pytest.mark.exhaustive  # two pairs of their own (compile)
@pytest.mark.xdist_group('parity-rnn')
def test_a_loop_that_carries_the_count_draws_a_mask_per_step_and_fails_beside_one_per_sequence():
  """`broadcast_rngs=nnx.RngKey` broadcasts the stream's key and not its count, which nnx.RNN's loop
  carries: every step draws another mask, as Linen's per-step split does, and the kit draws it so
  (bit for bit beside Linen's `split_rngs={'dropout': True}`). Beside Linen's one mask for every
  step (`split_rngs={'dropout': False}`) the grads part fails at the cell's dropout, and says what
  the NNX RNN's filter does and which one the Linen side needs. (The kit used to draw this loop
  one mask for every step, passing a port whose masks differ from step to step.)"""
  from parity.battery import checks

  def key_only(seed):
    model, optimizer = nnx_rnn.create_train_state(CFG, seed)
    model.rnn.broadcast_rngs = nnx.RngKey
    return model, optimizer

  def sides(linen_cfg):
    def make(mesh):
      linen, nnx_side = make_sides(mesh)
      return (dataclasses.replace(linen, create=functools.partial(linen_rnn.create_train_state, linen_cfg)),
              dataclasses.replace(nnx_side, create=key_only))
    return make

  checks.check_grads(parity.Pair('rnn_key_only_per_step', sides(CFG), functools.partial(rnn_batch, CFG),
                                 parts=('grads',)))
  per_sequence = dataclasses.replace(CFG, recurrent_dropout_per_sequence=True)
  pair = parity.Pair('rnn_key_only_beside_per_sequence', sides(per_sequence),
                     functools.partial(rnn_batch, CFG), parts=('grads',))
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(pair)
  text = str(failure.value)
  assert 'RecurrentDropoutLSTMCell_0/1/Dropout_0 (NNX: rnn/cell/1/dropout)' in text, text
  assert ("in the cell of the nnx.RNN at rnn (broadcast_rngs=RngKey): its loop carries the stream's count"
          in text), text
  assert "the NNX RNN needs broadcast_rngs='dropout'" in text, text


@pytest.mark.parametrize('broadcast,scheme', [
    (None, (False, 0)),  # carried: a mask per step
    ('dropout', (True, 1)),  # the stream whole: split once, one mask for every step
    (nnx.RngState, (True, 1)),  # all the cell's RNG state, which is the held stream
    ('params', (False, 0)),  # no RNG state of the cell: carried
    (nnx.RngKey, (False, 0)),  # the key and not the count: not split, the count carried
    (nnx.RngCount, (True, 0)),  # the count and not the key: not split, the count broadcast
    (lambda path, value: path[:1] == ('dropout',), None),  # by path in the cell: flax's split sees other paths
], ids=['none', 'its_stream', 'rng_state', 'other_state', 'key_only', 'count_only', 'by_path_in_the_cell'])
def test_the_kit_draws_a_recurrent_loop_as_its_count_is_carried_or_broadcast(broadcast, scheme):
  """A step of nnx.RNN's loop draws `fold_in(key, count)`: a mask per step where the loop carries
  the stream's count, one mask for every step where it broadcasts it. The kit draws each as Linen
  draws the same masks, and advances the count as nnx.RNN's own loop does (one draw where it splits
  the stream first); a filter the kit cannot read so is left as nnx.RNN draws it, and named."""
  import contextlib

  import jax.numpy as jnp

  from parity.pairs import dropout

  def rnn():
    cell = nnx_rnn.RecurrentDropoutLSTMCell(4, 8, 0.1, rngs=nnx.Rngs(params=0, dropout=0))
    cell.dropout.deterministic = False
    return nnx.RNN(cell, broadcast_rngs=broadcast)

  loop = rnn()
  assert dropout._loop_scheme(loop, dropout.held_streams(loop.cell)) == scheme
  counts = []
  for kit in (False, True):
    loop = rnn()
    with dropout.linen_dropout_keys() if kit else contextlib.nullcontext():
      loop(jnp.ones((1, 5, 4)))
    counts.append(int(loop.cell.dropout.rngs.count[...]))
  assert counts[0] == counts[1], counts
  # A failure there names the RNN and how the kit reads its loop.
  model = nnx.Dict(rnn=loop)
  for module in ('rnn/cell/dropout', 'rnn/cell/1/dropout'):  # as reported, and with the step's index
    assert dropout.rnn_loops(model, module) == [('rnn', broadcast, scheme)], module


def _model_pair(name, linen_model, nnx_model):
  """A grads-only pair of the family's sides over other model classes (emb_dim == hidden, so that a
  recurrent layer's output can enter another), each made and trained as the family's own."""
  from flax.training import train_state

  cfg = dataclasses.replace(CFG, emb_dim=CFG.hidden)

  def linen_create(seed):
    model = linen_model(cfg)
    params = model.init(jax.random.PRNGKey(seed), jax.numpy.zeros((1, cfg.seq_len - 1), jax.numpy.int32))['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=linen_rnn.make_optimizer(cfg))

  def nnx_create(seed):
    model = nnx_model(cfg, rngs=nnx.Rngs(params=seed, dropout=seed))
    return model, nnx.Optimizer(model, nnx_rnn.make_optimizer(cfg), wrt=nnx.Param)

  def sides(mesh):
    linen, nnx_side = make_sides(mesh)
    return dataclasses.replace(linen, create=linen_create), dataclasses.replace(nnx_side, create=nnx_create)

  return parity.Pair(name, sides, functools.partial(rnn_batch, cfg), parts=('grads',))


class _LinenRnnTwice(linen_rnn.RecurrentLM):
  """The family's Linen model with its one `nn.RNN` applied twice in a pass (emb_dim == hidden)."""

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim)(tokens)
    cell = linen_rnn.RecurrentDropoutLSTMCell(cfg.hidden, cfg.recurrent_dropout_rate, deterministic=not train)
    rnn = nn.RNN(cell, split_rngs={'params': False, 'dropout': True})
    x = rnn(rnn(x))
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)
    return nn.Dense(cfg.vocab_size)(x)


class _NnxRnnTwice(nnx_rnn.RecurrentLM):
  """The family's NNX model with its one `nnx.RNN` applied twice in a pass, as `_LinenRnnTwice`."""

  def __call__(self, tokens, train: bool = False, rngs=None):
    self.rnn.cell.dropout.deterministic = not train
    x = self.rnn(self.rnn(self.embed(tokens)))
    return self.head(self.dropout(x, deterministic=not train, rngs=rngs))


@pytest.mark.exhaustive  # a pair of its own (compiles)
@pytest.mark.xdist_group('parity-rnn')
def test_one_rnn_called_twice_in_a_step_draws_each_calls_keys_as_linen():
  """One RNN applied twice in a pass: Linen's second call splits the same key over the steps and
  draws on with the cell's dropout's count (flax's scan traces its body first in a check of its
  own, whose draw is not the loop's: the counts kept are the loop's, 2 and 4). The kit gives NNX's
  second call the second of them, though each call of nnx.RNN runs on a copy of the cell's stream;
  the gradients are bit for bit."""
  from parity.battery import checks
  from parity.pairs import dropout

  pair = _model_pair('rnn_called_twice', _LinenRnnTwice, _NnxRnnTwice)
  linen, _ = pair.make_sides(None)
  state, batch, key = linen.init(0), pair.batch(0), jax.random.PRNGKey(0)
  draws = dropout.linen_draws(lambda state: linen.loss(state.params, state, batch, key), state)
  assert draws['RecurrentDropoutLSTMCell_0/Dropout_0'] == (2, 4), draws
  checks.check_grads(pair)


class _LinenLayer(nn.Module):
  """One layer of `_LinenStack`: an `nn.RNN` over the family's recurrent-dropout cell."""
  cfg: RnnConfig
  train: bool = False

  @nn.compact
  def __call__(self, x, _):
    cell = linen_rnn.RecurrentDropoutLSTMCell(self.cfg.hidden, self.cfg.recurrent_dropout_rate,
                                              deterministic=not self.train)
    return nn.RNN(cell, split_rngs={'params': False, 'dropout': True})(x), None


class _LinenStack(linen_rnn.RecurrentLM):
  """The family's Linen model with two recurrent layers under `nn.scan` (emb_dim == hidden)."""

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim)(tokens)
    stack = nn.scan(_LinenLayer, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                    length=2)
    x, _ = stack(cfg, train, name='layers')(x, None)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)
    return nn.Dense(cfg.vocab_size)(x)


class _NnxLayer(nnx.Module):
  def __init__(self, cfg, rngs):
    self.rnn = nnx.RNN(nnx_rnn.RecurrentDropoutLSTMCell(cfg.hidden, cfg.hidden, cfg.recurrent_dropout_rate,
                                                        rngs=rngs))


class _NnxStack(nnx.Module):
  """`_LinenStack` in NNX: the layers made by `nnx.vmap` (each cell's stream stacked, a key per layer)
  and run by `nnx.scan`, each layer's `nnx.RNN` carrying its slice of the stream over the steps."""

  def __init__(self, cfg, *, rngs):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.emb_dim, rngs=rngs)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def layers(rngs):
      return _NnxLayer(cfg, rngs)

    self.layers = layers(rngs)
    self.dropout = nnx.Dropout(cfg.dropout_rate)
    self.head = nnx.Linear(cfg.hidden, cfg.vocab_size, rngs=rngs)

  def __call__(self, tokens, train: bool = False, rngs=None):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(layer, x):
      layer.rnn.cell.dropout.deterministic = not train
      return layer.rnn(x)

    x = run(self.layers, self.embed(tokens))
    return self.head(self.dropout(x, deterministic=not train, rngs=rngs))


@pytest.mark.exhaustive  # a pair of its own (compiles)
@pytest.mark.xdist_group('parity-rnn')
def test_an_rnn_in_each_layer_of_a_scanned_stack_draws_linens_keys(monkeypatch):
  """A stream stacked over layers and carried over steps: each layer's cell keeps its slice of a
  stream `nnx.vmap` stacked, and its `nnx.RNN` carries it. The kit splits the key over the layers
  (Linen's nn.scan), then each layer's over its steps (Linen's nn.RNN): the gradients are bit for
  bit. Left as nnx.RNN draws it, the grads part fails, and the localizer names the cell's dropout
  by its layer and its step (Linen's scan body calls each layer, NNX's the layer's RNN: the NNX
  stack is the modules whose parameters its scan slices, `layers`, as Linen's)."""
  from parity.battery import checks
  from parity.pairs import dropout

  pair = _model_pair('rnn_stacked', _LinenStack, _NnxStack)
  checks.check_grads(pair)
  monkeypatch.setattr(dropout, '_rnn_with_steps_keys', lambda original: original)
  with pytest.raises(AssertionError) as failure:
    checks.check_grads(dataclasses.replace(pair, name='rnn_stacked_as_drawn'))
  assert ('forward pass: first differs at module layers/0/RecurrentDropoutLSTMCell_0/1/Dropout_0'
          in str(failure.value)), failure.value
