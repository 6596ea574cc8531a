"""Text on either side of the model: tokenizers, chat templates, incremental detokenizing
with stop strings. No torch here."""

from sluice.actors.text.detokenizer import IncrementalDetokenizer
from sluice.actors.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]
