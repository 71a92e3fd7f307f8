"""m27: keeps a research lab's GPUs busy around the clock.

The user-facing surface: `m27.client.Client` (the gRPC API), the `m27` command line
(`m27.cli`), and the services under `m27.<service>` started by `m27 up`.
"""

__version__ = "0.1.0"
