"""What the int8 fidelity tests need of the CPU they run on."""

import pytest

from fxport.workers.engine.quantize.observers import exact_int8_dot_products

# On x86 without VNNI the int8 kernels of onnxruntime and fbgemm saturate (observers.py:
# exact_int8_dot_products): symmetric int8 (the tensorrt scheme) run on them is not the quantizer's
# fidelity, and kernels cannot match a QDQ graph exactly. Reported by -ra.
needs_exact_int8 = pytest.mark.skipif(
    not exact_int8_dot_products(),
    reason="this CPU has no VNNI: its int8 kernels sum u8×s8 pairs into saturating int16, so they cannot match "
           "the QDQ graph exactly (the verification catches it, tested in test_int8_on_a_saturating_cpu_*)",
)
