"""The servers: which loads which export (``matrix``), vLLM's environment, source probe and runner, parity with
the evaluator, and what the serving preflight compares. ``docs/extending.md``, "Adding a server"."""
