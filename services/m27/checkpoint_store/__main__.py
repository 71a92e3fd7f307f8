"""`python -m m27.checkpoint_store --nats URL [--root DIR] [--grpc HOST:PORT]`.

The same three files in every service: `flags.py` (the command line), `service.py` (the
shell that `serve`s) and this entry point.
"""

from m27.checkpoint_store import flags
from m27.checkpoint_store.service import serve
from m27.common.service import run_service


def main() -> None:
    args = flags.build_parser().parse_args()
    run_service(flags.NAME, args, flags.overrides(args), serve)


if __name__ == "__main__":
    main()
