"""Developer tools run from the Makefile and the tests (not part of the relaygr package)."""
