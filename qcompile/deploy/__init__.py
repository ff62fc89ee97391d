"""Leaving the training world: quantization encodings (AIMET-style JSON,
``qcompile.deploy.encodings``) and QDQ ONNX export (``qcompile.deploy.onnx``, the
``[onnx]`` extra); ``qc.export_encodings`` / ``qc.export_onnx`` are the public names."""
