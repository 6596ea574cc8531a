"""Text on either side of the model: tokenizers, chat templates, incremental detokenizing
with stop strings, and one request's rendered output (`RequestText`). No torch here."""

from sluice.actors.text.detokenizer import IncrementalDetokenizer
from sluice.actors.text.output import RequestText
from sluice.actors.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "RequestText", "Tokenizer", "load_tokenizer"]
