"""Kernels (Triton on CUDA, PyTorch twins everywhere) on plain tensors. Imports neither vLLM nor CUDA.

Each op lives in its own module with its Triton kernel and its PyTorch twin of the same signature.
"""
