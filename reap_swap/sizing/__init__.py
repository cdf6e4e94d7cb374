"""Sizing: a model's MoE shape, the HBM / KV / host split, quantized layouts, and grouped units."""
