"""``trainer.optimizer``: adamw is torch's AdamW as before; muon puts exactly the hidden weight matrices under
torch's Muon (orthogonalised updates at AdamW's RMS) and the rest under AdamW, keeps each group's lr under the
schedule, and its state round-trips, through the spine's checkpoints too, to bit-identical steps."""

import io
import math

import pytest
import torch
from accelerate import Accelerator
from hydra.errors import ConfigCompositionException
from torch import nn
from transformers import get_cosine_schedule_with_warmup

from draftheads.training.checkpoint import complete_checkpoints
from draftheads.training.config import Optimizer, StageConfig, TrainerConfig, to_schema
from draftheads.training.lm_head_loss import LMHead
from draftheads.training.optimizer import MuonWithAdamW, make_optimizer
from draftheads.training.spine import fit
from tests.helpers import smoke


class TinyDrafter(nn.Module):
    """A drafter's kinds of parameters: an embedding table, an input projection, a layer's projections (with a
    bias), a gate to one output (a ``[1, 8]`` vector), a norm, its own LM head, and a square projection named like a
    target's LM head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(32, 8)
        self.fc = nn.Linear(16, 8, bias=False)
        self.layer = nn.Module()
        self.layer.q_proj = nn.Linear(8, 8)
        self.layer.up_proj = nn.Linear(8, 12, bias=False)
        self.layer.gate = nn.Linear(8, 1, bias=False)
        self.norm = nn.LayerNorm(8)
        self.head = LMHead(8, 32, bias=False)
        self.lm_head = nn.Linear(8, 8, bias=False)

    def groups(self, lr: float) -> list[dict]:
        """Two groups at two rates, as Medusa stage 2 (heads, backbone at a scaled rate)."""
        head = [self.head.weight, self.lm_head.weight, self.norm.weight, self.norm.bias]
        return [{"params": head, "lr": lr}, {"params": [p for p in self.parameters() if all(p is not q for q in head)],
                                             "lr": lr / 10}]


def names(module: nn.Module, params: list) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in module.named_parameters() if id(p) in ids}


def test_muon_takes_exactly_the_hidden_matrices_and_each_group_keeps_its_lr():
    model = TinyDrafter()
    optimizer = make_optimizer(TrainerConfig(optimizer="muon", weight_decay=0.01), model, model.groups(1e-2))
    assert isinstance(optimizer, MuonWithAdamW)
    muon, adamw = optimizer.muon.param_groups, optimizer.adamw.param_groups
    assert [names(model, g["params"]) for g in muon] == [set(), {"fc.weight", "layer.q_proj.weight",
                                                                 "layer.up_proj.weight"}]
    assert [names(model, g["params"]) for g in adamw] == [
        {"head.weight", "lm_head.weight", "norm.weight", "norm.bias"},
        {"embed_tokens.weight", "layer.q_proj.bias", "layer.gate.weight"}]
    assert [g["lr"] for g in adamw] == [g["lr"] for g in muon] == [1e-2, 1e-3]
    assert {g["weight_decay"] for g in adamw + muon} == {0.01}
    assert {g["adjust_lr_fn"] for g in muon} == {"match_rms_adamw"}
    assert len(optimizer.param_groups) == 4 and all(a is b for a, b in zip(optimizer.param_groups, adamw + muon))


def test_adamw_is_torchs_adamw_over_the_strategy_groups():
    model = TinyDrafter()
    optimizer = make_optimizer(TrainerConfig(weight_decay=0.01), model, model.groups(1e-2))
    assert type(optimizer) is torch.optim.AdamW
    assert [names(model, g["params"]) for g in optimizer.param_groups] == [names(model, g["params"])
                                                                           for g in model.groups(1e-2)]
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(1e-2, 0.01), (1e-3, 0.01)]


def test_the_optimizer_is_a_choice_checked_when_the_config_is_composed(tmp_path):
    assert to_schema(smoke("medusa", tmp_path, tmp_path)).trainer.optimizer == Optimizer.adamw
    assert to_schema(smoke("medusa", tmp_path, tmp_path, "trainer.optimizer=muon")).trainer.optimizer == Optimizer.muon
    with pytest.raises(ConfigCompositionException) as error:
        smoke("medusa", tmp_path, tmp_path, "trainer.optimizer=adam")
    assert "expected one of [adamw, muon, auto]" in str(error.value.__cause__ or error.value)


def test_an_unknown_optimizer_and_muon_under_a_sharding_engine_are_refused():
    model = TinyDrafter()
    with pytest.raises(ValueError, match="trainer.optimizer=auto is settled when the job opens"):
        make_optimizer(TrainerConfig(optimizer="auto"), model, model.groups(1e-2))
    with pytest.raises(ValueError, match="'sgd' is not a valid Optimizer"):
        make_optimizer(TrainerConfig(optimizer="sgd"), model, model.groups(1e-2))
    with pytest.raises(ValueError, match="trainer.optimizer=muon is not supported under FSDP or DeepSpeed"):
        make_optimizer(TrainerConfig(optimizer="muon"), model, model.groups(1e-2), sharded=True)


def one_step(optimizer: str) -> tuple[TinyDrafter, TinyDrafter, torch.Tensor]:
    """The model before and after one step of ``optimizer`` at lr 1e-2 on fixed random gradients, and the
    gradient of ``layer.up_proj.weight`` ``[12, 8]``."""
    model = TinyDrafter()
    before = TinyDrafter()
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    make_optimizer(TrainerConfig(optimizer=optimizer), model, [{"params": list(model.parameters()), "lr": 1e-2}]).step()
    return before, model, model.layer.up_proj.weight.grad


def test_a_muon_step_orthogonalises_a_hidden_matrix_at_adamws_update_rms():
    """Muon moves ``up_proj`` by ``lr * 0.2 * sqrt(12)`` times the Newton-Schulz orthogonalisation of its gradient:
    singular values within Jordan's [0.5, 1.5] of its polar factor ``U V^T``, an RMS about 0.2 lr (Liu et al.);
    AdamW's first step is ``lr * sign(g)``, RMS lr, far from orthogonal. The AdamW side steps as AdamW does."""
    before, muon, grad = one_step("muon")
    _, adamw, _ = one_step("adamw")
    step = (before.layer.up_proj.weight - muon.layer.up_proj.weight).detach() / (1e-2 * 0.2 * math.sqrt(12))
    singular = torch.linalg.svdvals(step)
    assert 0.5 < singular.min() and singular.max() < 1.5
    u, _, vh = torch.linalg.svd(grad, full_matrices=False)
    assert torch.cosine_similarity(step.flatten(), (u @ vh).flatten(), dim=0) > 0.95
    rms = (before.layer.up_proj.weight - muon.layer.up_proj.weight).pow(2).mean().sqrt() / 1e-2
    assert 0.15 < rms < 0.25
    adam_step = (before.layer.up_proj.weight - adamw.layer.up_proj.weight).detach()
    torch.testing.assert_close(adam_step, 1e-2 * grad.sign(), rtol=1e-5, atol=1e-8)
    assert torch.linalg.svdvals(adam_step / 1e-2).max() > 2  # a sign matrix: not orthogonal
    for name in ("embed_tokens.weight", "head.weight", "lm_head.weight", "norm.bias", "layer.q_proj.bias",
                 "layer.gate.weight"):
        assert torch.equal(muon.get_parameter(name), adamw.get_parameter(name)), name


