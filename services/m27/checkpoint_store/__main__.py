"""`python -m m27.checkpoint_store --nats URL [--root DIR] [--grpc HOST:PORT]`.

Every service has the same three files: `flags.py` (the command line), `service.py` (the
shell that `serve`s) and this entry point.
"""

from m27.checkpoint_store import flags
from m27.checkpoint_store.service import serve
from m27.common.service import main

if __name__ == "__main__":
    main(flags, serve)
