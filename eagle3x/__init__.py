"""eagle3x: train EAGLE-3 speculative-decoding draft models (prepare, extract, vocab, train)."""

__version__ = "0.1.0"
