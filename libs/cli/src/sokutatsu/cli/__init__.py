"""The ``sokutatsu`` command line."""
