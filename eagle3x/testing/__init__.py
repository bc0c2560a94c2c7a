"""Tiny stand-ins for checking eagle3x without big models (tests, benchmarks, users).

`zoo`: tiny random checkpoints of every verifier family eagle3x claims to serve (`quant`:
their compressed-tensors W4A16 versions); `chat_zoo`: the families' published chat
templates (`chat_templates/`) with locally trained tokenizers carrying their special
tokens (`python -m eagle3x.testing.chat_zoo NAME FOLDER`); `dense_ttt`: the training-time
test computed densely, the reference the memory-saving paths must reproduce. Nothing
else in the package imports these (the top layer); transformers and tokenizers are
imported inside the functions that build.
"""
