"""The EAGLE-3 drafter: the training-time-test mask, the layer ids the servers read, the d2t mapping, training
versus decoding logits, losslessness and the export round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from draftheads.data.hidden_states import layer_features
from draftheads.drafters.eagle3.export import expected_shapes, export_eagle3, load_eagle3
from draftheads.drafters.eagle3.model import (Eagle3DraftModel, Eagle3Drafter, default_layer_ids, draft_config,
                                              draft_vocabulary, eagle3_loss, layer_ids_of, ttt_attention)
from draftheads.drafters.eagle3.training import Eagle3Training
from draftheads.models.speculative import Sampling, plain_decode, speculative_decode
from draftheads.training.objectives import Objective
from tests.helpers import assert_packed_trains_as_padded, feature_rows

LAYERS = [0, 2, 3]
DECAY = Objective(position_decay=0.8)
"""EAGLE-3's default objective: cross-entropy, step k weighing 0.8 ** k."""


def _vocabulary(model, size=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(model.config.vocab_size, generator=g)[:size].sort().values


@pytest.fixture(scope="module")
def drafter(tiny):
    model, _ = tiny
    torch.manual_seed(0)
    d = Eagle3DraftModel.for_target(model, LAYERS, _vocabulary(model))
    with torch.no_grad():  # a random drafter whose features matter as much as its tokens
        d.fc.weight.mul_(10)
    return d


def _batch(model, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (2, T), generator=g)
    attention = torch.ones(2, T, dtype=torch.long)
    attention[1, T - 5:] = 0
    return ids, attention, layer_features(model, ids, attention, LAYERS)


def test_default_layer_ids_are_the_layers_vllm_reads_by_default():
    """vLLM's default ``(2, L//2, L-3)`` counts layer inputs: draftheads' ``[1, L//2-1, L-4]`` (outputs)."""
    for L in (30, 32, 36, 80):
        assert [i + 1 for i in default_layer_ids(L)] == [2, L // 2, L - 3]
    assert default_layer_ids(30) == [1, 14, 26] and default_layer_ids(4) == [0, 2, 3]


def test_the_default_layers_are_left_unnamed_so_vllm_and_sglang_read_the_same_ones(tiny):
    """vLLM reads a named id i as the input of layer i, SGLang as its output: only the unnamed default is read
    alike by both; other layers are named as vLLM reads them."""
    target = LlamaConfig(num_hidden_layers=30, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    default = draft_config(target, [1, 14, 26], 100)
    assert default.eagle_config == {"use_aux_hidden_state": True} and layer_ids_of(default) == (1, 14, 26)
    custom = draft_config(target, [2, 14, 26], 100)
    assert (custom.eagle_config["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]
            and layer_ids_of(custom) == (2, 14, 26))


def test_exported_layer_ids_are_vllms_inputs_of_the_next_layer(tiny, drafter, tmp_path):
    """draftheads id i (output of decoder layer i) is vLLM's id i+1, transformers' ``hidden_states[i+1]``
    (vLLM records ``hidden_states + residual`` before layer i+1 runs)."""
    model, _ = tiny
    export_eagle3(drafter, tmp_path)
    served = json.loads((tmp_path / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert served == [1, 3, 4]
    ids = torch.randint(4, 500, (1, 10))
    ours = layer_features(model, ids, torch.ones_like(ids), LAYERS[:2])
    hf = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(ours, torch.cat([hf[i] for i in served[:2]], dim=-1))


def test_ttt_attention_sees_the_causal_context_and_only_its_own_row_of_later_steps():
    torch.manual_seed(0)
    B, H, Hkv, T, hd, s = 1, 4, 2, 9, 8, 5
    q = torch.randn(B, H, T, hd)
    keys = [torch.randn(B, Hkv, T, hd) for _ in range(3)]
    values = [torch.randn(B, Hkv, T, hd) for _ in range(3)]
    valid = torch.ones(B, T, dtype=torch.bool)
    base = ttt_attention(q, keys, values, valid, 0.3)[:, :, s]

    def changed(step, rows, what="k"):
        k2, v2 = [k.clone() for k in keys], [v.clone() for v in values]
        target = k2 if what == "k" else v2
        target[step][:, :, rows] += 3.0
        return ttt_attention(q, k2, v2, valid, 0.3)[:, :, s]

    torch.testing.assert_close(changed(0, slice(s + 1, None)), base)  # step 0 after s: unseen
    assert not torch.allclose(changed(0, slice(s, s + 1)), base)  # step 0 at s: seen
    assert not torch.allclose(changed(0, slice(0, 1)), base)  # step 0 before s: seen
    for step in (1, 2):
        others = [t for t in range(T) if t != s]
        torch.testing.assert_close(changed(step, others), base)  # later steps: other rows unseen
        torch.testing.assert_close(changed(step, others, "v"), base)
        assert not torch.allclose(changed(step, [s]), base)  # ...their own row seen
        assert not torch.allclose(changed(step, [s], "v"), base)
    padded = valid.clone()
    padded[0, 2] = False
    assert not torch.allclose(ttt_attention(q, keys, values, padded, 0.3)[:, :, s], base)


def test_a_step_never_sees_features_or_tokens_after_its_row(tiny, drafter):
    """End to end through the unrolled pass: row s, step j reads features <= s and tokens <= s+1+j."""
    model, _ = tiny
    ids, attention, features = _batch(model)
    s, J = 9, 3
    with torch.no_grad():
        base = drafter(features, ids, attention, J)[0, s]
        later = features.clone()
        later[0, s + 1:] += torch.randn_like(later[0, s + 1:])
        torch.testing.assert_close(drafter(later, ids, attention, J)[0, s], base)
        here = features.clone()
        here[0, s] += 1.0
        assert not torch.allclose(drafter(here, ids, attention, J)[0, s, 0], base[0])
        for j in range(J):  # token s+2+j is step j's label: steps <= j never see it, step j+1 is fed it
            ids2 = ids.clone()
            ids2[0, s + 2 + j] = (ids[0, s + 2 + j] + 1) % 500
            out = drafter(features, ids2, attention, J)[0, s]
            torch.testing.assert_close(out[:j + 1], base[:j + 1])
            if j + 1 < J:
                assert not torch.allclose(out[j + 1], base[j + 1])


def test_training_pass_and_cached_drafting_give_the_same_logits(tiny, drafter):
    """Step j of the unrolled pass at row s == draft j+1 of the decoding path from a context ending at s, when
    the sequence continues with the drafter's own drafts; the context arrives in chunks as in decoding."""
    model, _ = tiny
    ids, attention, features = _batch(model)
    for row, s in ((0, 11), (1, 8)):
        J = 4
        cached = Eagle3Drafter(drafter, J)
        cached.draft_logits(None, int(ids[row, 6]), features[row, :6], ids[row, :6])
        drafts = cached.draft_logits(None, int(ids[row, s + 1]), features[row, 6:s + 1], ids[row, 6:s + 1])
        seq = ids[row:row + 1].clone()
        seq[0, s + 2:s + 1 + J] = drafts[:J - 1].argmax(-1)  # the tokens the drafter fed itself
        feats = layer_features(model, seq, torch.ones_like(seq), LAYERS)
        with torch.no_grad():
            packed = drafter.target_logits(drafter(feats, seq, torch.ones_like(seq), J)[0, s])
        torch.testing.assert_close(drafts, packed, atol=1e-5, rtol=1e-4)


def test_the_draft_vocabulary_is_the_most_frequent_trained_tokens_and_d2t_maps_it(tiny):
    model, _ = tiny
    rows = [{"input_ids": torch.tensor([5, 7, 7, 9, 9, 9, 3]), "loss_mask": torch.tensor([0, 1, 1, 1, 1, 1, 0]).bool()}]
    assert draft_vocabulary(rows, 12, 3).tolist() == [0, 7, 9]  # 9 x3, 7 x2, then the lowest untrained id
    assert draft_vocabulary(rows, 12, 1).tolist() == [9]
    with pytest.raises(ValueError, match="draft_vocab_size=13"):
        draft_vocabulary(rows, 12, 13)
    vocab = torch.tensor([3, 10, 42, 200])
    d = Eagle3DraftModel.for_target(model, LAYERS, vocab)
    assert d.d2t.tolist() == [3, 9, 40, 197] and d.draft_ids().tolist() == vocab.tolist()  # vLLM: arange + d2t
    assert d.t2d.nonzero()[:, 0].tolist() == vocab.tolist()
    torch.testing.assert_close(d.lm_head.weight, model.lm_head.weight[vocab])  # starts as the target's rows
    logits = d.target_logits(torch.randn(2, model.config.hidden_size))
    assert logits.shape == (2, model.config.vocab_size)
    assert torch.isfinite(logits[:, vocab]).all() and int(torch.isfinite(logits).sum()) == 8
    assert set(logits.argmax(-1).tolist()) <= set(vocab.tolist())


def test_labels_are_mapped_into_the_draft_vocabulary_and_unheld_ones_count_as_misses(tiny):
    model, _ = tiny
    vocab = torch.tensor([3, 10, 42, 200])
    d = Eagle3DraftModel.for_target(model, LAYERS, vocab)
    ids = torch.tensor([[1, 2, 42, 10, 7, 3]])
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    h = torch.zeros(1, 6, 2, model.config.hidden_size)
    h[..., 0, 0], h[..., 1, 1] = 1.0, 1.0  # step 1 on dimension 0, step 2 on dimension 1
    with torch.no_grad():  # the head says draft token 0 (target 3) at step 1 and draft token 2 (target 42) at step 2
        d.lm_head.weight.zero_()
        d.lm_head.weight[0, 0], d.lm_head.weight[2, 1] = 50.0, 50.0
    loss, m = eagle3_loss(d, h, ids, loss_mask, DECAY)
    # step 1 labels (token s+2): 42, 10, 7, 3 -> right only at s=3; step 2 labels (s+3): 10, 7, 3 -> never 42
    assert float(m["acc_pos1"]) == pytest.approx(1 / 4) and float(m["acc_pos2"]) == 0.0
    assert float(m["vocab_coverage"]) == pytest.approx(5 / 7)  # 7 (twice) is not in the draft vocabulary
    assert torch.isfinite(loss)


def test_greedy_eagle3_decoding_equals_plain_greedy(tiny, drafter):
    model, tok = tiny
    stop = {tok.eos_token_id}
    for text in ("Hello there", "How are you doing today?"):
        ids = torch.tensor(tok(text)["input_ids"])
        plain = plain_decode(model, ids, 40, stop)
        spec = speculative_decode(model, Eagle3Drafter(drafter, 4), ids, 40, stop)
        assert spec.tokens == plain.tokens and spec.gamma == 4
        assert len(spec.accepted_per_step) >= 1


def test_a_drafter_that_learns_the_sequence_gets_drafts_accepted(tiny):
    """Trained on the tiny target's own greedy continuation, the drafter's chain is accepted: labels are
    neither shifted nor leaked (a shifted label would teach it the token one position off)."""
    model, tok = tiny
    ids = torch.tensor(tok("Once upon a time")["input_ids"])
    stop = {tok.eos_token_id}
    seq = torch.cat([ids, torch.tensor(plain_decode(model, ids, 40, stop).tokens)])[None]
    torch.manual_seed(0)
    d = Eagle3DraftModel.for_target(model, LAYERS, torch.arange(model.config.vocab_size))
    feats = layer_features(model, seq, torch.ones_like(seq), LAYERS)
    loss_mask = torch.zeros_like(seq, dtype=torch.bool)
    loss_mask[0, len(ids):] = True
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(150):
        loss, metrics = eagle3_loss(d, d(feats, seq, torch.ones_like(seq), 3), seq, loss_mask, DECAY)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(metrics["acc_pos1"]) > 0.9 and float(metrics["acc_pos3"]) > 0.9
    result = speculative_decode(model, Eagle3Drafter(d.eval(), 3), ids, 40, stop)
    assert result.tokens == seq[0, len(ids):].tolist()
    assert sum(result.accepted_per_step) / len(result.accepted_per_step) > 2.0


def test_sampled_eagle3_decoding_is_reproducible(tiny, drafter):
    model, tok = tiny
    ids = torch.tensor(tok("Hello there")["input_ids"])
    runs = [speculative_decode(model, Eagle3Drafter(drafter, 3), ids, 30, {tok.eos_token_id}, Sampling(0.8),
                               torch.Generator().manual_seed(3)).tokens for _ in range(2)]
    assert runs[0] == runs[1]


def test_export_round_trip_and_server_fields(tiny, drafter, tmp_path):
    model, _ = tiny
    path = export_eagle3(drafter, tmp_path / "e")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["draft_vocab_size"] == 300 and config["vocab_size"] == model.config.vocab_size
    assert config["target_hidden_size"] == config["hidden_size"] == model.config.hidden_size
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert set(tensors) == set(expected_shapes(drafter.config)) and not any("embed" in k for k in tensors)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * model.config.hidden_size
    back = load_eagle3(path, model)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)
    # a full vocabulary has no mapping to write (vLLM then has none to load)
    full = export_eagle3(Eagle3DraftModel.for_target(model, LAYERS, torch.arange(model.config.vocab_size)),
                         tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(full / "model.safetensors")))
    assert load_eagle3(full, model).t2d.all()


def test_export_loader_refuses_bad_files_and_other_targets(tiny, drafter, tmp_path):
    model, _ = tiny
    path = export_eagle3(drafter, tmp_path / "e")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: missing tensors \['fc.weight'\]"):
        load_eagle3(path, model)
    bad = dict(tensors, d2t=tensors["d2t"].flip(0))
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_eagle3(path, model)
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, num_target_layers=30)))
    with pytest.raises(ValueError, match="made for another target"):
        load_eagle3(path, model)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "draft_vocab_size"}))
    with pytest.raises(ValueError, match="missing field 'draft_vocab_size'"):
        load_eagle3(path, model)


