"""Medusa exporters: vLLM / TGI / draftheads files reload to heads with identical logits, and loaders are strict."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from draftheads.drafters.medusa.export import (export_tgi_medusa, export_vllm_medusa, load_heads, load_tgi_medusa,
                                  load_vllm_medusa, save_heads)
from draftheads.drafters.medusa.heads import MedusaHeads

D, V, K, L = 16, 50, 3, 2


def make(per_head: bool) -> tuple[MedusaHeads, nn.Linear]:
    """Random heads (non-zero blocks, so not the identity) and a random target LM head."""
    torch.manual_seed(0)
    lm_head = nn.Linear(D, V, bias=False)
    heads = MedusaHeads(D, V, K, L, per_head_lm_head=per_head)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    return heads, lm_head


def logits(heads: MedusaHeads, lm_head: nn.Module | None) -> torch.Tensor:
    torch.manual_seed(1)
    with torch.no_grad():
        return heads(torch.randn(2, 5, D).to(next(heads.parameters()).dtype), lm_head=lm_head)


EXPORTS = {
    "vllm": (export_vllm_medusa, load_vllm_medusa, "model.safetensors"),
    "tgi": (lambda h, w, d: export_tgi_medusa(h, w, d, "org/target"), load_tgi_medusa, "medusa_lm_head.safetensors"),
}


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("fmt", sorted(EXPORTS))
def test_export_reload_gives_identical_logits(tmp_path, fmt, per_head):
    heads, lm_head = make(per_head)
    export, load, _ = EXPORTS[fmt]
    expected = logits(heads, lm_head)
    assert expected.shape == (K, 2, 5, V)
    # the blocks are not the identity: the heads differ from the target's LM head and from each other
    assert not torch.allclose(expected[0], logits(MedusaHeads(D, V, K, L), lm_head)[0])
    assert not torch.allclose(expected[0], expected[1])

    assert export(heads, lm_head.weight, tmp_path / fmt) == tmp_path / fmt
    loaded = load(tmp_path / fmt)
    assert loaded.per_head_lm_head and (loaded.num_heads, loaded.num_layers) == (K, L)
    assert (loaded.hidden_size, loaded.vocab_size) == (D, V)
    torch.testing.assert_close(logits(loaded, None), expected, rtol=0, atol=1e-5)  # one GEMM vs K GEMMs
    if not per_head:  # every head carries the target's LM head
        for k in range(K):
            assert torch.equal(loaded.lm_heads[k].weight, lm_head.weight)
    assert sorted(p.name for p in (tmp_path / fmt).iterdir()) == sorted(["config.json", EXPORTS[fmt][2]])


@pytest.mark.parametrize("per_head", [False, True])
def test_files_computed_the_servers_way_give_the_heads_logits(tmp_path, per_head):
    """Re-implements vLLM's ``Medusa`` / TGI's ``MedusaHeadV1`` forward on the raw file tensors."""
    heads, lm_head = make(per_head)
    vllm = load_file(export_vllm_medusa(heads, lm_head.weight, tmp_path / "vllm") / "model.safetensors")
    tgi_folder = export_tgi_medusa(heads, lm_head.weight, tmp_path / "tgi", "org/target")
    tgi = load_file(tgi_folder / "medusa_lm_head.safetensors")
    assert len(vllm) == len(tgi) == K * (2 * L + 1)
    torch.manual_seed(1)
    h = torch.randn(2, 5, D)
    expected = logits(heads, lm_head)
    for f, block_name, lm_name in ((vllm, "blocks.{i}.layers.{j}", "lm_heads.{i}"), (tgi, "{i}.{j}.linear", "{i}.{L}")):
        for i in range(K):
            x = h
            for j in range(L):
                block = block_name.format(i=i, j=j)
                x = x + torch.nn.functional.silu(x @ f[f"{block}.weight"].T + f[f"{block}.bias"])
            out = x @ f[lm_name.format(i=i, L=L) + ".weight"].T
            torch.testing.assert_close(out, expected[i], rtol=1e-5, atol=1e-5)
            if not per_head:
                assert torch.equal(f[lm_name.format(i=i, L=L) + ".weight"], lm_head.weight)


def test_configs(tmp_path):
    heads, lm_head = make(False)
    vllm = json.loads((export_vllm_medusa(heads, lm_head.weight, tmp_path / "v") / "config.json").read_text())
    assert vllm["model_type"] == "medusa"
    assert (vllm["num_heads"], vllm["num_hidden_layers"]) == (K, L)
    assert (vllm["hidden_size"], vllm["vocab_size"], vllm["truncated_vocab_size"]) == (D, V, V)
    assert vllm["medusa_fc_bias"] is True and vllm["original_lm_head"] is False
    assert vllm["architectures"] == ["MedusaModel"]
    # vLLM's MedusaConfig.from_pretrained renames every key with "num" and "heads"/"layers"
    assert [k for k in vllm if "num" in k] == ["num_heads", "num_hidden_layers"]

    tgi = json.loads((export_tgi_medusa(heads, lm_head.weight, tmp_path / "t", "org/target") / "config.json")
                     .read_text())
    assert tgi == {"medusa_num_heads": K, "medusa_num_layers": L, "base_model_name_or_path": "org/target"}
    assert "architectures" not in tgi


def _rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("fmt", sorted(EXPORTS))
def test_loader_rejects_extra_missing_or_misshaped_tensor(tmp_path, fmt):
    heads, lm_head = make(True)
    export, load, weights = EXPORTS[fmt]
    path = export(heads, lm_head.weight, tmp_path) / weights
    key = "blocks.1.layers.0.bias" if fmt == "vllm" else "1.0.linear.bias"
    original = load_file(path)

    _rewrite(path, lambda t: t.update(token_map=torch.arange(V)))
    with pytest.raises(ValueError, match=r"unexpected tensors \['token_map'\]") as err:
        load(tmp_path)
    assert str(path) in str(err.value)

    save_file(original, path)
    _rewrite(path, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=rf"missing tensors \['{key}'\]"):
        load(tmp_path)

    save_file(original, path)
    _rewrite(path, lambda t: t.update({key: torch.zeros(D + 1)}))
    with pytest.raises(ValueError, match=rf"'{key}' has shape \({D + 1},\), expected \({D},\)"):
        load(tmp_path)

    save_file(original, path)
    assert torch.equal(logits(load(tmp_path), None), logits(heads, None))


def test_config_checks(tmp_path):
    heads, lm_head = make(False)
    with pytest.raises(ValueError, match="lm_head_weight"):
        export_vllm_medusa(heads, lm_head.weight[:, :-1], tmp_path / "bad")

    tgi = export_tgi_medusa(heads, lm_head.weight, tmp_path / "tgi", "org/target")
    config = json.loads((tgi / "config.json").read_text())
    (tgi / "config.json").write_text(json.dumps({**config, "architectures": ["MedusaModel"]}))
    with pytest.raises(ValueError, match="architectures"):
        load_tgi_medusa(tgi)

    vllm = export_vllm_medusa(heads, lm_head.weight, tmp_path / "vllm")
    config = json.loads((vllm / "config.json").read_text())
    for change in ({"medusa_fc_bias": False}, {"truncated_vocab_size": V - 1}, {"num_heads": "3"},
                   {"original_lm_head": True}, {"logit_scale": 2.0}, {"model_type": "llama"}):
        (vllm / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match="config.json"):
            load_vllm_medusa(vllm)

    (vllm / "stale.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="stale.safetensors"):
        export_vllm_medusa(heads, lm_head.weight, vllm)


@pytest.mark.parametrize("per_head", [False, True])
def test_save_heads_round_trip(tmp_path, per_head):
    heads, lm_head = make(per_head)
    extra = {"target": {"name": "org/target", "hidden_size": D}, "base_model": "org/target"}
    save_heads(heads.to(torch.bfloat16), tmp_path, extra)
    config = json.loads((tmp_path / "medusa_heads.json").read_text())
    assert config == {"hidden_size": D, "vocab_size": V, "num_heads": K, "num_layers": L,
                      "per_head_lm_head": per_head, **extra}
    assert len(load_file(tmp_path / "medusa_heads.safetensors")) == K * 2 * L + (K if per_head else 0)

    loaded, loaded_extra = load_heads(tmp_path)
    assert loaded_extra == extra
    assert loaded.per_head_lm_head == per_head
    assert next(loaded.parameters()).dtype == torch.bfloat16
    for (name, p), (name2, q) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == name2 and torch.equal(p, q)
    lm = None if per_head else lm_head.to(torch.bfloat16)
    assert torch.equal(logits(loaded, lm), logits(heads, lm))

    with pytest.raises(ValueError, match="may not set"):
        save_heads(heads, tmp_path / "clash", {"num_heads": 2})
    _rewrite(tmp_path / "medusa_heads.safetensors", lambda t: t.update(extra=torch.zeros(1)))
    with pytest.raises(ValueError, match=r"medusa_heads.safetensors: unexpected tensors \['extra'\]"):
        load_heads(tmp_path)


def test_the_reference_trainers_mlp_only_layout_reads_as_heads_on_the_targets_lm_head(tmp_path):
    """FasterDecoding/Medusa's current trainer (``train_legacy.py``) saves ``medusa_head.state_dict()`` of
    ``ModuleList(Sequential(ResBlock))`` without per-head LM heads, and a ``MedusaConfig`` with ``"version": "2"``;
    TGI serves it through ``MedusaHeadV2`` with the target's LM head. Read, it gives the same logits."""
    _, lm_head = make(False)
    heads = MedusaHeads(D, V, K, 1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    reference = {f"{i}.0.linear.{p}": getattr(heads.blocks[i][0].linear, p).detach().clone()
                 for i in range(K) for p in ("weight", "bias")}
    folder = tmp_path / "medusa_mlp_vicuna_medusa_3_lr_0.001_layers_1"
    folder.mkdir()
    save_file(reference, folder / "medusa_lm_head.safetensors")
    config = {"medusa_num_heads": K, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
              "version": "2", "transformers_version": "4.34.1"}
    (folder / "config.json").write_text(json.dumps(config))

    loaded = load_tgi_medusa(folder, vocab_size=V)
    assert not loaded.per_head_lm_head and (loaded.num_heads, loaded.num_layers, loaded.vocab_size) == (K, 1, V)
    torch.testing.assert_close(logits(loaded, lm_head), logits(heads, lm_head), rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass the target's vocab_size"):
        load_tgi_medusa(folder)
    (folder / "config.json").write_text(json.dumps({**config, "medusa_num_layers": 2}))
    with pytest.raises(ValueError, match="medusa_num_layers 1"):
        load_tgi_medusa(folder, vocab_size=V)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({**reference, "3.0.linear.weight": reference["0.0.linear.weight"].clone()},
              folder / "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match="3.0.linear.weight"):
        load_tgi_medusa(folder, vocab_size=V)
