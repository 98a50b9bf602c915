"""Compile jobs. `compile.compile_version` is the plain function; pools and tasks wrap it."""
