"""The lowest layer: helpers every stage may use (files, dtypes, devices, CLI flags). Imports nothing else from
specquant but errors."""
