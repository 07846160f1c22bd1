"""Tokenised rows, padded batches and each rank's share of them.

Contracts:
- a row: ``{"input_ids": [T] int64, "loss_mask": [T] bool, "source": str, "row": int}``, optionally
  ``"thinking": bool`` (the thinking mode it was rendered and answered in, ``data.thinking_fraction``),
  ``"hidden_states": [T, D]`` float (the target's last hidden states, cached), ``"target_features": [T, K*D]``
  (outputs of K target layers, for DFlash and EAGLE-3) and ``"layer_input": [T, D]`` (the input of the first
  layer Medusa's stage 2 trains);
- a batch: ``input_ids`` [B, T] int64, ``attention_mask`` [B, T] int64, ``loss_mask`` [B, T] bool, and
  ``hidden_states`` [B, T, D] / ``target_features`` [B, T, K*D] / ``layer_input`` [B, T, D] when the rows carry
  them; right padding (positions unchanged);
- a packed batch (:func:`pack`): the same keys for ``B = 1`` without padding and without ``attention_mask``, plus
  ``position_ids`` [1, N] restarting at 0 per row and ``documents`` [1, N] (each token's row in the batch).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field

import torch

from draftheads.data.sources import row_location
from draftheads.data.templates import THINKING_LABELS, TemplateRejected, chat_tokens


@dataclass
class DataReport:
    """What happened to the rows, printed and logged: every input row is either out (trained on or held out),
    left out of the processes' equal shares, or counted under one reason."""
    rows_in: int = 0
    rows_out: int = 0
    rows_left_out: int = 0
    """Training rows beyond the processes' equal shares (:func:`rank_shard`), trained by none (set by the job,
    which knows the number of processes)."""
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
    """Share of pad tokens in the training micro-batches: length-grouped padded ones, or 0 when packed (set by the
    job, which knows the batches)."""
    examples: dict[str, str] = field(default_factory=dict)
    """The first error message of each skip reason."""
    thinking_modes: dict[str, int] = field(default_factory=dict)
    """Rows made in each thinking mode (``thinking``, ``no_thinking``), training and validation together, when
    ``data.thinking_fraction`` is set; empty for the template's default rendering."""
    self_made: dict = field(default_factory=dict)
    """Prompts the target wrote itself (``data.source=self_made``), by source file: ``made`` (candidates
    sampled), ``kept`` (passed the filters), ``used`` (the rows asked for), ``dropped`` by filter,
    ``distinct_bigrams`` of the used (:mod:`draftheads.data.self_made`)."""
    near_eval: dict = field(default_factory=dict)
    """Training prompts that near-duplicate a prompt of the job's eval sets: ``count`` and the first ``examples``
    (set by the job, which holds both)."""

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
        left = f" + {self.rows_left_out} left out (beyond the processes' equal shares)" if self.rows_left_out else ""
        modes = ", ".join(f"{k} {v}" for k, v in sorted(self.thinking_modes.items()))
        modes = f"; rows per mode: {modes}" if modes else ""
        made = "".join(f"; self-made {m['used']} used, {m['kept']} kept of {m['made']} sampled (dropped: "
                       f"{', '.join(f'{k} {v}' for k, v in sorted(m['dropped'].items())) or 'none'}; distinct "
                       f"bigrams {m['distinct_bigrams']:.2f})" for m in self.self_made.values())
        near = f"; {self.near_eval['count']} near-duplicate an eval prompt" if self.near_eval.get("count") else ""
        return (f"{self.rows_in} rows in -> {self.rows_out} out{left}, skipped: {skipped}; failed {self.failed}, "
                f"truncated {self.truncated}, unfinished answers {self.unfinished_answers}; {self.tokens} tokens, "
                f"{self.trainable_fraction:.1%} trainable; lengths {self.length_percentiles}{pad}{modes}{made}{near}")


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
        where = row_location(c.source, c.row)
        if getattr(c, "tokens", None) is not None:
            ids, mask = list(c.tokens[0]), list(c.tokens[1])
            if max(ids) >= len(tokenizer):
                report.skip("bad_tokens", f"{where}: field 'input_ids': id {max(ids)} is outside the tokenizer's "
                                          f"{len(tokenizer)} tokens (tokenised for another model?)")
                continue
        else:
            try:
                ids, mask = chat_tokens(tokenizer, c.messages, train_on, frozenset(getattr(c, "unfinished", ())),
                                        getattr(c, "thinking", None))
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
        thinking = getattr(c, "thinking", None)
        if thinking is not None:
            rows[-1]["thinking"] = thinking
            label = THINKING_LABELS[thinking]
            report.thinking_modes[label] = report.thinking_modes.get(label, 0) + 1
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
    out = {k: getattr(report, k) for k in ("rows_in", "rows_out", "rows_left_out", "failed", "truncated",
                                            "unfinished_answers", "tokens", "trainable_tokens", "trainable_fraction")}
    out |= {f"skipped_{k}": v for k, v in report.skipped.items()}
    out |= {f"length_{k}": v for k, v in report.length_percentiles.items()}
    out |= {f"rows_{k}": v for k, v in report.thinking_modes.items()}
    if report.padding_fraction is not None:
        out["padding_fraction"] = report.padding_fraction
    return out


