"""`python -m m27.node_agent --nats URL [--node-id ID] [--gpus SPEC]`.

Every service has the same three files: `flags.py` (the command line), `service.py` (the
shell that `serve`s) and this entry point.
"""

from m27.common.service import main
from m27.node_agent import flags
from m27.node_agent.service import serve

if __name__ == "__main__":
    main(flags, serve)