@pytest.mark.parametrize("online", [False, True])
def test_a_packed_batch_trains_what_its_rows_padded_train(tiny, drafter, online):
    """Sequences packed back to back: the target's features from the packed sequence (online) equal the padded
    rows', and the drafter reads the rows one per line, so its loss, metrics and gradients are the padded
    batch's."""
    model, _ = tiny
    rows = feature_rows(model, (24, 19, 21), None if online else LAYERS)
    assert_packed_trains_as_padded(Eagle3Training(drafter, model, 3, DECAY, online), rows)


def test_online_features_train_like_computed_ones(tiny):
    """The online mode (target forward per batch) computes the same loss as cached features."""
    from draftheads.data.batching import collate
    from draftheads.data.hidden_states import attach_hidden_states
    model, tok = tiny
    rows = [{"input_ids": torch.randint(4, 500, (n,)), "loss_mask": torch.arange(n) >= 5} for n in (20, 26)]
    drafter = Eagle3DraftModel.for_target(model, [1, 2, 3], torch.arange(512))
    computed, online = (Eagle3Training(drafter, model, 3, DECAY, online=o) for o in (False, True))
    attach_hidden_states(model, rows, 2, tok.pad_token_id, False, layer_ids=[1, 2, 3])
    batch = collate(rows, tok.pad_token_id)
    losses = [s.forward_loss(s.module, b)[0] for s, b in
              ((computed, batch), (online, {k: v for k, v in batch.items() if k != "target_features"}))]
    torch.testing.assert_close(losses[0], losses[1])
    assert "target_features" in computed.required_fields and "target_features" not in online.required_fields


