"""`python -m m27.scheduler --nats URL`: places queued steps on nodes with room.

Every service has the same three files: `flags.py` (the command line), `service.py` (the
shell that `serve`s) and this entry point.
"""

from m27.common.service import main
from m27.scheduler import flags
from m27.scheduler.service import serve

if __name__ == "__main__":
    main(flags, serve)