def padding_fraction(rows: list[dict], batch_size: int, seed: int, packed: bool = False) -> float:
    """Share of pad tokens in the first epoch's length-grouped batches of ``rows`` (0 when ``packed``)."""
    if packed:
        return 0.0
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


def pack(rows: list[dict], pad_token_id: int | None = None) -> dict[str, torch.Tensor]:
    """Rows packed into one sequence without padding (see the module docstring for keys and shapes). There is
    no ``attention_mask``: given ``position_ids`` that restart per row and no mask, transformers builds the
    block-diagonal causal mask itself (``masking_utils.find_packed_sequence_indices``; flash-attention's varlen
    path reads the same positions), so attention never crosses rows. ``pad_token_id`` is unused (the
    signature of :func:`collate`)."""
    batch = {"input_ids": torch.cat([r["input_ids"] for r in rows])[None],
             "position_ids": torch.cat([torch.arange(len(r["input_ids"])) for r in rows])[None],
             "loss_mask": torch.cat([r["loss_mask"] for r in rows])[None],
             "documents": torch.cat([torch.full((len(r["input_ids"]),), i) for i, r in enumerate(rows)])[None]}
    for k in PER_TOKEN_STATES:
        if k in rows[0]:
            batch[k] = torch.cat([r[k] for r in rows])[None]
    return batch


def unpack(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The padded batch of a packed batch's rows (:func:`pack` -> :func:`collate`'s layout, pad id 0: padding is
    masked): one row per line, in order, right-padded with zeros, with ``attention_mask``; every ``[1, N, ...]``
    tensor of the batch carried (cached states, or features computed on the packed sequence), ``documents`` and
    ``position_ids`` dropped. For drafters whose own attention is per row (DFlash's blocks, EAGLE-3's unrolled
    steps): on a packed sequence their dense masks would score every row against every other. Their batches are
    planned with ``lines`` (:class:`BatchPlan`), so the lines stay within the token budget."""
    documents = batch["documents"][0]
    lengths = torch.bincount(documents)
    column = torch.arange(len(documents), device=documents.device) - (lengths.cumsum(0) - lengths)[documents]
    lines = (len(lengths), int(lengths.max()))
    out = {}
    for key, x in batch.items():
        if key not in ("documents", "position_ids"):
            out[key] = x.new_zeros(*lines, *x.shape[2:])
            out[key][documents, column] = x[0]
    out["attention_mask"] = torch.zeros(lines, dtype=torch.long, device=documents.device)
    out["attention_mask"][documents, column] = 1
    return out


def token_batches(rows: list[dict], tokens_per_batch: int, seed: int, epoch: int,
                  lines: bool = False) -> list[list[dict]]:
    """Batches of at most ``tokens_per_batch`` tokens (a longer row alone), in an order fixed by ``(seed,
    epoch)``: rows are shuffled, taken in windows of about 8 batches' tokens, packed first-fit by decreasing
    length inside a window (few tokens short of the budget), and the batches shuffled. With ``lines`` (for a
    drafter that reads the rows one per line, :func:`unpack`) a batch's rows times its longest row also stay
    within the budget, so the padded lines do: rows of like length go together."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(rows)))
    rng.shuffle(order)
    length = [len(r["input_ids"]) for r in rows]
    batches, window, held = [], [], 0
    for n, i in enumerate(order):
        window.append(i)
        held += length[i]
        if held >= 8 * tokens_per_batch or n == len(order) - 1:
            bins: list[list] = []  # [tokens, row indices], the longest row first
            for j in sorted(window, key=lambda j: -length[j]):
                fit = next((b for b in bins if b[0] + length[j] <= tokens_per_batch
                            and not (lines and (len(b[1]) + 1) * length[b[1][0]] > tokens_per_batch)), None)
                if fit is None:
                    fit = [0, []]
                    bins.append(fit)
                fit[0] += length[j]
                fit[1].append(j)
            batches += [[rows[j] for j in b] for _, b in bins]
            window, held = [], 0
    rng.shuffle(batches)
    return batches


