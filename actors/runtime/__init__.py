"""The actor runtime: the actor base and its inbox, supervision, the messages between actors,
the records actors report their state in, and the one registry of types that travel inside a
daemon. No actor lives here."""