def train(model: TinyDrafter, optimizer, scheduler, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens, features = torch.randint(0, 32, (4,), generator=g), torch.randn(4, 16, generator=g)
        x = model.layer.q_proj(model.fc(features) + model.embed_tokens(tokens))
        h = model.norm(model.layer.up_proj(x)[:, :8] * model.layer.gate(x).sigmoid())
        (model.head(h).logsumexp(-1) + model.lm_head(h).pow(2).sum(-1)).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def fresh(lr: float = 1e-2):
    model = TinyDrafter()
    optimizer = make_optimizer(TrainerConfig(optimizer="muon", weight_decay=0.1), model, model.groups(lr))
    return model, optimizer, get_cosine_schedule_with_warmup(optimizer, 2, 8)


def test_a_muon_state_dict_round_trip_continues_with_bit_identical_steps():
    """Three steps, a save (through ``torch.save``/``torch.load(weights_only=True)``, as a checkpoint file), three
    more steps; a fresh model, optimizer and schedule loaded from the save take the very same three. A fresh
    optimizer that did not load the state does not (the momentum and moments matter). The rates change every
    step, so the scheduler must reach the loaded optimizers' own groups."""
    model, optimizer, scheduler = fresh()
    train(model, optimizer, scheduler, 3, seed=0)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               saved)
    train(model, optimizer, scheduler, 3, seed=1)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)

    resumed, optimizer2, scheduler2 = fresh(lr=5.0)  # its lr and state all come from the save
    resumed.load_state_dict(state["model"])
    optimizer2.load_state_dict(state["optimizer"])
    scheduler2.load_state_dict(state["scheduler"])
    loaded = optimizer2.adamw.param_groups + optimizer2.muon.param_groups
    assert all(a is b for a, b in zip(optimizer2.param_groups, loaded))
    train(resumed, optimizer2, scheduler2, 3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))
    assert [g["lr"] for g in optimizer2.muon.param_groups] == [g["lr"] for g in optimizer.muon.param_groups]

    forgetful, optimizer3, scheduler3 = fresh()
    forgetful.load_state_dict(state["model"])
    scheduler3.load_state_dict(state["scheduler"])
    train(forgetful, optimizer3, scheduler3, 3, seed=1)
    assert not torch.equal(forgetful.fc.weight, model.fc.weight)
    assert not torch.equal(forgetful.embed_tokens.weight, model.embed_tokens.weight)