# --- the norm flags: EAGLE-3.1's (arXiv 2605.09992) and norm_before_residual, as vLLM 0.32's llama_eagle3.py --

EAGLE31 = {"fc_norm": {"fc_norm": True}, "norm_before_fc": {"norm_before_fc": True},
           "norm_output": {"norm_output": True}, "norm_before_residual": {"norm_before_residual": True},
           "eagle3.1": {"fc_norm": True, "norm_output": True},
           "speculators": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
           "all": {"fc_norm": True, "norm_before_fc": True, "norm_output": True, "norm_before_residual": True}}
"""Each flag alone, EAGLE-3.1 as the paper has it (per-feature norms, post-norm state fed on), speculators'
default EAGLE-3 and all four."""


def _flagged(model, drafter, **flags):
    """``drafter``'s weights under EAGLE-3.1 ``flags``, its extra norms' weights drawn in [0.5, 1.5) so that
    they matter."""
    d = Eagle3DraftModel.for_target(model, LAYERS, _vocabulary(model), **flags)
    missing, unexpected = d.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("input_norm.", "fc_norm.")) for k in missing)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k in missing:
            d.get_parameter(k).copy_(torch.rand(d.get_parameter(k).shape, generator=g) + 0.5)
    return d.eval()


def _rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_the_job_trains_norm_before_fc_and_a_drafter_without_its_flags_is_eagle3s(tiny):
    """The job's default is EAGLE-3.1's ``norm_before_fc`` alone (``norm_output`` off: llama.cpp cannot read it);
    a drafter built or read without the flags (as vLLM reads a config without the keys) draws the same weights,
    holds the same tensors and feeds its pre-norm state on."""
    from draftheads.drafters.eagle3.config import Eagle3Config
    from draftheads.drafters.eagle3.model import NORM_FLAGS, norm_flags
    model, _ = tiny
    assert {name: getattr(Eagle3Config(), name) for name in NORM_FLAGS} == \
        {"fc_norm": False, "norm_before_fc": True, "norm_output": False, "norm_before_residual": False}
    made = []
    for flags in ({}, dict.fromkeys(NORM_FLAGS, False)):
        torch.manual_seed(0)
        made.append(Eagle3DraftModel.for_target(model, LAYERS, _vocabulary(model), **flags))
    assert list(made[0].state_dict()) == list(made[1].state_dict())
    assert all(torch.equal(v, made[1].state_dict()[k]) for k, v in made[0].state_dict().items())
    assert not any(k.startswith(("input_norm", "fc_norm")) for k in made[0].state_dict())
    h = torch.randn(3, model.config.hidden_size)
    assert made[0].carry(h) is h and made[0].input_norm is None and made[0].fc_norm is None
    assert norm_flags(made[0].config) == {"fc_norm": False, "norm_before_fc": False, "norm_output": False,
                                          "norm_before_residual": False}


