"""Quantization of FX graphs, at both IR levels.

int8 static PTQ (ptq.quantize_int8): layers.py finds the Conv/Linear layers, observers.py picks
ranges, int8.py inserts observers and then Q/DQ nodes, fidelity.py measures per layer and end
to end, lowering.py turns the Q/DQ graph into torch's int8 CPU kernels for TorchScript.
fp16 (fp16.to_half): the graph in half precision with norms, softmax and reductions in fp32.
"""
