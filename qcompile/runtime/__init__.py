"""What compiled graphs execute: ``FakeQuantize`` and observers, the quantization math and
its fused C++ kernels (``csrc/``), the weight cache, integer modules for converted graphs,
int8 transfer across pipeline cuts, and calibration. Imports only specs, errors and torch.
"""