def test_eagle31_norms_sit_before_fc_and_norm_output_feeds_the_next_step_its_normed_state(tiny, drafter):
    """fc_norm: one RMSNorm per feature; norm_before_fc: one over the concatenation, applied first (vLLM's
    combine_hidden_states); norm_output: step 0 unchanged, every later step fed norm(state);
    norm_before_residual: the layer's residual stream starts at hidden_norm(h). Each changes the drafter's output."""
    model, _ = tiny
    ids, attention, features = _batch(model)
    eps = model.config.rms_norm_eps
    with torch.no_grad():
        plain = drafter(features, ids, attention, 3)
        d = _flagged(model, drafter, **EAGLE31["fc_norm"])
        per_feature = torch.cat([_rms(c, n.weight, eps) for c, n in zip(features.chunk(3, -1), d.fc_norm)], -1)
        torch.testing.assert_close(d.fuse(features), d.fc(per_feature))
        assert not torch.allclose(d(features, ids, attention, 3), plain, atol=1e-3)
        d = _flagged(model, drafter, **EAGLE31["norm_before_fc"])
        torch.testing.assert_close(d.fuse(features), d.fc(_rms(features, d.input_norm.weight, eps)))
        assert not torch.allclose(d(features, ids, attention, 3), plain, atol=1e-3)
        d = _flagged(model, drafter, **EAGLE31["all"])
        whole = _rms(features, d.input_norm.weight, eps)
        want = d.fc(torch.cat([_rms(c, n.weight, eps) for c, n in zip(whole.chunk(3, -1), d.fc_norm)], -1))
        torch.testing.assert_close(d.fuse(features), want)
        d = _flagged(model, drafter, **EAGLE31["norm_output"])
        out = d(features, ids, attention, 3)
        torch.testing.assert_close(out[:, :, 0], plain[:, :, 0])  # step 0 is fed the fused feature either way
        assert not torch.allclose(out[:, :, 1:], plain[:, :, 1:], atol=1e-3)
        h = out[0, 4, 0]
        torch.testing.assert_close(d.carry(h), _rms(h, d.norm.weight, eps))
        d = _flagged(model, drafter, **EAGLE31["norm_before_residual"])  # plain's weights, the flag alone differs
        assert not torch.allclose(d(features, ids, attention, 3), plain, atol=1e-3)
        layer = d.midlayer
        layer.hidden_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))  # away from one
        h = torch.randn(2, 5, d.fc.out_features)
        attended = torch.randn(2, model.config.num_attention_heads, 5, layer.head_dim)
        r = _rms(h, layer.hidden_norm.weight, eps) + layer.self_attn.o_proj(attended.transpose(1, 2).flatten(2))
        torch.testing.assert_close(layer.finish(h, attended), r + layer.mlp(layer.post_attention_layernorm(r)))


