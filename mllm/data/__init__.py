"""Data preparation, family-agnostic: a source read and checked, tokens, the vocabulary, the splits."""
