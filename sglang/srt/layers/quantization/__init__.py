"""Quantized weight formats and their CPU kernels."""
