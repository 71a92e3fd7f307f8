"""The embedded, one-machine system behind `m27 up`: a supervisor that runs a real
nats-server and every service, and starts again whatever exits."""

from m27.embedded.nats_server import NatsServer, nats_server_binary

__all__ = ["NatsServer", "nats_server_binary"]
