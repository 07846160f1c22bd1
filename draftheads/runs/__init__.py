"""A training run, from opening its folder to closing it: :mod:`~draftheads.runs.life` (open, train, finish,
evaluate, close, read top to bottom) and what it needs beside it: claiming the output folder
(:mod:`~draftheads.runs.output_dir`), the rows and their target states (:mod:`~draftheads.runs.rows`), the
serving preflight and the vLLM environment (:mod:`~draftheads.runs.preflight`), finished and peer runs read back
(:mod:`~draftheads.runs.saved`). Which steps a run finished is its ledger, :mod:`draftheads.run_folder`."""
