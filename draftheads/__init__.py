"""draftheads: train speculative-decoding draft models, measure them as servers count, export them.

One import namespace, layered from the bottom up (``tests/test_architecture.py`` fixes the direction):

- ``draftheads.packaged``: files shipped inside installed packages (the offline corpora).
- ``draftheads.models`` (folder ``models/``): the target, speculative decoding (chain, tree), strict tensor checks.
- ``draftheads.data`` (folder ``data/``): prompt sources, conversations, chat templates and loss masks,
  regeneration by the target, rows and batches, target states in memory and on disk.
- ``draftheads.training``: the training spine (one loop, strategies), checkpoints, rank-aware runtime,
  sharding engines, typed configs, opening a job and its rows. ``draftheads.evaluation``: the speculative
  evaluator, its report, and the vLLM side of parity.
- ``draftheads.drafters``: one folder per drafter (module, training strategies, validation, exports, peers,
  what it saves) behind a :class:`~draftheads.training.recipe.Recipe` (a base with defaults;
  :class:`~draftheads.training.recipe.FeatureRecipe` for drafters on target layers), and the registry.
- ``draftheads.jobs``: what the entry scripts run (train, evaluate, export, cache states, parity,
  regenerate), asking the registry which drafter a run is.

The entry scripts (``train/*.py``) are thin doors into ``draftheads.jobs``; no library module imports them.
"""
