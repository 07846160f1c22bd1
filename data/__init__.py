"""Everything about data: prompt sources (``sources``), rows of any chat format normalised with bad input
counted (``conversations``), chat templates and assistant-token masks (``templates``), self-distillation by
the target (``regenerate``), the path from a data config to rows (``pipeline``), rows, batches and the data
report (``batching``), and cached hidden states. Rows and batches follow the contracts in
``data/batching.py``."""