class BatchPlan:
    """This process's micro-batches, epoch after epoch, fixed by the seed so a resumed run replays them: its
    share of the rows (:func:`rank_shard`) in length-grouped batches of ``batch_size`` rows (padded), or with
    ``tokens_per_batch`` in packed batches of that many tokens (:func:`token_batches`, :func:`pack`; ``lines``:
    rows times the longest row within it too, for drafters that :func:`unpack`).

    Every process runs the same number of micro-batches per epoch, or collectives would wait forever: packed,
    each process packs every process's share (lengths only), and a share packed into fewer batches than the
    most splits its batches of most rows in two until it has as many (:func:`_stretch`); only when that cannot
    reach the count (every batch a single row) are the last batches of the others left out that epoch."""

    def __init__(self, rows: list[dict], rank: int, world_size: int, batch_size: int, tokens_per_batch: int | None,
                 seed: int, lines: bool = False):
        self.shards = [rank_shard(rows, r, world_size) for r in range(world_size)]
        self.rank, self.batch_size, self.tokens_per_batch, self.seed = rank, batch_size, tokens_per_batch, seed
        self.lines = lines
        self.packed = tokens_per_batch is not None
        self._epoch: tuple[int, list[list[dict]]] = (-1, [])
        self._counts: dict[int, int] = {}

    def _batches(self, shard: list[dict], epoch: int) -> list[list[dict]]:
        if self.packed:
            return token_batches(shard, self.tokens_per_batch, self.seed, epoch, self.lines)
        return epoch_batches(shard, self.batch_size, self.seed, epoch)

    def count(self, epoch: int) -> int:
        """Micro-batches per process in ``epoch``."""
        if epoch not in self._counts:
            shards = self.shards if self.packed else self.shards[:1]  # padded shares all cut alike
            planned = [self._batches(s, epoch) for s in shards]
            most = max(len(b) for b in planned)
            self._counts[epoch] = min(len(_stretch(b, most)) for b in planned)
        return self._counts[epoch]

    def epoch(self, epoch: int) -> list[list[dict]]:
        """This process's micro-batches of ``epoch`` (rows each)."""
        if self._epoch[0] != epoch:
            count = self.count(epoch)
            self._epoch = (epoch, _stretch(self._batches(self.shards[self.rank], epoch), count)[:count])
        return self._epoch[1]

    def total(self, epochs: float) -> int:
        """Micro-batches in ``epochs`` (a fraction of the last epoch counts its share), at least 1."""
        whole = int(epochs)
        part = round((epochs - whole) * self.count(whole), 6)  # 2.3 - 2 is 0.2999..: 3 of 10, not 2
        return max(1, sum(self.count(e) for e in range(whole)) + int(part))

    def locate(self, micro: int) -> tuple[int, int]:
        """``(epoch, index)`` of micro-batch number ``micro`` (0-based, counted from the stage's start)."""
        epoch = 0
        while micro >= self.count(epoch):
            micro -= self.count(epoch)
            epoch += 1
        return epoch, micro

    def collate(self, rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
        """The micro-batch of ``rows``: packed or right-padded."""
        return (pack if self.packed else collate)(rows, pad_token_id)


def _stretch(batches: list[list[dict]], count: int) -> list[list[dict]]:
    """``batches`` with the one of most rows split in two halves, again and again, until there are ``count``
    (or every batch is a single row)."""
    batches = list(batches)
    while len(batches) < count:
        i = max(range(len(batches)), key=lambda j: len(batches[j]))
        if len(batches[i]) < 2:
            break
        half = len(batches[i]) // 2
        batches[i:i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


def rows_sha256(rows: list[dict]) -> str:
    """sha256 of every row's ``input_ids`` and thinking mode (when the row has one) in order: what a state cache
    and a checkpoint were made for. A row in another mode trains other tokens, so a cache or checkpoint made
    for another ``data.thinking_fraction`` is refused, not reused."""
    data = hashlib.sha256()
    for r in rows:
        mode = {True: b"T", False: b"N"}.get(r.get("thinking"), b"")  # rows without a mode hash as before
        data.update(torch.as_tensor(r["input_ids"]).numpy().astype("int64").tobytes() + mode + b"|")
    return data.hexdigest()


def rank_shard(rows: list, rank: int, world_size: int) -> list:
    """This rank's fixed share of ``rows``: every rank gets ``len(rows) // world_size`` rows (the remainder
    is left out, so every rank runs the same number of steps and no collective waits forever; the job counts it
    in :attr:`DataReport.rows_left_out`). Raises ``ValueError`` when there are fewer rows than ranks."""
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
