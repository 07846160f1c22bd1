"""Tokenised rows, padded batches and each rank's share of them.

Contracts:
- a row: ``{"input_ids": [T] int64, "loss_mask": [T] bool, "source": str, "row": int}``, optionally
  ``"hidden_states": [T, D]`` float (the target's last hidden states, cached), ``"target_features": [T, K*D]``
  (outputs of K target layers, for DFlash and EAGLE-3) and ``"layer_input": [T, D]`` (the input of the first
  layer Medusa's stage 2 trains);
- a batch: ``input_ids`` [B, T] int64, ``attention_mask`` [B, T] int64, ``loss_mask`` [B, T] bool, and
  ``hidden_states`` [B, T, D] / ``target_features`` [B, T, K*D] / ``layer_input`` [B, T, D] when the rows carry
  them; right padding (positions unchanged).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import torch

from draftheads.data.templates import TemplateRejected, chat_tokens


@dataclass
class DataReport:
    """What happened to the rows, printed and logged: every input row is either out (trained on or held out)
    or counted under one reason."""
    rows_in: int = 0
    rows_out: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Bad input by reason (invalid_json, unknown_role, template_rejected, too_long...)."""
    failed: int = 0
    """Conversations the regeneration backend failed on (retried by the next run)."""
    truncated: int = 0
    unfinished_answers: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    length_percentiles: dict[str, int] = field(default_factory=dict)
    """Row lengths in tokens after truncation: p50, p90, p99, max."""
    padding_fraction: float | None = None
    """Share of pad tokens in the length-grouped training batches (set by the job, which knows the batch)."""
    examples: dict[str, str] = field(default_factory=dict)
    """The first error message of each skip reason."""

    @property
    def trainable_fraction(self) -> float:
        return self.trainable_tokens / max(self.tokens, 1)

    def as_dict(self) -> dict:
        """The report for ``report.json``."""
        return {**asdict(self), "trainable_fraction": self.trainable_fraction}

    def skip(self, reason: str, message: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.examples.setdefault(reason, message)

    def describe(self) -> str:
        """One line for the terminal."""
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        pad = "" if self.padding_fraction is None else f", padding {self.padding_fraction:.1%}"
        return (f"{self.rows_in} rows in -> {self.rows_out} out, skipped: {skipped}; failed {self.failed}, "
                f"truncated {self.truncated}, unfinished answers {self.unfinished_answers}; {self.tokens} tokens, "
                f"{self.trainable_fraction:.1%} trainable; lengths {self.length_percentiles}{pad}")


def rows_from_chats(tokenizer, chats: list, max_length: int, report: DataReport, train_on: str = "all",
                    overlong: str = "truncate") -> list[dict]:
    """Rows of token ids and the loss mask over assistant tokens (:func:`data.templates.chat_tokens`), or the
    given ids and mask of pre-tokenised chats.

    ``chats`` are :class:`~data.regenerate.Regenerated` (``unfinished`` answers train without an end-of-turn
    token) or :class:`~data.conversations.Chat`. A row longer than ``max_length`` is truncated (``overlong``
    = truncate; kept when >= 2 trainable tokens remain) or dropped, and counted; a conversation the template
    rejects is skipped and counted. Raises ``ValueError`` when no trainable token is left (a silent zero loss
    otherwise) or ``overlong`` is not truncate/drop.
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"data.overlong={overlong!r} must be truncate or drop")
    rows, lengths = [], []
    for c in chats:
        where = f"{c.source} row {c.row}"
        if getattr(c, "tokens", None) is not None:
            ids, mask = list(c.tokens[0]), list(c.tokens[1])
            if max(ids) >= len(tokenizer):
                report.skip("bad_tokens", f"{where}: field 'input_ids': id {max(ids)} is outside the tokenizer's "
                                          f"{len(tokenizer)} tokens (tokenised for another model?)")
                continue
        else:
            try:
                ids, mask = chat_tokens(tokenizer, c.messages, train_on, frozenset(getattr(c, "unfinished", ())))
            except TemplateRejected as e:
                report.skip("template_rejected", f"{where}: {e}")
                continue
            report.unfinished_answers += len(getattr(c, "unfinished", ()))
        if not any(mask):
            report.skip("no_trainable_token", f"{where}: no assistant token to train on")
            continue
        if len(ids) > max_length:
            if overlong == "drop" or sum(mask[:max_length]) < 2:
                report.skip("too_long", f"{where}: {len(ids)} tokens > data.max_length={max_length}")
                continue
            report.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        rows.append({"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask), "source": c.source,
                     "row": c.row})
        lengths.append(len(ids))
        report.tokens += len(ids)
        report.trainable_tokens += sum(mask)
    report.rows_out += len(rows)
    if lengths:
        q = torch.tensor(lengths, dtype=torch.float).quantile(torch.tensor([0.5, 0.9, 0.99])).round().int().tolist()
        report.length_percentiles = {"p50": q[0], "p90": q[1], "p99": q[2], "max": max(lengths)}
    if not rows or report.trainable_tokens == 0:
        raise ValueError(f"no trainable (assistant) token left in {len(chats)} conversations: "
                         f"{report.describe()}; first errors: {report.examples}")
    return rows


def data_scalars(report: DataReport) -> dict[str, float]:
    """The data report as tracker scalars: counts, skips by reason, length percentiles, fractions."""
    out = {k: getattr(report, k) for k in ("rows_in", "rows_out", "failed", "truncated", "unfinished_answers",
                                            "tokens", "trainable_tokens", "trainable_fraction")}
    out |= {f"skipped_{k}": v for k, v in report.skipped.items()}
    out |= {f"length_{k}": v for k, v in report.length_percentiles.items()}
    if report.padding_fraction is not None:
        out["padding_fraction"] = report.padding_fraction
    return out


def padding_fraction(rows: list[dict], batch_size: int, seed: int) -> float:
    """Share of pad tokens in the first epoch's length-grouped batches of ``rows``."""
    batches = epoch_batches(rows, batch_size, seed, 0)
    real = sum(len(r["input_ids"]) for b in batches for r in b)
    padded = sum(len(b) * max(len(r["input_ids"]) for r in b) for b in batches)
    return 1 - real / max(padded, 1)


PER_TOKEN_STATES = ("hidden_states", "target_features", "layer_input")
"""Optional cached target states of a row, ``[T, D]`` / ``[T, K*D]`` / ``[T, D]``, padded with zeros by
:func:`collate`."""


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
