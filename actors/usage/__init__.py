"""Usage: the record of each ended request (`records`, built by the Stream or the Tokenizer)
and the Usage actor that logs, files and totals them (`actor`)."""