class MLPStrategy:
    """A token's id regressed by a two-layer MLP with a norm: Muon and AdamW both train through the spine."""
    name, required_fields, unpacks = "mlp", ("input_ids",), False

    def __init__(self):
        torch.manual_seed(0)
        self.module = nn.Sequential(nn.Linear(2, 16), nn.LayerNorm(16), nn.SiLU(), nn.Linear(16, 16), nn.SiLU(),
                                    nn.Linear(16, 1))

    def param_groups(self, lr):
        return [{"params": list(self.module.parameters()), "lr": lr}]

    def forward_loss(self, module, batch):
        x = batch["input_ids"].float() / 16
        return (module(x)[:, 0] - batch["input_ids"][:, 0].float()).pow(2).mean(), {}


def mlp_fit(out, resume_from=None) -> MLPStrategy:
    rows = [{"input_ids": torch.tensor([i % 5, i]), "loss_mask": torch.ones(2, dtype=torch.bool), "source": "mlp",
             "row": i} for i in range(16)]
    trainer = TrainerConfig(optimizer="muon", weight_decay=0.1, batch_size=4, tokens_per_batch=None,
                            checkpoint_every=2, log_every=1, keep_last=100)
    strategy = MLPStrategy()
    state = fit(Accelerator(cpu=True), strategy, rows, trainer, StageConfig(epochs=2), str(out), 0, {"model": {}},
                resume_from)
    both = state.scheduler.optimizer  # the schedule reached the groups the two optimizers step with
    assert [g["lr"] for g in both.adamw.param_groups + both.muon.param_groups] == state.scheduler.get_last_lr()
    return strategy


def test_a_muon_run_resumed_from_a_spine_checkpoint_ends_with_the_same_weights(tmp_path):
    """accelerate's save_state/load_state carry the Muon+AdamW state: 8 steps straight, or resumed after step 4,
    give the same weights bit for bit."""
    whole = mlp_fit(tmp_path / "whole")
    (step4, _), = [c for c in complete_checkpoints(tmp_path / "whole") if c[1]["step"] == 4]
    assert set(torch.load(step4 / "optimizer.bin", weights_only=True)) == {"adamw", "muon"}
    resumed = mlp_fit(tmp_path / "resumed", resume_from=str(step4))
    a, b = whole.module.state_dict(), resumed.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["3.weight"], MLPStrategy().module.state_dict()["3.weight"])  # it did train
