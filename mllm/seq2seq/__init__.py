"""The sequence-to-sequence family: an attention encoder-decoder that translates parallel text."""
