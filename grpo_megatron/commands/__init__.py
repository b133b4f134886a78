"""Subcommands beside the training loop, one module each: ``verify`` (megatron vs transformers on HF
weights) and ``convert`` (HF safetensors <-> megatron distributed checkpoints). They sit above
training/ and checkpoint/ in the layering (docs/architecture.md) because they drive those layers."""
