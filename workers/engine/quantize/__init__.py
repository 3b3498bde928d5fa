"""Quantization of FX graphs: int8 static PTQ as Q/DQ nodes (ptq.py) and fp16 with fp32 islands (fp16.py)."""
