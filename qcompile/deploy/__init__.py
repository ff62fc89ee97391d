"""Leaving the training world: quantization encodings (AIMET-style JSON) and, later, ONNX."""
