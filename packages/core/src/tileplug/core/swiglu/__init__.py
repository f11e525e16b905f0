"""The SwiGLU family's shared numerics: which rows of an expert layout are valid (SPEC §7-8)."""
