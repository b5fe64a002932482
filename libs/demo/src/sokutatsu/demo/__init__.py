"""Sokutatsu's demo (``sokutatsu demo``): the suite with a market-data scenario, its traces analysed."""
