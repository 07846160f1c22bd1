"""Test-only: lets accelerate set up FSDP and DeepSpeed on CPU processes over gloo.

accelerate picks DistributedType.MULTI_CPU for CPU processes and never turns that into FSDP or DEEPSPEED
(its state.py only does so for GPU-like types), so sharding cannot run on CPU. This module, put on
PYTHONPATH with DRAFTHEADS_SHARDING_ON_CPU=1, lifts exactly that gate: the backend is gloo, the device CPU
(ACCELERATE_TORCH_DEVICE), the distributed type MULTI_GPU, so accelerate's own FSDP2 / DeepSpeed set-up runs
unchanged on top of torch's real sharding and collectives.
"""

import os

if os.environ.get("DRAFTHEADS_SHARDING_ON_CPU") == "1" and int(os.environ.get("LOCAL_RANK", -1)) != -1:
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_GPU

    _init = Accelerator.__init__

    def __init__(self, *args, **kwargs):
        _init(self, *args, **{**kwargs, "cpu": False})

    PartialState._prepare_backend = _prepare_backend
    Accelerator.__init__ = __init__
