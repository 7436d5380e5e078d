"""Bridges from other libraries to pyattn. Each submodule imports its framework only when it is
imported itself, so ``import pyattn`` never needs them.

- :mod:`pyattn.integrations.transformers`: pyattn as an attention implementation of Hugging Face
  transformers (``register()``, then ``attn_implementation="pyattn"``).
"""
