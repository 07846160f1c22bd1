"""DFlash 2's row of the serving matrix (``docs/serving.md``): which server loads ``export/dflash2``, each cell with
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
CPU_032 = ("GPU build only, read, not run: the selector's walk exists only in Model Runner V2's speculator "
           "(`v1/worker/gpu/spec_decode/__init__.py:34-39`, Triton kernels in `dflash2/speculator.py`), and the V1 "
           "runner the CPU build uses refuses a candidate-head draft rather than drafting it as DFlash "
           "(`config/vllm.py:2987-2991`): no parity with draftheads on these CPUs; the strict loader test of the "
           "export's keys and shapes stands in (docs/dflash2.md)")

EXPORT = Served("export/dflash2", "dflash", {
    VLLM_032.key: Cell(True, "`model_executor/models/registry.py:636` (`DFlash2DraftModel` -> `qwen3_dflash2`), "
                             "`qwen3_dflash2.py:253-254` and :385-386 (the `dflash_config` keys), "
                             "`v1/worker/gpu/spec_decode/dflash2/speculator.py:16-75` (the selector walk)",
                       f"vllm serve $target --speculative-config {SPEC}", CPU_032, cpu=False),
    VLLM_033.key: Cell(None, "not read: vLLM 0.33's source was not checked for DFlash 2"),
    SGLANG_0523.key: Cell(None, "not read: SGLang 0.5.23's source was not checked for DFlash 2"),
    TGI_337.key: Cell(False, "`server/text_generation_server/models/__init__.py:521-575` (speculators: Medusa and "
                             "MLPSpeculator only); TGI 3.3.7 (2025-12) predates DFlash 2 (2026-08)"),
    LLAMACPP.key: Cell(True, "`conversion/qwen.py:721` (`DFlash2DraftModel`) and :770-774 (`conv_kernel_size`, "
                             "`conv_group_size`, `selector_rank`, `selector_top_k`), `src/models/dflash.cpp:139-156` "
                             "(the selector's tensors), `common/speculative.cpp:1054-1055` (the selector walk when "
                             "its top-k is set)", llamacpp_command("draft-dflash"),
                       "the one server where DFlash 2 runs on CPUs: parity with draftheads: docs/serving.md"),
})

SERVING = (EXPORT,)
