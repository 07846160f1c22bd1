"""DFlash's row of the serving matrix (``docs/serving.md``): which server loads ``export/dflash``, each cell with
the line of that server's source read at the versions :data:`~draftheads.serving.matrix.SERVERS` names."""

from __future__ import annotations

from draftheads.serving.matrix import (
    LLAMACPP,
    SGLANG_0523,
    TGI_337,
    VLLM_032,
    VLLM_033,
    Cell,
    Served,
    llamacpp_command,
)

SPEC = "'{\"method\": \"dflash\", \"model\": \"$export\", \"num_speculative_tokens\": $n}'"
NO_GEMMA3 = "not for a Gemma 3 target (docs/targets.md)"

EXPORT = Served("export/dflash", "dflash", {
    VLLM_032.key: Cell(True, "`vllm/config/speculative.py:68` (`DFlashModelTypes`, in `SpeculativeMethod` through "
                             "`EagleModelTypes` :70-71), `model_executor/models/registry.py:634` (`DFlashDraftModel` "
                             "-> `qwen3_dflash`)",
                       f"python -m vllm.entrypoints.openai.api_server --model $target --speculative-config {SPEC}",
                       f"parity with draftheads verified here: docs/serving.md; {NO_GEMMA3}"),
    VLLM_033.key: Cell(True, "`vllm/config/speculative.py:69` and :71-72, `model_executor/models/registry.py:664` "
                             "(`DFlashDraftModel` -> `qwen3_dflash`), `qwen3_dflash.py:454` (`mask_token_id` read as "
                             "in 0.32)", f"vllm serve $target --speculative-config {SPEC}", NO_GEMMA3),
    SGLANG_0523.key: Cell(True, "`srt/speculative/spec_info.py:39` (`DFLASH`), `srt/models/dflash.py:671` "
                                "(`DFlashDraftModel`, in `EntryClass` :1317), `srt/speculative/dflash_utils.py:588` "
                                "(`parse_dflash_draft_config`)",
                          "python -m sglang.launch_server --model-path $target --speculative-algorithm DFLASH "
                          "--speculative-draft-model-path $export"),
    TGI_337.key: Cell(False, "`server/text_generation_server/models/__init__.py:521-575` (speculators: Medusa and "
                             "MLPSpeculator only; no DFlash or EAGLE anywhere in `server/`)"),
    LLAMACPP.key: Cell(True, "`conversion/qwen.py:721-800` (`DFlashDraftModel`: `dflash_config` `target_layer_ids` "
                             "written as id + 1, the input of decoder layer i as vLLM reads it), "
                             "`src/models/dflash.cpp:37-50` (`target_layers`), `common/speculative.cpp:1073-1075` "
                             "(block size - 1 drafts)", llamacpp_command("draft-dflash"),
                       "parity with draftheads verified here: docs/serving.md"),
})

SERVING = (EXPORT,)
