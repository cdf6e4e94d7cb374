"""Quantized experts: which tensors move with their expert, per format, kernel and padding."""
