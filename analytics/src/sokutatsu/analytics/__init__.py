"""Sokutatsu analytics: the PySpark job behind ``sokutatsu analyze``.

``reader`` reads OTLP/JSON-lines trace files into one span DataFrame (I/O);
``transforms`` turns it into the result tables (pure DataFrame functions, no I/O);
``report`` writes the tables, plots and ``report.html``; ``job`` runs all three.
The span names and attributes they rely on are in docs/tracing.md.
"""
