"""Custom kiln kernels written with kiln/kernel.h (docs/kernels.md)."""
