"""One module per `sluice` subcommand: each has add_arguments(parser) and run(args) -> int."""
