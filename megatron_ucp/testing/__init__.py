"""Test utilities: a CUDA shim so real megatron-core runs on CPU (gloo), a tiny GPT, a launcher."""
