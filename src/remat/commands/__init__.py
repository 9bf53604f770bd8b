"""One module per CLI subcommand; see :mod:`remat.cli`."""
