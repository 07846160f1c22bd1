"""Everything about data: sources of prompts, self-distillation by the target, tokenised rows, batches and
cached hidden states. Rows and batches follow the contracts in ``data/batching.py``."""
