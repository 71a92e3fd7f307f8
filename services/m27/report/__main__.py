"""`python -m m27.report --nats URL [--api HOST:PORT] [--out DIR]`: the report service.

Every service has the same three files: `flags.py` (the command line), `service.py` (the
shell that `serve`s) and this entry point.
"""

from m27.common.service import main
from m27.report import flags
from m27.report.service import serve

if __name__ == "__main__":
    main(flags, serve)
