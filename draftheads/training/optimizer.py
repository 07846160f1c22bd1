"""The optimizer the spine steps (``trainer.optimizer``): AdamW, or Muon on hidden weight matrices with AdamW on
the rest.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
https://kellerjordan.github.io/posts/muon/) orthogonalises each 2-D weight matrix's momentum with a Newton-Schulz
iteration; it is meant for hidden layers only, so embeddings, LM heads, norms and biases stay with AdamW, as in
Keller Jordan's reference code, Moonshot's (Liu et al. 2025, "Muon is scalable for LLM training", arXiv
2502.16982) and speculators (which also leave ``[1, N]`` vectors to AdamW). Its learning rate is scaled per
matrix by ``0.2 * sqrt(max(A, B))`` (torch's ``adjust_lr_fn="match_rms_adamw"``, after Liu et al.): the
update's RMS then matches AdamW's typical 0.2-0.4, so ``trainer.lr``, ``trainer.weight_decay`` and the schedule
mean the same for both optimizers.
"""

from __future__ import annotations

import torch
from torch import nn

from draftheads.training.config import Optimizer
from draftheads.training.lm_head_loss import LMHead


def make_optimizer(trainer, module: nn.Module, groups: list[dict], sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``trainer.optimizer`` names over a strategy's parameter groups.

    Args:
        trainer: ``TrainerConfig`` (``optimizer``, ``weight_decay``).
        module: the strategy's module, whose registered submodules say which parameters are embeddings or LM
            heads (:func:`muon_params`).
        groups: the strategy's ``param_groups(lr)``: dicts of ``params`` and ``lr`` (each group keeps its lr on
            both optimizers: Medusa stage 2's backbone scale).
        sharded: the module trains under FSDP or DeepSpeed (:func:`~draftheads.training.sharding.sharded`).
    Returns:
        ``torch.optim.AdamW`` (adamw), or a :class:`MuonWithAdamW` (muon).
    Raises:
        ValueError: as :func:`check_optimizer`; an ``auto`` not settled.
    """
    check_optimizer(trainer.optimizer, sharded)
    if Optimizer(trainer.optimizer) == Optimizer.auto:
        raise ValueError("trainer.optimizer=auto is settled when the job opens "
                         "(draftheads.training.runtime.settle_optimizer); settle it before making the optimizer")
    if Optimizer(trainer.optimizer) == Optimizer.adamw:
        return torch.optim.AdamW(groups, weight_decay=trainer.weight_decay)
    hidden = {id(p) for p in muon_params(module)}
    adamw = torch.optim.AdamW([{**g, "params": [p for p in g["params"] if id(p) not in hidden]} for g in groups],
                              weight_decay=trainer.weight_decay)
    muon = torch.optim.Muon([{**g, "params": [p for p in g["params"] if id(p) in hidden]} for g in groups],
                            weight_decay=trainer.weight_decay, adjust_lr_fn="match_rms_adamw")
    return MuonWithAdamW(adamw, muon)


def check_optimizer(optimizer: str, sharded: bool) -> None:
    """Raise before any work if ``trainer.optimizer`` cannot train here (called again when the run starts, before
    the target loads: :func:`~draftheads.training.runtime.make_accelerator`).

    Raises:
        ValueError: ``optimizer`` is not an :class:`~draftheads.training.config.Optimizer` word; muon with
            ``sharded`` (FSDP or DeepSpeed): DeepSpeed hands the optimizer flat 1-D partitions, which Muon cannot
            take, and FSDP2 DTensor shards, on which it is untested here.
    """
    if Optimizer(optimizer) == Optimizer.muon and sharded:
        raise ValueError("trainer.optimizer=muon is not supported under FSDP or DeepSpeed (Muon orthogonalises whole "
                         "weight matrices; these engines hand the optimizer shards): train with DDP or one process, "
                         "or with trainer.optimizer=adamw (EAGLE-3's job defaults to muon)")


def muon_params(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s hidden weight matrices, which Muon trains: its 2-D parameters but vectors (``[1, N]``, ``[N, 1]``:
    nothing to orthogonalise) and those of an ``nn.Embedding``, an :class:`~draftheads.training.lm_head_loss.LMHead`
    or a module named ``lm_head*`` (a target's LM head in a trained layer stack), identified by module, not by
    shape (a head may be square)."""
    head_or_table = {id(p) for name, m in module.named_modules()
                     if isinstance(m, (nn.Embedding, LMHead)) or any(s.startswith("lm_head") for s in name.split("."))
                     for p in m.parameters()}
    return [p for p in module.parameters() if p.ndim == 2 and min(p.shape) > 1 and id(p) not in head_or_table]


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` and ``torch.optim.Muon`` stepped as one optimizer: accelerate prepares and checkpoints
    one, and the LR scheduler takes one.

    ``param_groups`` are AdamW's groups then Muon's (one each per strategy group, possibly empty), the very dicts
    the two step with, so a scheduler setting a group's ``lr`` sets it where it is read; logged ``lr_group{i}``
    keep AdamW's numbering. ``state_dict`` is ``{"adamw": ..., "muon": ...}``, the two optimizers' own (each
    parameter's AdamW moments and step, or Muon momentum buffer), and loads back exactly; ``state`` is unused.
    """

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon):
        self.adamw, self.muon = adamw, muon
        super().__init__(adamw.param_groups + muon.param_groups, {})  # checks them (no parameter in two groups)
        self.param_groups = adamw.param_groups + muon.param_groups

    def step(self, closure=None):
        loss = self.adamw.step(closure)  # a closure runs once, before either update
        self.muon.step()
        return loss

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])
        self.param_groups = self.adamw.param_groups + self.muon.param_groups  # loading made new group dicts
