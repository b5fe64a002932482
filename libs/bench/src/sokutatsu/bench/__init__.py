"""Sokutatsu's benchmarks (``sokutatsu bench``) and the simulation of extended ATOP (``sokutatsu simulate``)."""
