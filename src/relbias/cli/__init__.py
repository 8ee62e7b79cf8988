"""The ``relbias`` command line. Only the CLI prints."""
