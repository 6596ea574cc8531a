"""What tests share, imported as the `support` package: daemons started and stopped with the
KV invariant checked (`daemon`, and the fixtures over it in `fixtures`), raw and flooding
ZeroMQ peers, the console driver, scheduler-core builders and the near-tie rule that bf16
comparisons use."""
