"""Tokenised rows, padded batches and each rank's share of them.

Contracts:
- a row: ``{"input_ids": [T] int64, "loss_mask": [T] bool, "source": str, "row": int}``, optionally
  ``"hidden_states": [T, D]`` float (the target's last hidden states, cached) and/or
  ``"target_features": [T, K*D]`` (outputs of K target layers, for DFlash);
- a batch: ``input_ids`` [B, T] int64, ``attention_mask`` [B, T] int64, ``loss_mask`` [B, T] bool, and
  ``hidden_states`` [B, T, D] / ``target_features`` [B, T, K*D] when the rows carry them; right padding
  (positions unchanged).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from data.regenerate import Response


@dataclass
class DataReport:
    """Counts of what happened to the rows (printed and logged)."""
    rows_in: int = 0
    rows_out: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    unfinished_responses: int = 0
    tokens: int = 0
    trainable_tokens: int = 0


def rows_from_responses(responses: list[Response], max_length: int) -> tuple[list[dict], DataReport]:
    """Rows of prompt + response tokens with the loss on response tokens only.

    A row longer than ``max_length`` tokens is truncated when its prompt fits with room for >= 2 response
    tokens (the loss then covers the kept part), dropped otherwise; both are counted.
    Raises ``ValueError`` when no trainable token is left (a silent zero loss otherwise).
    """
    report = DataReport(rows_in=len(responses))
    rows = []
    for r in responses:
        report.unfinished_responses += not r.finished
        ids = r.prompt_ids + r.response_ids
        if len(ids) > max_length:
            if len(r.prompt_ids) + 2 > max_length:
                report.dropped_too_long += 1
                continue
            report.truncated += 1
        mask = [False] * len(r.prompt_ids) + [True] * len(r.response_ids)
        ids, mask = ids[:max_length], mask[:max_length]
        rows.append({"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask), "source": r.source,
                     "row": r.row})
        report.tokens += len(ids)
        report.trainable_tokens += sum(mask)
    report.rows_out = len(rows)
    if report.trainable_tokens == 0:
        raise ValueError(f"no trainable (assistant) token in {report.rows_in} rows: {report}")
    return rows, report


PER_TOKEN_STATES = ("hidden_states", "target_features")
"""Optional cached target states of a row, ``[T, D]`` / ``[T, K*D]``, padded with zeros by :func:`collate`."""


def collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows into a batch (see the module docstring for keys and shapes)."""
    width = max(len(r["input_ids"]) for r in rows)
    B = len(rows)
    batch = {"input_ids": torch.full((B, width), pad_token_id, dtype=torch.long),
             "attention_mask": torch.zeros((B, width), dtype=torch.long),
             "loss_mask": torch.zeros((B, width), dtype=torch.bool)}
    states = [k for k in PER_TOKEN_STATES if k in rows[0]]
    for k in states:
        batch[k] = rows[0][k].new_zeros((B, width, rows[0][k].shape[-1]))
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = r["input_ids"]
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = r["loss_mask"]
        for k in states:
            batch[k][i, :n] = r[k]
    return batch


def rank_shard(rows: list, rank: int, world_size: int) -> list:
    """This rank's fixed share of ``rows``: every rank gets ``len(rows) // world_size`` rows (the remainder
    is left out, so every rank runs the same number of steps and no collective waits forever)."""
    per_rank = len(rows) // world_size
    if per_rank == 0:
        raise ValueError(f"{len(rows)} rows cannot be shared by {world_size} processes")
    return rows[rank * per_rank:(rank + 1) * per_rank]


def epoch_batches(rows: list[dict], batch_size: int, seed: int, epoch: int) -> list[list[dict]]:
    """Length-grouped batches of ``rows`` in an order fixed by ``(seed, epoch)``.

    Rows are shuffled, grouped in windows of 8 batches, sorted by length inside a window (less padding),
    cut into batches, and the batches shuffled. Deterministic, so a resumed run replays the same order.
    """
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(rows)))
    rng.shuffle(order)
    window = batch_size * 8
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: len(rows[i]["input_ids"]))
        batches += [[rows[i] for i in chunk[b:b + batch_size]] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
