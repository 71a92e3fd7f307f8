"""`python -m m27.orchestrator --nats URL [--grpc HOST:PORT]`: the pipeline API.

Every service has the same three files: `flags.py` (the command line), `service.py` (the
shell that `serve`s) and this entry point.
"""

from m27.common.service import main
from m27.orchestrator import flags
from m27.orchestrator.service import serve

if __name__ == "__main__":
    main(flags, serve)
