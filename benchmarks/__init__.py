"""Benchmarks: throughput against peers (throughput.py), the CPU optimizer pool (optimizer.py), PCIe
(pcie.py).

Each is a script (`python3 benchmarks/throughput.py ...`); see benchmarks/README.md.
"""
