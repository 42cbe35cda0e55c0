"""DeepSeek-V2/V3 models on top of `mla_jax`: MoE, MTP, the decoder, HF checkpoints, training, generation.

The model, MoE, MTP and checkpoint names are imported eagerly; the training, generation and
sampling names are resolved on first use (PEP 562), so that `import models` stays light and
does not depend on those modules.
"""

import importlib

from models.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from models.deepseek import DeepSeekModel, ModelOutput
from models.experts import MOE_IMPLS, Experts, MgpuTuning, moe_dense_reference, moe_grouped, ragged_dot_mgpu
from models.layer import DecoderLayer
from models.mlp import MLP
from models.moe import MoE, Router, RouterBias, RouterOutput, route
from models.mtp import MTP
from models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

_LAZY = {
    "TrainConfig": "models.training.step",
    "loss_fn": "models.training.step",
    "make_train_step": "models.training.step",
    "init_train_state": "models.training.step",
    "router_bias_update": "models.training.step",
    "Engine": "models.serving.engine",
    "GenerationResult": "models.serving.engine",
    "SamplingParams": "models.serving.sampling",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "MLP",
    "MOE_IMPLS",
    "MTP",
    "DecoderLayer",
    "DeepSeekModel",
    "Experts",
    "MgpuTuning",
    "ModelOutput",
    "MoE",
    "Router",
    "RouterBias",
    "RouterOutput",
    "load_hf_checkpoint",
    "load_tokenizer",
    "moe_dense_reference",
    "moe_grouped",
    "ragged_dot_mgpu",
    "route",
    "save_hf_checkpoint",
    *_LAZY,
]
