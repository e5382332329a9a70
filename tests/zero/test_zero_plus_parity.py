"""ZeRO++ on the edge-case parity model (tied weights, a frozen and an unused layer, sizes no world size divides,
two param groups) against the single-process torch reference (test_zero_parity.py's harness): the quantized
modes, alone and with hpZ, within a documented bound at W=4 as 2 "nodes" of 2 and at W=3 (hpZ alone is
bit-identical to plain stage 3: test_zero_hpz.py)."""

from harness import spawn
from test_zero_parity import check_parity

# Lossy modes (int8 weights in the gathers, int8 gradients in the reduction), 6 AdamW steps, clipping at 0.5:
# the parameters' distance from the reference at most 15% of the reference's movement, each loss within 3%.
# Measured (fp32 / bf16 with accumulation 3): qwZ 8.9% / 8.4% and 1.1% / 1.1% at W=4, 6.0% / 7.4% and
# 0.9% / 2.3% at W=3; qgZ 6.5% / 5.1% and 0.3% / 0.2% at W=4, 6.8% / 6.9% and 0.8% / 0.6% at W=3; all three
# 9.2% / 8.2% and 1.1% / 1.0%. (bf16 alone, exact communication, is within 15% and 3% too: test_zero_parity.)
LOSSY = (None, 0.15, 0.03)
# int4 gradients (zero_quantized_gradients_bits: 4, DeepSpeed's qgZ width; its step is 18x int8's): within 40% of
# the movement and 8% per loss. Measured fp32 / bf16 gas 3: 30% / 23% and 3.5% / 5.4% at W=3, 26% / 18% and
# 1.0% / 1.2% at W=4.
LOSSY4 = (None, 0.4, 0.08)
QG4 = {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4}
HPZ = {"zero_hpz_partition_size": 2}
QW = {"zero_quantized_weights": True}
QG = {"zero_quantized_gradients": True}


def _cases(cases) -> list:
    return [
        check_parity(3, precision, gas, False, extra, tolerance)
        for precision, gas, extra, tolerance in cases
    ]


def test_zero_plus_modes_train_the_parity_model_like_the_reference():
    # (hpZ alone is bit-identical to plain stage 3, itself checked against the reference: test_zero_hpz.py)
    two_nodes = [("bf16", 3, QW, LOSSY), ("fp32", 3, {**QW, **QG, **HPZ}, LOSSY)]
    spawn(_cases, 4, two_nodes, env={"LOCAL_WORLD_SIZE": "2"})
    spawn(_cases, 3, [("fp32", 1, QG, LOSSY), ("fp32", 1, QG4, LOSSY4)])
