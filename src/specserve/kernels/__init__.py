"""Triton kernels and their launchers: attention, GEMV, norms, rotary, argmax, programmatic
dependent launch. Pure functions of tensors; no nn.Modules (layers/ wraps them)."""
