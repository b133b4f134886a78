"""grpo-megatron: GRPO for Mixture-of-Experts language models on megatron-core.

Importing the package must stay cheap and GPU-free: heavy modules (torch, megatron-core,
transformers, sglang) are imported by the submodules that need them, never here.
"""

__version__ = "0.1.0"
