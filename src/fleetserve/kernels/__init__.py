"""Native CPU kernels, written in C and built on first use (see cpu.py)."""
