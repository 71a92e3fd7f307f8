"""`python -m m27.node_agent --nats URL [--node-id ID] [--gpus SPEC]`.

The same three files in every service: `flags.py` (the command line), `service.py` (the
shell that `serve`s) and this entry point.
"""

from m27.common.service import run_service
from m27.node_agent import flags
from m27.node_agent.service import serve


def main() -> None:
    args = flags.build_parser().parse_args()
    run_service(flags.NAME, args, flags.overrides(args), serve)


if __name__ == "__main__":
    main()
