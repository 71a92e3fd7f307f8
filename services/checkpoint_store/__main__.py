"""`python -m m27.checkpoint_store --nats URL [--root DIR] [--grpc HOST:PORT]`."""

from m27.checkpoint_store._service import main

main()
