"""pdserve: the `pdserve` command line (pdserve.cli); the engine lives in the top-level packages."""
