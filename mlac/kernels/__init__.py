"""Kernels: one file per family, each with a Triton kernel, a checking wrapper and a pure-torch reference.

Dispatch is by device: the Triton path on CUDA, the reference on CPU.
"""
