"""The client front: the Gateway (the ZeroMQ listener and its connection budget), the Stream
of each connection (credits and backpressure), and the intake limits every request is judged
against before anything is held for it."""
