"""Per-op contracts: frozen call descriptions with every check of SPEC.md."""
