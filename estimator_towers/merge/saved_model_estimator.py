"""A SavedModelEstimator's model_fn on towers.

`for_towers`, for `replicate_model_fn`: a SavedModelEstimator's model_fn
its model_fn imports the SavedModel's graph, variables included, on every
call, so each tower would hold a model of its own (and the second import
failed on the first one's global_step). Tower 0 imports as one device does;
a later tower imports the graph's ops again under its own name scope and
device, with every state handle (variables, metric accumulators, tables)
mapped to tower 0's, so all towers read one model and add into one metric
state (EVAL equals one device's; PREDICT comes back in input order). TRAIN
is refused: the SavedModel's train_op is its optimizer's update, already
differentiated from one copy's loss, which towers cannot make one update.
"""

from typing import Any, Callable, Dict, List
import weakref

import tensorflow as tf
from tensorflow.python.framework import meta_graph  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import op_def_registry  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.util import function_utils  # pylint: disable=g-direct-tensorflow-import
from tensorflow_estimator.python.estimator import estimator as estimator_lib  # pylint: disable=g-direct-tensorflow-import
from tensorflow_estimator.python.estimator.canned import saved_model_estimator as sme_lib  # pylint: disable=g-direct-tensorflow-import

from estimator_towers import tower as tower_lib
from estimator_towers.towers import variable_sharing

tf1 = tf.compat.v1
ModeKeys = tf.estimator.ModeKeys


class TowersSavedModelEstimator(sme_lib.SavedModelEstimator):
  """A SavedModelEstimator whose model_fn runs on towers.

  It evaluates and predicts as `SavedModelEstimator(saved_model_dir,
  model_dir)` does on one device (the same metrics, predictions in input
  order, the SavedModel's variables until `model_dir` has a checkpoint),
  with each batch split over the towers `replicate_model_fn` builds.
  Training on more than one tower is refused (see the module docstring).

  Args:
    saved_model_dir: The SavedModel, exported with its EVAL (and PREDICT)
      graph, e.g. by `experimental_export_all_saved_models`.
    model_dir: Where checkpoints are read and written.
    config: The RunConfig (SavedModelEstimator takes none): its session
      gives the tower devices, e.g. `make_run_config(cpu_devices=2)`.
    **replicate_kwargs: More arguments of `replicate_model_fn`
      (`devices`, ...).
  """

  def __init__(self, saved_model_dir: str, model_dir: str = None,
               config: tf.estimator.RunConfig = None, **replicate_kwargs):
    # Here, not at the top: replicate imports this module.
    from estimator_towers import replicate as replicate_lib  # pylint: disable=g-import-not-at-top
    # SavedModelEstimator.__init__ takes neither a config nor a model_fn:
    # its three attributes are set as it sets them.
    estimator_lib.EstimatorV2.__init__(  # pylint: disable=non-parent-init-called
        self, model_fn=replicate_lib.replicate_model_fn(
            self._model_fn_from_saved_model, **replicate_kwargs),
        model_dir=model_dir, config=config)
    self.saved_model_dir = saved_model_dir
    self.saved_model_loader = sme_lib.loader_impl.SavedModelLoader(
        saved_model_dir)
    self._available_modes = self._extract_available_modes()


def for_towers(model_fn: Callable) -> Callable:
  """`model_fn`, or a tower-aware one when it is a SavedModelEstimator's.

  Args:
    model_fn: What `replicate_model_fn` was given.

  Returns:
    `model_fn` itself, unless it is `SavedModelEstimator.model_fn` (or its
    bound `_model_fn_from_saved_model`): then a model_fn taking
    `(features, labels, mode, config)` that builds each tower from one
    imported model (see the module docstring).
  """
  estimator = _saved_model_estimator(model_fn)
  if estimator is None:
    return model_fn
  towers = _ImportedTowers(estimator)

  def saved_model_tower_fn(features, labels, mode, config):
    return towers.call(model_fn, features, labels, mode, config)

  return saved_model_tower_fn


def _saved_model_estimator(model_fn):
  """The SavedModelEstimator whose model_fn `model_fn` is, or None.

  `Estimator.model_fn` is a closure over the Estimator; the bound
  `_model_fn_from_saved_model` has it as `__self__`.
  """
  owners = [getattr(model_fn, '__self__', None)]
  owners += [cell.cell_contents
             for cell in getattr(model_fn, '__closure__', None) or ()]
  for owner in owners:
    if isinstance(owner, sme_lib.SavedModelEstimator):
      return owner
  return None


