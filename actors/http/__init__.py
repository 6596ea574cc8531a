"""The OpenAI-compatible HTTP front: the actor and its routes, its own accept loop over
hypercorn's protocols, the mapping between OpenAI's bodies and sluice's messages, and the
answer of one HTTP generation."""