@pytest.mark.parametrize("flags", EAGLE31.values(), ids=EAGLE31.keys())
def test_eagle31_training_pass_and_cached_drafting_give_the_same_logits(tiny, drafter, flags):
    """Training and the evaluator's chain drafting take the same normed path: step j of the unrolled pass at
    row s == draft j+1 from a context ending at s (the context in chunks, as in decoding)."""
    model, _ = tiny
    d = _flagged(model, drafter, **flags)
    ids, _, features = _batch(model)
    row, s, J = 0, 11, 4
    cached = Eagle3Drafter(d, J)
    cached.draft_logits(None, int(ids[row, 6]), features[row, :6], ids[row, :6])
    drafts = cached.draft_logits(None, int(ids[row, s + 1]), features[row, 6:s + 1], ids[row, 6:s + 1])
    seq = ids[row:row + 1].clone()
    seq[0, s + 2:s + 1 + J] = drafts[:J - 1].argmax(-1)
    feats = layer_features(model, seq, torch.ones_like(seq), LAYERS)
    with torch.no_grad():
        packed = d.target_logits(d(feats, seq, torch.ones_like(seq), J)[0, s])
    torch.testing.assert_close(drafts, packed, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("flags", EAGLE31.values(), ids=EAGLE31.keys())
def test_greedy_eagle31_decoding_equals_plain_greedy(tiny, drafter, flags):
    model, tok = tiny
    d, stop = _flagged(model, drafter, **flags), {tok.eos_token_id}
    for text in ("Hello there", "How are you doing today?"):
        ids = torch.tensor(tok(text)["input_ids"])
        spec = speculative_decode(model, Eagle3Drafter(d, 4), ids, 40, stop)
        assert spec.tokens == plain_decode(model, ids, 40, stop).tokens and len(spec.accepted_per_step) >= 1


def test_an_eagle31_export_carries_the_keys_and_weights_vllm_reads_and_reads_back_exactly(tiny, drafter, tmp_path):
    """vLLM 0.32 llama_eagle3.py reads top-level ``fc_norm`` (:231), ``norm_output`` (:252), ``norm_before_fc``
    (:184-188, eagle_config first) and ``norm_before_residual`` (:101); its weights ``input_norm.weight``
    ``[3D]`` and ``fc_norm.{k}.weight`` ``[D]`` (``model.`` prefixed by its loader, :444)."""
    model, _ = tiny
    D = model.config.hidden_size
    d = _flagged(model, drafter, **EAGLE31["all"])
    path = export_eagle3(d, tmp_path / "e31")
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")} == \
        {"fc_norm": True, "norm_before_fc": True, "norm_output": True, "norm_before_residual": True}
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["input_norm.weight"].shape == (3 * D,)
    assert [tuple(tensors[f"fc_norm.{k}.weight"].shape) for k in range(3)] == [(D,)] * 3
    assert set(tensors) == set(expected_shapes(drafter.config)) | {"input_norm.weight"} | {
        f"fc_norm.{k}.weight" for k in range(3)}
    back = load_eagle3(path, model)
    assert list(back.state_dict()) == list(d.state_dict()) and back.norm_output and back.midlayer.norm_before_residual
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    ids, attention, features = _batch(model)
    with torch.no_grad():
        assert torch.equal(back(features, ids, attention, 3), d(features, ids, attention, 3))
    plain = json.loads((export_eagle3(drafter, tmp_path / "e3") / "config.json").read_text())
    assert not any(plain[k] for k in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"))


def test_the_eagle31_loader_reads_flags_as_vllm_and_refuses_what_it_would_misread(tiny, drafter, tmp_path):
    model, _ = tiny
    path = export_eagle3(_flagged(model, drafter, **EAGLE31["all"]), tmp_path / "e")
    config, tensors = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))

    def with_config(**changes):
        (path / "config.json").write_text(json.dumps({**config, **changes}))

    with_config(fc_norm=False)  # the norms' weights are there, the flag that builds them is off
    with pytest.raises(ValueError, match=r"unexpected tensors \['fc_norm.0.weight'"):
        load_eagle3(path, model)
    with_config(norm_output="yes")
    with pytest.raises(ValueError, match="config.json.*norm_output.*true or false"):
        load_eagle3(path, model)
    with_config(norm_before_residual=1)
    with pytest.raises(ValueError, match="config.json.*norm_before_residual.*true or false"):
        load_eagle3(path, model)
    with_config(norm_before_residual=False)  # as vLLM: the key read, the same weights, the other residual
    assert not load_eagle3(path, model).midlayer.norm_before_residual
    # vLLM reads norm_before_fc from eagle_config before the top level
    with_config(norm_before_fc=False, eagle_config={**config["eagle_config"], "norm_before_fc": True})
    assert load_eagle3(path, model).input_norm is not None
    with_config()
    save_file({k: v for k, v in tensors.items() if k != "input_norm.weight"}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['input_norm.weight'\]"):
        load_eagle3(path, model)


def test_the_recipe_builds_describes_and_reports_the_eagle31_flags(tiny, tmp_path):
    from draftheads.drafters.eagle3.recipe import EAGLE3
    from tests.helpers import smoke
    model, tok = tiny
    conf = smoke("eagle3", tmp_path, tmp_path, "eagle3.fc_norm=true", "eagle3.norm_before_fc=false",
                 "eagle3.norm_output=true")
    rows = [{"input_ids": torch.randint(4, 500, (16,)), "loss_mask": torch.ones(16, dtype=torch.bool)}]
    d = EAGLE3.build(conf, model, tok, rows)
    assert d.fc_norm is not None and d.input_norm is None and d.norm_output
    assert "norms fc_norm norm_output" in EAGLE3.describe(conf, d)
    report = EAGLE3.drafter_config(conf, d)
    assert (report["fc_norm"], report["norm_before_fc"], report["norm_output"]) == (True, False, True)
    default = EAGLE3.build(smoke("eagle3", tmp_path, tmp_path), model, tok, rows)
    assert default.fc_norm is None and default.input_norm is not None and not default.norm_output
    plain = EAGLE3.build(smoke("eagle3", tmp_path, tmp_path, "eagle3.norm_before_fc=false", "eagle3.norm_output=false"),
                         model, tok, rows)
    assert plain.fc_norm is None and plain.input_norm is None and not plain.norm_output