class _ImportedTowers:
  """Builds the towers of a SavedModelEstimator's model_fn.

  Args:
    estimator: The SavedModelEstimator.
  """

  def __init__(self, estimator):
    self._estimator = estimator
    # Of the graph being built: (a weak reference to it, the mode, tower
    # 0's {state tensor name: tensor}, tower 0's scaffold).
    self._tower0 = None

  def call(self, model_fn, features, labels, mode, config
          ) -> tf.estimator.EstimatorSpec:
    """One tower's spec: tower 0 as one device, later ones on its state.

    Raises:
      ValueError: TRAIN on several towers, or a later tower built before
        tower 0 in its graph.
    """
    context = tower_lib.tower_context()
    if context.num_towers > 1 and mode == ModeKeys.TRAIN:
      raise ValueError(
          'replicate_model_fn cannot train a SavedModelEstimator on '
          f'{context.num_towers} towers: its SavedModel holds the train_op '
          "as its optimizer's update, computed from one copy's loss, which "
          'towers cannot merge into one update. Train it unwrapped '
          '(SavedModelEstimator.train on one device), or replicate the '
          'model_fn that exported the SavedModel; evaluate and predict work '
          'on towers.')
    graph = tf1.get_default_graph()
    if context.index == 0:
      if tf1.train.get_global_step(graph) is not None:
        raise ValueError(
            "A SavedModelEstimator's model_fn imports the SavedModel's "
            'global_step, but this Estimator made one before calling it '
            '(tf.estimator.Estimator does). Run it on towers with '
            'estimator_towers.merge.saved_model_towers.'
            'TowersSavedModelEstimator(saved_model_dir, model_dir, config).')
      kwargs = {'config': config} if 'config' in _args(model_fn) else {}
      spec = model_fn(features=features, labels=labels, mode=mode, **kwargs)
      self._tower0 = (weakref.ref(graph), mode,
                      self._state_of_tower0(graph, mode), spec.scaffold)
      return spec
    if self._tower0 is None or (self._tower0[0](), self._tower0[1]) != (
        graph, mode):
      raise ValueError(f'Tower {context.index} of a SavedModelEstimator was '
                       'built before tower 0 of its graph; build tower 0 '
                       'first.')
    return self._later_tower(graph, features, labels, mode)

  def _state_of_tower0(self, graph, mode) -> Dict[str, tf.Tensor]:
    """Tower 0's tensors of the SavedModel's state handles, by name."""
    found, ops = {}, []
    for node in _state_nodes(self._meta_graph(mode).graph_def):
      try:
        op = graph.get_operation_by_name(node.name)
      except KeyError:
        op = None
      if op is None or op.type != node.op:
        raise ValueError(
            f'Tower 0 imported {node.name!r} ({node.op}) of the SavedModel '
            'under another name: an op of the input_fn has that name. Give '
            'the input_fn ops other names (e.g. build them under '
            'tf.name_scope("input")).')
      ops.append(op.name)
      for i, tensor in enumerate(op.outputs):
        found[f'{node.name}:{i}'] = tensor
    variable_sharing.share_imported(graph, ops)
    return found

  def _meta_graph(self, mode):
    return self._estimator._get_meta_graph_def_for_mode(mode)  # pylint: disable=protected-access

  def _later_tower(self, graph, features, labels, mode):
    """Imports the graph's ops again, their state mapped to tower 0's."""
    _, _, state, scaffold = self._tower0
    signature = self._estimator._get_signature_def_for_mode(mode)  # pylint: disable=protected-access
    input_map = dict(state)
    input_map.update(sme_lib._generate_input_map(  # pylint: disable=protected-access
        signature, features, labels))
    names = [info.name for info in signature.outputs.values()]
    # The import adds its copies to the graph's collections (variables,
    # the main op, the train_op): one device's collections are tower 0's.
    saved = {key: list(graph.get_collection(key))
             for key in graph.get_all_collection_keys()}
    # Not the loader's load_graph: the Saver it builds for a named scope
    # renames the loader's own SaverDef, which tower 0's scaffold restores
    # with.
    _, outputs = meta_graph.import_scoped_meta_graph_with_return_elements(
        self._meta_graph(mode), input_map=input_map, return_elements=names)
    for key in graph.get_all_collection_keys():
      graph.get_collection_ref(key)[:] = saved.get(key, [])
    by_name = dict(zip(names, outputs))
    loss, predictions, metrics = sme_lib._validate_and_extract_outputs(  # pylint: disable=protected-access
        mode, {k: by_name[v.name] for k, v in signature.outputs.items()},
        signature.method_name)
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, predictions=predictions, eval_metric_ops=metrics,
        scaffold=scaffold)


def _args(fn) -> frozenset:
  return frozenset(function_utils.fn_args(fn))


def _state_nodes(graph_def) -> List[Any]:
  """The nodes that make state (a variable, a table): those whose op is
  stateful and outputs a resource handle or a reference."""
  found = []
  for node in graph_def.node:
    op_def = op_def_registry.get(node.op)
    if op_def is None or not op_def.is_stateful or node.input:
      continue
    if any(arg.is_ref or arg.type == tf.resource.as_datatype_enum
           for arg in op_def.output_arg):
      found.append(node)
  return found
