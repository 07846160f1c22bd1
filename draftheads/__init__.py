"""draftheads: train speculative-decoding draft models, measure them as servers count, export them.

One import namespace, layered from the bottom up (``tests/test_architecture.py`` fixes the direction):

- ``draftheads.packaged``: files shipped inside installed packages (the offline corpora).
- ``draftheads.models`` (folder ``models/``): the target, speculative decoding (chain, tree), strict tensor checks.
- ``draftheads.data`` (folder ``data/``): prompt sources, conversations, chat templates and loss masks,
  regeneration by the target, rows and batches, target states in memory and on disk.
- ``draftheads.training``: the training spine (one loop, strategies), checkpoints, a run's resume ledger,
  rank-aware runtime, sharding engines, typed configs. ``draftheads.evaluation``: the speculative
  evaluator, its report, and the vLLM side of parity.
- ``draftheads.drafters``: one folder per drafter (module, training strategies, validation, exports, peers,
  what it saves) behind a :class:`~draftheads.drafters.contract.Recipe`: its declaration
  (:class:`~draftheads.drafters.spec.DrafterSpec`) and its training, artifacts and serving behaviours (defaults in
  the base; :class:`~draftheads.drafters.contract.FeatureRecipe` for drafters on target layers), and the registry.
- ``draftheads.runs``: a training run's life in one module (``runs/life.py``: open, train, finish, evaluate,
  close) for any registered drafter, with its output folder, rows, serving preflight, and finished and peer
  runs read back beside it.
- ``draftheads.jobs``: the other tools (evaluate, export, cache states, parity, regenerate), each a function and
  its command line, asking the registry which drafter a run is.

The entry scripts (``train/*.py``) are thin doors into ``draftheads.runs.life`` (the training jobs) and
``draftheads.jobs`` (the other tools); no library module imports them.
"""
